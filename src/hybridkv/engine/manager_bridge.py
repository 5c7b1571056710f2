"""From :class:`hybridkv.cache.KVCacheManager` results to the runner's batch description.

The cache manager answers ``allocate_slots`` with an :class:`~hybridkv.cache.AllocationResult`
(new block ids, state slots to zero, state copies before and after the step) and keeps each
request's block tables (:meth:`~hybridkv.cache.KVCacheManager.get_block_ids`; a state group's
table is ``[running slot]``).  :func:`request_step` turns that into a
:class:`~hybridkv.engine.batch.RequestStep`: token groups get their tables, state groups a
:class:`~hybridkv.engine.batch.StateIO` reading and writing the running slot (reading nothing
when the request has no computed token) with the manager's zeroing and copies.

:func:`step_from_tables` does the same from tables already read (the scheduler's
:class:`~hybridkv.scheduler.ScheduledRequest` carries them), which is what
:class:`~hybridkv.engine.llm_engine.LLMEngine` uses.

:class:`ManagerCache` wraps a manager behind the same small interface as
:class:`~hybridkv.engine.toy_cache.ToyCache`, so :class:`~hybridkv.engine.generate.PagedGenerator`
can drive the runner with real prefix caching (hash-based hits, eviction, checkpoints).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hybridkv.cache import AllocationResult, ComputedBlocks, KVCacheManager, Request
from hybridkv.engine.batch import RequestStep, SlotCopy, StateIO
from hybridkv.engine.errors import BatchError
from hybridkv.errors import AllocationError
from hybridkv.plan import MemoryLayout
from hybridkv.specs import CacheKind

__all__ = ["ManagerCache", "request_step", "step_from_tables"]


def request_step(
    manager: KVCacheManager,
    request_id: str,
    token_ids: Sequence[int],
    num_computed: int,
    result: AllocationResult,
) -> RequestStep:
    """The runner's description of one request's step after ``allocate_slots`` returned
    ``result``.  ``num_computed`` counts the tokens already in the cache, a prefix hit
    included.  Reads the manager; changes nothing."""
    return step_from_tables(
        manager.layout,
        manager.get_block_ids(request_id),
        request_id=request_id,
        token_ids=token_ids,
        num_computed=num_computed,
        result=result,
    )


def step_from_tables(
    layout: MemoryLayout,
    tables: Sequence[Sequence[int]],
    *,
    request_id: str,
    token_ids: Sequence[int],
    num_computed: int,
    result: AllocationResult,
) -> RequestStep:
    """A :class:`RequestStep` from a request's block tables (one per group of ``layout``, as
    :meth:`~hybridkv.cache.KVCacheManager.get_block_ids` returns them right after the
    allocation ``result``) and the state work that allocation ordered.

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
    )


@dataclass
class _Admitted:
    request: Request
    hit: ComputedBlocks | None


class ManagerCache:
    """A :class:`KVCacheManager` behind the interface :class:`PagedGenerator` drives.

    Prefix hits are the manager's own (found by hashing at :meth:`add`); ``prefix_of`` is not
    needed and refused.  Raises :class:`~hybridkv.errors.AllocationError` when the manager has
    no room for a step (``allocate_slots`` returned None; nothing changed).
    """

    def __init__(self, manager: KVCacheManager) -> None:
        self.manager = manager
        self._requests: dict[str, _Admitted] = {}
        #: Prefix-hit length found for each request at admission (tokens).
        self.hits: dict[str, int] = {}

    def add(
        self,
        request_id: str,
        prompt: Sequence[int] = (),
        *,
        prefix_of: str | None = None,
        prefix_len: int = 0,
    ) -> int:
        """Admit a request; returns the tokens its prefix hit already computed."""
        if prefix_of is not None or prefix_len:
            raise BatchError(
                "ManagerCache.add: the cache manager finds prefix hits itself; do not pass "
                f"prefix_of ({prefix_of!r}) or prefix_len ({prefix_len})"
            )
        request = self.manager.make_request(request_id, list(prompt))
        hit = self.manager.get_computed_blocks(request)
        self._requests[request_id] = _Admitted(request, hit)
        self.hits[request_id] = hit.num_computed_tokens
        return hit.num_computed_tokens

    def num_computed(self, request_id: str) -> int:
        entry = self._requests[request_id]
        if entry.hit is not None:
            return entry.hit.num_computed_tokens
        return entry.request.num_computed_tokens

    def schedule(self, request_id: str, token_ids: Sequence[int]) -> RequestStep:
        entry = self._requests[request_id]
        computed = self.num_computed(request_id)
        if entry.hit is not None:
            result = self.manager.allocate_slots(
                entry.request,
                len(token_ids),
                num_new_computed_tokens=entry.hit.num_computed_tokens,
                new_computed_blocks=entry.hit,
            )
        else:
            result = self.manager.allocate_slots(entry.request, len(token_ids))
        if result is None:
            raise AllocationError(
                f"ManagerCache: no room for {len(token_ids)} new tokens of {request_id!r}"
            )
        entry.hit = None
        return request_step(self.manager, request_id, token_ids, computed, result)

    def commit(self, step: RequestStep, new_token: int | None = None) -> None:
        """Record that ``step`` ran (and the token it sampled, if any)."""
        request = self._requests[step.request_id].request
        request.num_computed_tokens = step.end
        if new_token is not None:
            request.append_token_ids([new_token])

    def free(self, request_id: str) -> None:
        self.manager.free(request_id)
        del self._requests[request_id]
