"""One forward pass of a step: the attention step the paged attention function calls into.

A pass runs ``rows`` batch rows; each row holds one or more *segments*, a segment being one
request's new tokens (``row``, ``start``, ``length``).  Segments tile the rows exactly (no
padding), so the new tokens of a group, flattened row-major, are written with one indexed
store per layer.

For an ordinary attention layer, :meth:`ForwardPass.attention` writes the new K/V into the
layer's views at the slots of :class:`~hybridkv.engine.gather.SegmentIndex`, gathers each
segment's visible keys back (so the new tokens make the same round trip through the cache as
the old ones, dtype casts included) and runs :func:`~hybridkv.engine.attention.attend` per
segment with the segment's mask.  For an MLA layer, :meth:`ForwardPass.page_latent` (called by
the cache layer) writes and gathers the latent and returns, per row, the segments' visible
latents one after another (rows padded with zeros to the longest); the attention call then
slices each segment's expanded keys out of its row.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar, NamedTuple

import torch

from hybridkv.engine.attention import attend
from hybridkv.engine.binding import ModelBinding, RouteKind, TokenRoute
from hybridkv.engine.errors import EngineError
from hybridkv.engine.gather import SegmentIndex
from hybridkv.engine.views import PagedKVViews, kernel_index
from hybridkv.specs import SlidingWindowSpec

__all__ = ["ForwardPass", "Segment"]


class Segment(NamedTuple):
    """One request's new tokens inside one pass: batch row, start in the row, length."""

    request: int
    row: int
    start: int
    length: int


