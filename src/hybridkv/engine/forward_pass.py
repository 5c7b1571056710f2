"""One forward pass of a step: the attention step the paged attention function calls into.

A pass runs ``rows`` batch rows; each row holds one or more *segments*, a segment being one
request's new tokens (``row``, ``start``, ``length``).  Segments tile the rows exactly (no
padding), so the new tokens of a group, flattened row-major, are written with one indexed
store per layer.

For an ordinary attention layer, :meth:`ForwardPass.attention` writes the new K/V into the
layer's views at the slots of :class:`~hybridkv.engine.gather.SegmentIndex`, gathers the
visible keys back (so the new tokens make the same round trip through the cache as the old
ones, dtype casts included) and runs :func:`~hybridkv.engine.attention.attend` once per
*bucket* of segments with the same number of new tokens (a decode step is one bucket): each
segment's keys are padded to the bucket's longest with copies of its first visible key, which
its mask hides.  The padded read indices and masks depend only on the group, so they are built
once per pass and reused by every layer of the group.

For an MLA layer, :meth:`ForwardPass.page_latent` (called by the cache layer) writes and
gathers the latent and returns, per row, the segments' visible latents one after another (rows
padded with zeros to the longest); the attention call then slices each segment's expanded keys
out of its row and attends segment by segment.
"""

from __future__ import annotations

from typing import NamedTuple

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


class _Bucket(NamedTuple):
    """Segments with ``length`` new tokens each, attended together.

    ``read_blocks`` / ``read_offsets``: ``len(members) * width`` kernel slots, segment after
    segment, each padded to ``width`` keys; ``mask``: ``[len(members), length, width]``.
    """

    members: tuple[int, ...]
    length: int
    width: int
    read_blocks: torch.Tensor
    read_offsets: torch.Tensor
    mask: torch.Tensor


