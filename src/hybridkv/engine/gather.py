"""Index arithmetic of one step: which cache slots a request writes and which it reads.

All positions are cache indices (0-based token indices of the request); spans are half-open.
For a token group with manager ``block_size`` ``B`` and ``kernel_block_size`` ``K`` (``ratio =
B // K``), token ``p`` lives in

* manager block ``table[p // B]`` (the id the cache manager hands out), and
* kernel block ``table[p // B] * ratio + (p % B) // K`` at offset ``p % K``.

Example: ``B = 8``, ``K = 4``, table ``(5, 9)``: token 13 is in manager block 9, kernel block
``9 * 2 + 1 = 19``, offset 1.

A step of ``T`` new tokens after ``n`` computed ones writes tokens ``[n, n + T)`` and its
queries read the union of what each query sees (:func:`visible_spans`), e.g. a sliding window
of ``W`` reads ``[max(0, n - W + 1), n + T)``.  Only those tokens are gathered, so released
blocks (the null block) and never-written memory are never read.  The per-query rule
(:func:`visibility_mask`) is the one of Hugging Face transformers' masks: sliding ``k > q - W``,
chunked ``k // C == q // C``, always ``k <= q``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple, cast

import torch

from hybridkv.engine.errors import BatchError
from hybridkv.plan import NULL_BLOCK_ID, GroupPlan
from hybridkv.specs import CacheKind, CacheSpec, ChunkedLocalSpec, SlidingWindowSpec

__all__ = [
    "SegmentIndex",
    "kernel_slots",
    "segment_index",
    "visibility_mask",
    "visible_spans",
]

Span = tuple[int, int]


def _full_spans(spec: CacheSpec, start: int, end: int) -> list[Span]:
    return [(0, end)]


def _sliding_spans(spec: CacheSpec, start: int, end: int) -> list[Span]:
    spec = cast(SlidingWindowSpec, spec)
    lo = max(0, start - spec.window + 1)
    sinks = min(spec.sink_tokens, end)
    if sinks >= lo:
        return [(0, end)]
    return [(0, sinks), (lo, end)] if sinks > 0 else [(lo, end)]


def _chunked_spans(spec: CacheSpec, start: int, end: int) -> list[Span]:
    spec = cast(ChunkedLocalSpec, spec)
    return [(start // spec.chunk_size * spec.chunk_size, end)]


def _full_mask(spec: CacheSpec, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    return k <= q


def _sliding_mask(spec: CacheSpec, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    spec = cast(SlidingWindowSpec, spec)
    in_window = (k > q - spec.window) | (k < spec.sink_tokens)
    return (k <= q) & in_window


def _chunked_mask(spec: CacheSpec, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    spec = cast(ChunkedLocalSpec, spec)
    return (k <= q) & (k // spec.chunk_size == q // spec.chunk_size)


#: kind -> (visible spans of a step, per-query mask).  Token kinds only; state kinds read none.
_RULES: dict[
    CacheKind,
    tuple[
        Callable[[CacheSpec, int, int], list[Span]],
        Callable[[CacheSpec, torch.Tensor, torch.Tensor], torch.Tensor],
    ],
] = {
    CacheKind.FULL: (_full_spans, _full_mask),
    CacheKind.MLA: (_full_spans, _full_mask),
    CacheKind.SLIDING: (_sliding_spans, _sliding_mask),
    CacheKind.CHUNKED: (_chunked_spans, _chunked_mask),
}


def _rules(
    spec: CacheSpec,
) -> tuple[
    Callable[[CacheSpec, int, int], list[Span]],
    Callable[[CacheSpec, torch.Tensor, torch.Tensor], torch.Tensor],
]:
    found = _RULES.get(spec.kind)
    if found is None:
        valid = ", ".join(k.value for k in _RULES)
        raise BatchError(
            f"spec.kind: {spec.kind.value!r} keeps no tokens to gather; valid: {valid}"
        )
    return found


def visible_spans(spec: CacheSpec, start: int, end: int) -> list[Span]:
    """Token spans the queries at ``[start, end)`` read together, sorted and disjoint."""
    return _rules(spec)[0](spec, start, end)


def visibility_mask(spec: CacheSpec, queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """``[len(queries), len(keys)]`` bool: may the query at ``queries[i]`` read ``keys[j]``."""
    return _rules(spec)[1](spec, queries[:, None], keys[None, :])


class SegmentIndex(NamedTuple):
    """Where one request's tokens go and come from, in one token group, for one step.

    ``write_*`` have one entry per new token, ``read_*`` and ``key_positions`` one per gathered
    key (sorted cache indices); ``mask`` is ``[num_new, num_keys]``.
    """

    write_blocks: torch.Tensor
    write_offsets: torch.Tensor
    read_blocks: torch.Tensor
    read_offsets: torch.Tensor
    key_positions: torch.Tensor
    mask: torch.Tensor


def kernel_slots(
    table: Sequence[int], positions: Sequence[int], block_size: int, kernel_block_size: int
) -> tuple[list[int], list[int]]:
    """Kernel block ids and offsets of ``positions`` under a manager block ``table``."""
    ratio = block_size // kernel_block_size
    blocks = [
        table[p // block_size] * ratio + (p % block_size) // kernel_block_size for p in positions
    ]
    offsets = [p % kernel_block_size for p in positions]
    return blocks, offsets


def _check_blocks(
    group: GroupPlan,
    table: Sequence[int],
    positions: Sequence[int],
    what: str,
    request_id: str,
) -> None:
    for p in positions:
        if table[p // group.block_size] == NULL_BLOCK_ID:
            raise BatchError(
                f"block_tables[{group.group_id}] of request {request_id!r}: token {p} "
                f"({what}) is in block index {p // group.block_size}, which holds the null "
                "block; it must hold a real block id"
            )


def segment_index(
    group: GroupPlan,
    table: Sequence[int],
    *,
    num_computed: int,
    num_new: int,
    num_block_ids: int,
    request_id: str,
    device: torch.device | str = "cpu",
) -> SegmentIndex:
    """The write and read indices of one request in token group ``group``.

    ``table`` holds manager block ids.  Raises :class:`BatchError` (naming the group, request
    and token) when the table is too short for ``num_computed + num_new`` tokens, holds an id
    outside ``[0, num_block_ids)``, or maps a written or read token to the null block.
    Mutates nothing.
    """
    end = num_computed + num_new
    need = -(-end // group.block_size)
    if len(table) < need:
        raise BatchError(
            f"block_tables[{group.group_id}] of request {request_id!r}: {len(table)} blocks "
            f"cover {len(table) * group.block_size} tokens, the step needs {end} "
            f"({need} blocks of {group.block_size})"
        )
    for b in table:
        if not 0 <= b < num_block_ids:
            raise BatchError(
                f"block_tables[{group.group_id}] of request {request_id!r}: block id {b} is "
                f"outside [0, {num_block_ids})"
            )
    new = range(num_computed, end)
    keys = [p for lo, hi in visible_spans(group.spec, num_computed, end) for p in range(lo, hi)]
    _check_blocks(group, table, new, "written", request_id)
    _check_blocks(group, table, keys, "read", request_id)
    wb, wo = kernel_slots(table, new, group.block_size, group.kernel_block_size)
    rb, ro = kernel_slots(table, keys, group.block_size, group.kernel_block_size)
    key_pos = torch.tensor(keys, dtype=torch.long, device=device)
    queries = torch.arange(num_computed, end, device=device)
    mask = visibility_mask(group.spec, queries, key_pos)
    return SegmentIndex(
        write_blocks=torch.tensor(wb, dtype=torch.long, device=device),
        write_offsets=torch.tensor(wo, dtype=torch.long, device=device),
        read_blocks=torch.tensor(rb, dtype=torch.long, device=device),
        read_offsets=torch.tensor(ro, dtype=torch.long, device=device),
        key_positions=key_pos,
        mask=mask,
    )
