"""Placing a request another instance computed (:meth:`Scheduler.import_computed`).  No torch."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from hybridkv.cache import AllocationResult, KVCacheManager
from hybridkv.scheduler.types import HitCheck, SequenceState

__all__ = ["place_import"]


def place_import(
    mgr: KVCacheManager,
    hit_check: HitCheck | None,
    seq: SequenceState,
    output_token_ids: Sequence[int],
    fill: Callable[[tuple[list[int], ...], int, AllocationResult], None],
    missing: Mapping[int, Sequence[tuple[int, int]]] | None,
) -> bool:
    """The hit, allocation and ``fill`` of ``seq`` (its prompt computed elsewhere); False,
    changing nothing, when it cannot be placed now.  When ``fill`` or the cache's check of
    ``missing`` raises, the request is freed and the error propagates."""
    req = seq.request
    n = req.num_prompt_tokens
    # The hit is looked up on the prompt alone, so it ends before the prompt's end (found
    # by review: with two or more sampled tokens it could run past it, which the
    # allocation refused).
    hit = mgr.get_computed_blocks(req)
    if hit_check is not None and hit.num_computed_tokens:
        checked = hit_check(req, hit)  # lower-tier copies checked before use
        if checked is None:  # still being read: not now
            return False
        hit = checked
    req.append_token_ids(list(output_token_ids))  # (a request not placed is dropped)
    seq.num_output_tokens = len(output_token_ids)
    cached = hit.num_computed_tokens
    res = mgr.allocate_slots(
        req, n - cached, num_new_computed_tokens=cached, new_computed_blocks=hit
    )
    if res is None:
        return False
    req.num_computed_tokens = cached
    try:
        # Window blocks before the prompt's last window: the other instance may have
        # dropped them already, and no query here reads them; the blocks holding tokens it
        # dropped but this side keeps (its blocks are larger) are never published.
        mgr.drop_unread(req.request_id, n, missing=missing)
        fill(mgr.get_block_ids(req.request_id), cached, res)
    except BaseException:
        mgr.free(req.request_id)  # publishes only the hit it had
        raise
    req.num_computed_tokens = n
    seq.num_cached_tokens = cached
    seq.junction = hit.junction_tokens
    return True
