"""Bounds on prefix hits: what no KV cache manager can beat.

* :func:`ideal_hit_tokens`: an unbounded cache;
* :func:`replay_hit_tokens`: a cache of a fixed number of blocks, replayed request after
  request with no request running concurrently, under LRU (what a recency order achieves) or
  Belady's rule (evict the block whose next use lies furthest ahead, knowing the future).
  Belady's rule is optimal for plain paging, not proven so for prefix hits (a block counts
  only after every block before it), so it is a reference for what predicting which
  prefixes come back could add, not a strict bound.  The gap between LRU here and a real
  manager is what running requests, windows and states cost.

Standard library only (the vLLM driver imports it from vLLM's own interpreter).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Protocol

from hybridkv.workloads.types import WorkloadError

__all__ = ["REPLAY_POLICIES", "ideal_hit_tokens", "replay_hit_tokens"]

#: Eviction rules :func:`replay_hit_tokens` replays.
REPLAY_POLICIES = ("lru", "belady", "2q")
#: 2Q's parameters, those of :mod:`hybridkv.cache.pool_base` (this module imports nothing
#: from the cache: the vLLM driver loads it in vLLM's interpreter; a test keeps them equal).
_PROBATION_SHARE = 0.1
_GHOST_PER_BLOCK = 5


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


def _block_keys(r: _TokenStream, block_size: int) -> tuple[list[int], int]:
    """The chained keys of the blocks ``r`` caches (prompt and output but the last output
    token) and how many of them a hit may cover (``(prompt_len - 1) // block_size``)."""
    seq = tuple(r.prompt_token_ids) + tuple(r.output_token_ids)
    keys, key = [], 0
    for b in range((len(seq) - 1) // block_size):
        key = hash((key, seq[b * block_size : (b + 1) * block_size]))
        keys.append(key)
    return keys, (len(r.prompt_token_ids) - 1) // block_size


def replay_hit_tokens(
    requests: Iterable[_TokenStream],
    block_size: int,
    capacities: Sequence[int],
    policy: str = "lru",
) -> list[int]:
    """Prompt tokens that hit a cache of ``capacities[i]`` blocks of ``block_size`` tokens,
    one total per capacity, requests served one after another in the given order (each looks
    up the longest cached run of whole blocks, capped as in :func:`ideal_hit_tokens`, then
    caches its blocks, then the cache evicts down to its capacity by ``policy``: ``"lru"``,
    ``"belady"`` or ``"2q"``).  Raises :class:`WorkloadError` for a bad block size, capacity
    or policy."""
    if block_size < 1:
        raise WorkloadError(f"replay_hit_tokens: block_size must be >= 1, got {block_size}")
    if policy not in REPLAY_POLICIES:
        raise WorkloadError(
            f"replay_hit_tokens: policy {policy!r} is unknown; valid: {', '.join(REPLAY_POLICIES)}"
        )
    for c in capacities:
        if not isinstance(c, int) or c < 1:
            raise WorkloadError(f"replay_hit_tokens: capacities must be >= 1 blocks, got {c!r}")
    streams = [_block_keys(r, block_size) for r in requests]
    # Per request index, when each of its blocks is used next (Belady's look-ahead).
    last_seen: dict[int, int] = {}
    next_use: list[list[int]] = [[] for _ in streams]
    for i in range(len(streams) - 1, -1, -1):
        keys = streams[i][0]
        next_use[i] = [last_seen.get(k, len(streams)) for k in keys]
        for k in keys:
            last_seen[k] = i
    return [_replay(streams, next_use, block_size, cap, policy) for cap in capacities]


def _replay(
    streams: list[tuple[list[int], int]],
    next_use: list[list[int]],
    block_size: int,
    capacity: int,
    policy: str,
) -> int:
    if policy == "2q":
        return _replay_2q(streams, block_size, capacity)
    lru: OrderedDict[int, None] = OrderedDict()
    due: dict[int, int] = {}  # belady: block -> its next use
    heap: list[tuple[int, int]] = []  # belady: (-next use, block), stale entries skipped
    total = 0
    for i, (keys, hittable) in enumerate(streams):
        held = lru if policy == "lru" else due
        hit = 0
        while hit < hittable and keys[hit] in held:
            hit += 1
        total += hit * block_size
        for k, nxt in zip(keys, next_use[i], strict=True):
            if policy == "lru":
                lru[k] = None
                lru.move_to_end(k)
            else:
                due[k] = nxt
                heapq.heappush(heap, (-nxt, k))
        if policy == "lru":
            while len(lru) > capacity:
                lru.popitem(last=False)
        else:
            while len(due) > capacity:
                neg, k = heapq.heappop(heap)
                if due.get(k) == -neg:
                    del due[k]
    return total


def _replay_2q(streams: list[tuple[list[int], int]], block_size: int, capacity: int) -> int:
    """:func:`_replay` under 2Q, as the free-list pools run it
    (:class:`~hybridkv.cache.pool_freelist.FreeListPool`): new blocks on probation (FIFO),
    blocks hit or back from the ghost list of recent evictions in the main LRU; probation
    evicts first while it holds more than its share."""
    probation: OrderedDict[int, None] = OrderedDict()
    main: OrderedDict[int, None] = OrderedDict()
    ghost: OrderedDict[int, None] = OrderedDict()
    total = 0
    for keys, hittable in streams:
        hit = 0
        while hit < hittable and (keys[hit] in main or keys[hit] in probation):
            hit += 1
        total += hit * block_size
        for j, k in enumerate(keys):
            if k in main:
                main.move_to_end(k)
            elif k in probation and j >= hit:  # on probation, not read: no proof yet
                probation.move_to_end(k)
            else:  # a hit, a key back from the ghost list, or a new one
                probation.pop(k, None)
                if j < hit or k in ghost:
                    main[k] = None
                else:
                    probation[k] = None
        while len(main) + len(probation) > capacity:
            if probation and (
                not main or len(probation) > _PROBATION_SHARE * (len(probation) + len(main))
            ):
                k = probation.popitem(last=False)[0]
            else:
                k = main.popitem(last=False)[0]
            ghost[k] = None
            ghost.move_to_end(k)
            if len(ghost) > _GHOST_PER_BLOCK * capacity:
                ghost.popitem(last=False)
    return total
