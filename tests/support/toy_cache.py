"""Test support: a small reference allocator that speaks the runner's batch language.

:class:`ToyCache` hands out block ids and state slots per group of a
:class:`~hybridkv.plan.MemoryLayout` and describes each request's share of a step as a
:class:`~hybridkv.engine.batch.RequestStep`.  It drives the runner in tests (through
:class:`support.paged_generator.PagedGenerator`), independently of the real cache manager and
scheduler (which :class:`~hybridkv.engine.llm_engine.LLMEngine` wires); it is deliberately
simple (free lists with the lowest id first, reference counts, no eviction, no hashing) but
follows the same rules:

* ids: groups sharing a pool (``uniform``) share its ids; in an ``arena`` a group carves
  blocks out of whole free chunks it takes on demand (chunks are not given back);
* token groups: a request's table covers every token up to the end of its step; after a step,
  blocks no future query can read (outside ``spec.kept_tokens(num_computed)``: sliding window,
  chunked local) are replaced by the null block and released;
* state groups: one running slot per request, read and written every step; a step ending on a
  multiple of the group's block size (the checkpoint interval) also copies the running state to
  a fresh checkpoint slot;
* prefix sharing (:meth:`ToyCache.add` with ``prefix_of``): the new request reuses the source
  request's blocks for the first ``prefix_len`` tokens without copying (full blocks; for window
  groups only the blocks the window still needs, the rest null) and its first step reads the
  source's checkpoint slot at ``prefix_len`` (restore from checkpoint).

With ``poison_freed=True`` (and ``views``), every block or slot whose last reference goes is
filled with NaN, so a runner that ever read released memory would produce NaN logits.
``recycle=False`` keeps window blocks (for comparing runs with and without recycling).

Invariants (:meth:`ToyCache.check_invariants`): reference counts equal the references held by
tables, running slots, checkpoints and pending restores; a free id has no references; the
null block is never free nor referenced.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from hybridkv.engine.batch import RequestStep, SlotCopy, StateIO
from hybridkv.engine.views import PagedKVViews, group_block_ids, kernel_index
from hybridkv.errors import AllocationError, InvariantError, RequestError
from hybridkv.plan import NULL_BLOCK_ID, GroupPlan, MemoryLayout
from hybridkv.specs import CacheKind, StateSpec

__all__ = ["ToyCache"]


def _intersects(lo: int, hi: int, spans: tuple[range, ...]) -> bool:
    return any(lo < s.stop and s.start < hi for s in spans)


@dataclass
class _Request:
    computed: int = 0
    tables: dict[int, list[int]] = field(default_factory=dict)
    running: dict[int, int] = field(default_factory=dict)
    checkpoints: dict[int, dict[int, int]] = field(default_factory=dict)
    restore: dict[int, int] = field(default_factory=dict)
    scheduled: dict[int, int] = field(default_factory=dict)


class ToyCache:
    """Reference allocator over ``layout`` (see the module docstring)."""

    def __init__(
        self,
        layout: MemoryLayout,
        views: PagedKVViews | None = None,
        *,
        poison_freed: bool = False,
        recycle: bool = True,
    ) -> None:
        self.layout = layout
        self.views = views
        self.poison_freed = poison_freed
        self.recycle = recycle
        # Free ids per pool (groups sharing a pool share its ids: one owner at a time); in an
        # arena, per group, carved out of whole chunks taken from the free chunks on demand.
        self._pool: dict[int, int] = {}
        self._free: dict[int, list[int]] = {}
        self._free_chunks: list[int] = []
        if layout.arena is not None:
            self._free_chunks = list(range(1, layout.arena.num_chunks))
            for g in layout.groups:
                self._pool[g.group_id] = g.group_id
                self._free[g.group_id] = []
        else:
            for g in layout.groups:
                pool = layout.pool_of(g.group_id)
                self._pool[g.group_id] = pool.pool_id
                self._free[pool.pool_id] = list(range(1, pool.num_blocks))
        self._refs: dict[tuple[int, int], int] = {}
        self._requests: dict[str, _Request] = {}
        #: Blocks replaced by the null block so far (window recycling), for tests and reports.
        self.released = 0

    # ------------------------------------------------------------------ helpers

    def _token_groups(self) -> list[GroupPlan]:
        return [g for g in self.layout.groups if g.spec.kind is not CacheKind.STATE]

    def _state_groups(self) -> list[GroupPlan]:
        return [g for g in self.layout.groups if g.spec.kind is CacheKind.STATE]

    def _take(self, gid: int) -> int:
        free = self._free[self._pool[gid]]
        if not free and self._free_chunks:
            chunk = self._free_chunks.pop(0)
            free.extend(self.layout.chunk_blocks(gid, chunk))
        if not free:
            raise AllocationError(f"toy cache: group {gid} has no free block left")
        block = free.pop(0)
        self._refs[(gid, block)] = 1
        return block

    def _ref(self, gid: int, block: int) -> None:
        self._refs[(gid, block)] += 1

    def _unref(self, gid: int, block: int) -> None:
        key = (gid, block)
        self._refs[key] -= 1
        if self._refs[key] == 0:
            del self._refs[key]
            free = self._free[self._pool[gid]]
            free.append(block)
            free.sort()
            if self.poison_freed and self.views is not None:
                self._poison(self.views, self.layout.groups[gid], block)

    def _poison(self, views: PagedKVViews, group: GroupPlan, block: int) -> None:
        nan = float("nan")
        spec = group.spec
        if isinstance(spec, StateSpec):
            for layer, slot in group.members:
                for t in spec.tensors:
                    views.state(layer, slot, t.name)[block] = nan
            return
        ratio, kbs = group.kernel_blocks_per_block, group.kernel_block_size
        kernel = torch.arange(block * ratio, (block + 1) * ratio).repeat_interleave(kbs)
        offsets = torch.arange(kbs).repeat(ratio)  # moved to each view's device below
        num_ids = group_block_ids(self.layout, group.group_id)
        for layer, slot in group.members:
            tensors: Sequence[torch.Tensor] = (
                (views.mla_latent(layer, slot),)
                if spec.kind is CacheKind.MLA
                else views.attention_kv(layer, slot)
            )
            for view in tensors:
                target, where = kernel_index(
                    view,
                    num_block_ids=num_ids,
                    block_size=group.block_size,
                    kernel_block_size=kbs,
                    blocks=kernel.to(view.device),
                    offsets=offsets.to(view.device),
                )
                target[where] = nan

    def _request(self, request_id: str) -> _Request:
        found = self._requests.get(request_id)
        if found is None:
            raise RequestError(f"toy cache: unknown request id {request_id!r}")
        return found

    # ------------------------------------------------------------------ public

    def add(
        self,
        request_id: str,
        prompt: Sequence[int] = (),
        *,
        prefix_of: str | None = None,
        prefix_len: int = 0,
    ) -> int:
        """Register a request; with ``prefix_of``, share that request's first ``prefix_len``
        tokens.  Returns the number of tokens already computed (``prefix_len``).  ``prompt``
        is accepted for interface parity with a hashing cache; the toy cache does not hash.

        Raises :class:`RequestError` for a duplicate id, an unknown source, a ``prefix_len``
        not a multiple of every group's block size, a source that has not computed that many
        tokens or has no checkpoint there, or has released a block the window still needs.
        Nothing changes on error.
        """
        if request_id in self._requests:
            raise RequestError(f"toy cache: request id {request_id!r} is already registered")
        if prefix_of is None:
            if prefix_len:
                raise RequestError("toy cache: prefix_len needs prefix_of")
            req = _Request()
            for g in self._state_groups():
                req.running[g.group_id] = self._take(g.group_id)
            for g in self._token_groups():
                req.tables[g.group_id] = []
            self._requests[request_id] = req
            return 0
        src = self._request(prefix_of)
        plan = self._share_plan(prefix_of, src, prefix_len)
        req = _Request(computed=prefix_len)
        for gid, table in plan.items():
            req.tables[gid] = table
            for b in table:
                if b != NULL_BLOCK_ID:
                    self._ref(gid, b)
        for g in self._state_groups():
            gid = g.group_id
            req.restore[gid] = src.checkpoints[gid][prefix_len]
            self._ref(gid, req.restore[gid])
            req.running[gid] = self._take(gid)
        self._requests[request_id] = req
        return prefix_len

    def _share_plan(self, source: str, src: _Request, n: int) -> dict[int, list[int]]:
        if n <= 0 or src.computed < n:
            raise RequestError(
                f"toy cache: prefix_len {n} must be in 1..{src.computed} (tokens request "
                f"{source!r} has computed)"
            )
        for g in self.layout.groups:
            if n % g.block_size:
                raise RequestError(
                    f"toy cache: prefix_len {n} is not a multiple of group {g.group_id}'s "
                    f"block size {g.block_size}"
                )
            if g.spec.kind is CacheKind.STATE and n not in src.checkpoints[g.group_id]:
                raise RequestError(
                    f"toy cache: request {source!r} has no state checkpoint at {n} tokens in "
                    f"group {g.group_id}; it has {sorted(src.checkpoints[g.group_id])}"
                )
        plan: dict[int, list[int]] = {}
        for g in self._token_groups():
            kept = g.spec.kept_tokens(n)
            table: list[int] = []
            for i in range(n // g.block_size):
                lo, hi = i * g.block_size, (i + 1) * g.block_size
                if not _intersects(lo, hi, kept):
                    table.append(NULL_BLOCK_ID)
                    continue
                block = src.tables[g.group_id][i]
                if block == NULL_BLOCK_ID:
                    raise RequestError(
                        f"toy cache: request {source!r} already released block {i} of group "
                        f"{g.group_id}, which a hit at {n} tokens needs"
                    )
                table.append(block)
            plan[g.group_id] = table
        return plan

    def schedule(
        self, request_id: str, token_ids: Sequence[int], positions: Sequence[int] | None = None
    ) -> RequestStep:
        """Allocate what the request's next ``token_ids`` need and describe the step.

        Raises :class:`AllocationError` (nothing kept) when a group runs out of blocks.
        """
        req = self._request(request_id)
        end = req.computed + len(token_ids)
        taken: list[tuple[int, int]] = []
        try:
            tables: dict[int, tuple[int, ...]] = {}
            for g in self._token_groups():
                table = list(req.tables[g.group_id])
                while len(table) * g.block_size < end:
                    table.append(self._take(g.group_id))
                    taken.append((g.group_id, table[-1]))
                tables[g.group_id] = tuple(table)
            states: dict[int, StateIO] = {}
            scheduled: dict[int, int] = {}
            for g in self._state_groups():
                gid = g.group_id
                running = req.running[gid]
                after: tuple[SlotCopy, ...] = ()
                if end % g.block_size == 0:
                    scheduled[gid] = self._take(gid)
                    taken.append((gid, scheduled[gid]))
                    after = (SlotCopy(src=running, dst=scheduled[gid]),)
                read = req.restore.get(gid, running if req.computed else None)
                states[gid] = StateIO(read_slot=read, write_slot=running, copies_after=after)
        except AllocationError:
            for gid, block in taken:
                self._unref(gid, block)
            raise
        for gid, ids in tables.items():
            req.tables[gid] = list(ids)
        req.scheduled = scheduled
        return RequestStep(
            request_id=request_id,
            token_ids=tuple(token_ids),
            num_computed=req.computed,
            block_tables=tables,
            states=states,
            positions=None if positions is None else tuple(positions),
        )

    def commit(self, step: RequestStep, new_token: int | None = None) -> None:
        """Record that ``step`` ran: advance the request, keep its checkpoints, release window
        blocks no future query reads.  ``new_token`` (the sampled token) is not needed here."""
        req = self._request(step.request_id)
        if step.num_computed != req.computed:
            raise RequestError(
                f"toy cache: step of {step.request_id!r} starts at {step.num_computed}, the "
                f"request has computed {req.computed}"
            )
        req.computed = step.end
        for gid, slot in req.scheduled.items():
            req.checkpoints.setdefault(gid, {})[step.end] = slot
        req.scheduled = {}
        for gid, slot in req.restore.items():
            self._unref(gid, slot)
        req.restore = {}
        for g in self._token_groups():
            if g.spec.prefix_closed or not self.recycle:
                continue
            kept = g.spec.kept_tokens(req.computed)
            table = req.tables[g.group_id]
            for i, block in enumerate(table):
                lo, hi = i * g.block_size, (i + 1) * g.block_size
                if block != NULL_BLOCK_ID and hi <= req.computed and not _intersects(lo, hi, kept):
                    table[i] = NULL_BLOCK_ID
                    self._unref(g.group_id, block)
                    self.released += 1

    def free(self, request_id: str) -> None:
        """Drop the request and every reference it holds."""
        req = self._request(request_id)
        for gid, table in req.tables.items():
            for block in reversed(table):
                if block != NULL_BLOCK_ID:
                    self._unref(gid, block)
        for gid, slot in req.running.items():
            self._unref(gid, slot)
        for gid, points in req.checkpoints.items():
            for slot in points.values():
                self._unref(gid, slot)
        for gid, slot in (*req.restore.items(), *req.scheduled.items()):
            self._unref(gid, slot)
        del self._requests[request_id]

    def block_table(self, request_id: str, group_id: int) -> tuple[int, ...]:
        """The request's manager block ids in token group ``group_id``."""
        return tuple(self._request(request_id).tables[group_id])

    def checkpoint_slot(self, request_id: str, group_id: int, num_tokens: int) -> int:
        """The slot holding the request's state after ``num_tokens`` tokens in ``group_id``.

        Raises :class:`RequestError` when there is no such checkpoint.
        """
        found = self._request(request_id).checkpoints.get(group_id, {}).get(num_tokens)
        if found is None:
            raise RequestError(
                f"toy cache: request {request_id!r} has no checkpoint at {num_tokens} tokens "
                f"in group {group_id}"
            )
        return found

    def num_computed(self, request_id: str) -> int:
        return self._request(request_id).computed

    def num_free(self, group_id: int) -> int:
        """Ids group ``group_id`` could still take (shared with its pool's other groups)."""
        free = len(self._free[self._pool[group_id]])
        if self.layout.arena is not None:
            free += len(self._free_chunks) * self.layout.blocks_per_chunk(group_id)
        return free

    def check_invariants(self) -> None:
        """Raise :class:`InvariantError` if reference counts and free lists disagree."""
        held: dict[tuple[int, int], int] = {}

        def hold(gid: int, block: int) -> None:
            if block == NULL_BLOCK_ID:
                return
            held[(gid, block)] = held.get((gid, block), 0) + 1

        for req in self._requests.values():
            for gid, table in req.tables.items():
                for b in table:
                    hold(gid, b)
            for gid, slot in (*req.running.items(), *req.restore.items(), *req.scheduled.items()):
                hold(gid, slot)
            for gid, points in req.checkpoints.items():
                for slot in points.values():
                    hold(gid, slot)
        if held != self._refs:
            raise InvariantError(f"toy cache: references held {held} != counted {self._refs}")
        used = {(self._pool[gid], b) for gid, b in held}
        if len(used) != len(held):
            raise InvariantError("toy cache: two groups of one pool hold the same block id")
        for pool, free in self._free.items():
            if NULL_BLOCK_ID in free or any((pool, b) in used for b in free):
                raise InvariantError(f"toy cache: pool {pool} free list {free} holds used ids")
            if len(set(free)) != len(free):
                raise InvariantError(f"toy cache: pool {pool} free list has duplicates")
