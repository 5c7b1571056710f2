"""Test support: the real :class:`~hybridkv.cache.KVCacheManager` behind the interface
:class:`support.paged_generator.PagedGenerator` drives (the one
:class:`support.toy_cache.ToyCache` implements), so the runner can be exercised with real prefix
caching (hash-based hits, eviction, checkpoints) without the scheduler.

:func:`request_step` describes one request's step from the manager's tables right after
``allocate_slots``, through the engine's own
:func:`~hybridkv.engine.manager_bridge.step_from_tables`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hybridkv.cache import AllocationResult, ComputedBlocks, KVCacheManager, Request
from hybridkv.engine.batch import RequestStep
from hybridkv.engine.errors import BatchError
from hybridkv.engine.manager_bridge import step_from_tables
from hybridkv.errors import AllocationError

__all__ = ["ManagerCache", "request_step"]


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
