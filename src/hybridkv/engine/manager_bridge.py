"""From :class:`hybridkv.cache.KVCacheManager` results to the runner's batch description.

The cache manager answers ``allocate_slots`` with an :class:`~hybridkv.cache.AllocationResult`
(new block ids, state slots to zero, state copies before and after the step) and keeps each
request's block tables (:meth:`~hybridkv.cache.KVCacheManager.get_block_ids`; a state group's
table is ``[running slot]``; the scheduler's :class:`~hybridkv.scheduler.ScheduledRequest`
carries them).  :func:`step_from_tables` turns both into a
:class:`~hybridkv.engine.batch.RequestStep`: token groups get their tables, state groups a
:class:`~hybridkv.engine.batch.StateIO` reading and writing the running slot (reading nothing
when the request has no computed token) with the manager's zeroing and copies.
:class:`~hybridkv.engine.llm_engine.LLMEngine` calls it for every scheduled request.
"""

from __future__ import annotations

from collections.abc import Sequence

from hybridkv.cache import AllocationResult
from hybridkv.engine.batch import RequestStep, SlotCopy, StateIO
from hybridkv.engine.errors import BatchError
from hybridkv.plan import MemoryLayout
from hybridkv.specs import CacheKind

__all__ = ["step_from_tables"]


def step_from_tables(
    layout: MemoryLayout,
    tables: Sequence[Sequence[int]],
    *,
    request_id: str,
    token_ids: Sequence[int],
    num_computed: int,
    result: AllocationResult,
    num_logits: int = 1,
) -> RequestStep:
    """A :class:`RequestStep` from a request's block tables (one per group of ``layout``, as
    :meth:`~hybridkv.cache.KVCacheManager.get_block_ids` returns them right after the
    allocation ``result``) and the state work that allocation ordered.  ``num_logits``: see
    :class:`RequestStep` (a speculative step's ``token_ids`` end with its drafts).

    Token groups get their tables; a state group gets a :class:`StateIO` reading and writing
    its running slot ``tables[g][0]`` (reading nothing when ``num_computed`` is 0), with the
    allocation's zeroing and copies for that group, in the allocation's order.  Raises
    :class:`BatchError` when ``tables`` does not have one table per group or a state group has
    no running slot."""
    if len(tables) != len(layout.groups):
        raise BatchError(
            f"request {request_id!r}: {len(tables)} block tables for the layout's "
            f"{len(layout.groups)} groups"
        )
    block_tables: dict[int, tuple[int, ...]] = {}
    states: dict[int, StateIO] = {}
    for group in layout.groups:
        gid = group.group_id
        if group.spec.kind is not CacheKind.STATE:
            block_tables[gid] = tuple(tables[gid])
            continue
        if len(tables[gid]) != 1:
            raise BatchError(
                f"request {request_id!r}: state group {gid} needs one running slot, its table "
                f"is {list(tables[gid])}"
            )
        running = tables[gid][0]
        states[gid] = StateIO(
            read_slot=running if num_computed else None,
            write_slot=running,
            zero_before=tuple(s.block for s in result.zero_before if s.group_id == gid),
            copies_before=tuple(
                SlotCopy(src=c.src, dst=c.dst) for c in result.copies_before if c.group_id == gid
            ),
            copies_after=tuple(
                SlotCopy(src=c.src, dst=c.dst) for c in result.copies_after if c.group_id == gid
            ),
        )
    return RequestStep(
        request_id=request_id,
        token_ids=tuple(token_ids),
        num_computed=num_computed,
        block_tables=block_tables,
        states=states,
        num_logits=num_logits,
    )