def _bucket(members: list[int], length: int, index: list[SegmentIndex]) -> _Bucket:
    parts = [index[n] for n in members]
    width = max(len(p.key_positions) for p in parts)
    mask = torch.zeros((len(parts), length, width), dtype=torch.bool, device=parts[0].mask.device)
    blocks, offsets = [], []
    for i, p in enumerate(parts):
        pad = width - len(p.key_positions)
        mask[i, :, : len(p.key_positions)] = p.mask
        blocks += [p.read_blocks, p.read_blocks[:1].expand(pad)]
        offsets += [p.read_offsets, p.read_offsets[:1].expand(pad)]
    return _Bucket(tuple(members), length, width, torch.cat(blocks), torch.cat(offsets), mask)


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
        #: The layer whose cache the model updated last (see hf_cache.UpdateListener).
        self.updated_layer: int | None = None
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
        # group -> segments bucketed by length, built on first use (attention layers only).
        self._buckets: dict[int, list[_Bucket]] = {}
        # (group, bucket, view shape) -> the bucket's read index into such a view.
        self._reads: dict[tuple[int, int, tuple[int, ...]], tuple[torch.Tensor, ...]] = {}
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
        if layer not in self.binding.tokens and self.updated_layer is not None:
            layer = self.updated_layer  # a module shared by several layers (zamba2)
        self.updated_layer = None
        source = self.binding.shared.get(layer)
        if source is not None:  # KV-shared: the source layer wrote these tokens already
            route = self._route(source, sliding_window)
            return self._paged_attention(
                route, query, key, value, scaling=scaling, softcap=softcap, sinks=sinks, write=False
            )
        route = self._route(layer, sliding_window)
        if route.kind is RouteKind.ATTENTION:
            return self._paged_attention(
                route, query, key, value, scaling=scaling, softcap=softcap, sinks=sinks
            )
        pairs = self._split_gathered(route, key, value)
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

    def _group_buckets(self, gid: int) -> list[_Bucket]:
        found = self._buckets.get(gid)
        if found is None:
            by_length: dict[int, list[int]] = {}
            for n, seg in enumerate(self.segments):
                by_length.setdefault(seg.length, []).append(n)
            index = self.index[gid]
            found = self._buckets[gid] = [
                _bucket(members, length, index) for length, members in by_length.items()
            ]
        return found

    def _gather(
        self, route: TokenRoute, view: torch.Tensor, n: int, bucket: _Bucket
    ) -> torch.Tensor:
        """The bucket's padded keys ``[R * width, heads, dim]`` out of ``view``.  The index
        is computed once per group, bucket and view shape (every layer of a group shares it)."""
        key = (route.group.group_id, n, tuple(view.shape[:2]))
        at = self._reads.get(key)
        if at is None:
            _, at = _kernel_view(view, route, bucket.read_blocks, bucket.read_offsets)
            self._reads[key] = at
        if len(at) == 2:  # a kernel-granular view, indexed as is
            return view[at]
        # a manager-granular view, indexed as [blocks, ratio, kernel_block_size, ...] (no copy)
        group = route.group
        ratio = group.block_size // group.kernel_block_size
        split = view.view(view.shape[0], ratio, group.kernel_block_size, *view.shape[2:])
        return split[at]

    def _bucket_queries(self, query: torch.Tensor, bucket: _Bucket) -> torch.Tensor:
        """``[R, H, T, D]`` queries of the bucket's segments."""
        segs = [self.segments[n] for n in bucket.members]
        b, heads, total, dim = query.shape
        if (
            bucket.length == total
            and len(segs) == b
            and all(s.row == i for i, s in enumerate(segs))
        ):
            return query  # one segment per row, all of this length
        if b == 1 and len(segs) * bucket.length == total and len(segs) == len(self.segments):
            # one packed row of equal segments, in order
            return query[0].view(heads, len(segs), bucket.length, dim).transpose(0, 1)
        return torch.stack([query[s.row, :, s.start : s.start + s.length] for s in segs])

    def _paged_attention(
        self,
        route: TokenRoute,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        scaling: float,
        softcap: float | None,
        sinks: torch.Tensor | None,
        write: bool = True,
    ) -> torch.Tensor:
        """Write the new tokens' K/V ``[B, Hkv, L, D]`` into the views (unless ``write`` is
        false: a KV-shared layer reading its source's), then attend bucket by bucket over the
        gathered keys; returns ``[B, L, H, Dv]``."""
        views = self.views.attention_kv(route.layer, route.slot)
        gid = route.group.group_id
        if write:
            self._write_kv(route, views, key, value)
        b, q_heads, total, _ = query.shape
        out = query.new_zeros((b, total, q_heads, value.shape[-1]))
        for n, bucket in enumerate(self._group_buckets(gid)):
            gathered = []
            for view, new in zip(views, (key, value), strict=True):
                g = self._gather(route, view, n, bucket).to(device=new.device, dtype=new.dtype)
                rows = len(bucket.members)
                gathered.append(g.view(rows, bucket.width, *g.shape[1:]).transpose(1, 2))
            res = attend(
                self._bucket_queries(query, bucket),
                gathered[0],
                gathered[1],
                bucket.mask,
                scaling=scaling,
                softcap=softcap,
                sinks=sinks,
            )
            self._scatter(out, res, bucket)
        return out

    def _write_kv(
        self,
        route: TokenRoute,
        views: tuple[torch.Tensor, torch.Tensor],
        key: torch.Tensor,
        value: torch.Tensor,
    ) -> None:
        """Store the new tokens' K and V ``[B, Hkv, L, D]`` at their slots of ``views``."""
        blocks, offsets = self.write[route.group.group_id]
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

    def _scatter(self, out: torch.Tensor, res: torch.Tensor, bucket: _Bucket) -> None:
        """Put a bucket's ``[R, T, H, Dv]`` outputs at its segments' rows of ``out``."""
        segs = [self.segments[n] for n in bucket.members]
        if res.shape[:2] == out.shape[:2] and all(s.row == i for i, s in enumerate(segs)):
            out.copy_(res)
            return
        if out.shape[0] == 1 and len(segs) == len(self.segments):
            out[0] = res.reshape(-1, *res.shape[2:])
            return
        for i, s in enumerate(segs):
            out[s.row, s.start : s.start + s.length] = res[i]

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