def _kernel_view(
    view: torch.Tensor, route: TokenRoute, blocks: torch.Tensor, offsets: torch.Tensor
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    group = route.group
    return kernel_index(
        view,
        num_block_ids=route.num_block_ids,
        block_size=group.block_size,
        kernel_block_size=group.kernel_block_size,
        blocks=blocks.to(view.device),
        offsets=offsets.to(view.device),
    )


class ForwardPass:
    """The attention step of one forward pass (see the module docstring).

    ``segments`` tile the pass's ``rows`` exactly, in row-major order; ``index[group]`` holds
    one :class:`SegmentIndex` per segment.  Writes into ``views``; raises
    :class:`EngineError` when the model and the views disagree on shapes or kinds.
    """

    def __init__(
        self,
        binding: ModelBinding,
        views: PagedKVViews,
        segments: list[Segment],
        index: dict[int, list[SegmentIndex]],
        rows: int,
    ) -> None:
        self.binding = binding
        self.views = views
        self.segments = segments
        # group -> one SegmentIndex per segment (segment order).
        self.index = index
        # group -> write indices of all new tokens, row-major (segments tile the rows).
        self.write = {
            gid: (
                torch.cat([s.write_blocks for s in idx]),
                torch.cat([s.write_offsets for s in idx]),
            )
            for gid, idx in index.items()
        }
        # group -> start of each segment's keys in its row of gathered latents (MLA only).
        self.kv_starts: dict[int, list[int]] = {}
        self.kv_rows: dict[int, list[int]] = {}
        for gid, idx in index.items():
            starts, lengths = [], [0] * rows
            for seg, s in zip(segments, idx, strict=True):
                starts.append(lengths[seg.row])
                lengths[seg.row] += len(s.key_positions)
            self.kv_starts[gid] = starts
            self.kv_rows[gid] = lengths

    def _route(self, layer: int, sliding_window: int | None) -> TokenRoute:
        route = self.binding.tokens.get(layer)
        if route is None:
            raise EngineError(
                f"attention: layer {layer} called attention but the layout pages no K/V for it"
            )
        spec = route.group.spec
        window = spec.window if isinstance(spec, SlidingWindowSpec) else None
        if sliding_window is not None and sliding_window != window:
            raise EngineError(
                f"attention: layer {layer} runs with sliding_window={sliding_window}, but group "
                f"{route.group.group_id} pages it as {spec.kind.value} (window {window})"
            )
        return route

    def attention(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        scaling: float,
        softcap: float | None,
        sinks: torch.Tensor | None,
        sliding_window: int | None,
    ) -> torch.Tensor:
        layer = int(getattr(module, "layer_idx", -1))
        route = self._route(layer, sliding_window)
        pairs = self._KEYS[route.kind](self, route, key, value)
        b, heads, length, _ = query.shape
        out = query.new_zeros((b, length, heads, value.shape[-1]))
        mask_of = self.index[route.group.group_id]
        for seg, idx, (k, v) in zip(self.segments, mask_of, pairs, strict=True):
            rows = slice(seg.start, seg.start + seg.length)
            out[seg.row, rows] = attend(
                query[seg.row, :, rows],
                k,
                v,
                idx.mask,
                scaling=scaling,
                softcap=softcap,
                sinks=sinks,
            )
        return out

    def _split_gathered(
        self, route: TokenRoute, key: torch.Tensor, value: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-segment K/V out of the gathered rows an MLA cache layer returned."""
        gid = route.group.group_id
        out = []
        for seg, idx, start in zip(
            self.segments, self.index[gid], self.kv_starts[gid], strict=True
        ):
            span = slice(start, start + len(idx.key_positions))
            out.append((key[seg.row, :, span], value[seg.row, :, span]))
        return out

    def _page_kv(
        self, route: TokenRoute, key: torch.Tensor, value: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Write the new tokens' K/V ``[B, Hkv, L, D]``, return each segment's gathered
        ``([Hkv, S, D], [Hkv, S, Dv])``."""
        views = self.views.attention_kv(route.layer, route.slot)
        gid = route.group.group_id
        blocks, offsets = self.write[gid]
        gathered: list[list[torch.Tensor]] = [[], []]
        for part, (view, new) in enumerate(zip(views, (key, value), strict=True)):
            b, heads, length, dim = new.shape
            if tuple(view.shape[2:]) != (heads, dim):
                raise EngineError(
                    f"views: layer {route.layer} {'KV'[part]} view has heads x dim "
                    f"{tuple(view.shape[2:])}; the model produces {(heads, dim)}"
                )
            target, where = _kernel_view(view, route, blocks, offsets)
            flat = new.transpose(1, 2).reshape(b * length, heads, dim)
            target[where] = flat.to(device=view.device, dtype=view.dtype)
            for idx in self.index[gid]:
                _, at = _kernel_view(view, route, idx.read_blocks, idx.read_offsets)
                keys = target[at].to(device=new.device, dtype=new.dtype)
                gathered[part].append(keys.transpose(0, 1))
        return list(zip(gathered[0], gathered[1], strict=True))

    def page_latent(
        self, layer: int, kv_latent: torch.Tensor, k_rope: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        route = self._route(layer, None)
        view = self.views.mla_latent(route.layer, route.slot)
        gid = route.group.group_id
        rank = kv_latent.shape[-1]
        new = torch.cat([kv_latent, k_rope], dim=-1)[:, 0]
        b, length, dim = new.shape
        if view.shape[-1] != dim:
            raise EngineError(
                f"views: layer {layer} latent view has width {view.shape[-1]}; the model "
                f"produces {dim} (kv_lora_rank + rope dim)"
            )
        blocks, offsets = self.write[gid]
        target, where = _kernel_view(view, route, blocks, offsets)
        target[where] = new.reshape(b * length, dim).to(device=view.device, dtype=view.dtype)
        width = max(self.kv_rows[gid])
        out = new.new_zeros((b, width, dim))
        for seg, idx, start in zip(
            self.segments, self.index[gid], self.kv_starts[gid], strict=True
        ):
            _, at = _kernel_view(view, route, idx.read_blocks, idx.read_offsets)
            latent = target[at].to(device=new.device, dtype=new.dtype)
            out[seg.row, start : start + len(idx.key_positions)] = latent
        return out[..., :rank].unsqueeze(1), out[..., rank:].unsqueeze(1)

    #: route kind -> how the pass gets each segment's keys and values.
    _KEYS: ClassVar[
        dict[
            RouteKind,
            Callable[
                [ForwardPass, TokenRoute, torch.Tensor, torch.Tensor],
                list[tuple[torch.Tensor, torch.Tensor]],
            ],
        ]
    ] = {
        RouteKind.ATTENTION: _page_kv,
        RouteKind.MLA: _split_gathered,
    }
