"""The unbounded-cache bound on prefix hits: what no KV cache manager can beat.

Standard library only (the vLLM driver imports it from vLLM's own interpreter).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from hybridkv.workloads.types import WorkloadError

__all__ = ["ideal_hit_tokens"]


class _TokenStream(Protocol):
    @property
    def prompt_token_ids(self) -> tuple[int, ...]: ...

    @property
    def output_token_ids(self) -> tuple[int, ...]: ...


def ideal_hit_tokens(requests: Iterable[_TokenStream], block_size: int) -> int:
    """Prompt tokens that hit with an unbounded cache at ``block_size`` granularity, requests
    served one after another in the given order (for step requests:
    :func:`~hybridkv.workloads.steps.arrival_order`).

    A request hits the longest run of whole blocks some earlier request cached, capped at
    ``prompt_len - 1`` tokens (the last prompt token is always computed, for its logits, as in
    vLLM).  Each request caches its prompt and output except the last output token, which is
    sampled but never fed back.  Blocks are identified by a chain of Python tuple hashes
    (deterministic for integer tokens).  Raises :class:`WorkloadError` when ``block_size`` is
    not positive."""
    if block_size < 1:
        raise WorkloadError(f"ideal_hit_tokens: block_size must be >= 1, got {block_size}")
    seen: set[int] = set()
    total = 0
    for r in requests:
        seq = tuple(r.prompt_token_ids) + tuple(r.output_token_ids)
        hittable = (len(r.prompt_token_ids) - 1) // block_size
        key, hit = 0, 0
        for b in range((len(seq) - 1) // block_size):
            key = hash((key, seq[b * block_size : (b + 1) * block_size]))
            if hit == b * block_size and b < hittable and key in seen:
                hit += block_size
            seen.add(key)
        total += hit
    return total
