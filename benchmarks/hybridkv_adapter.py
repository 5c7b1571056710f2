"""hybridkv's side of ``compare_vllm.py``: its :class:`KVCacheManager` behind the driver's
``ManagerAdapter`` interface (``vllm_driver``), with the calls that count as manager time
timed one by one (wall time per call and thread CPU time per operation, as vLLM's adapter
times its calls).  Imported by ``compare_vllm.py`` after it put this checkout's ``src`` (or
``HYBRIDKV_SRC``) on the path."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from hybridkv.cache import AllocationResult, ComputedBlocks, KVCacheManager, Request
from hybridkv.specs import CacheKind, ChunkedLocalSpec, SlidingWindowSpec

import vllm_driver as vd

#: What counts as manager time per step.  ``admission_check`` is hybridkv's copy of vLLM's
#: ``full_sequence_must_fit`` gate, which vLLM runs inside its timed ``allocate_slots``.
MANAGER_OPS = ("get_computed_blocks", "allocate_slots", "free", "end_step", "admission_check")


class HybridkvAdapter:
    """``vllm_driver.ManagerAdapter`` over hybridkv's :class:`KVCacheManager`.

    ``num_used_blocks`` counts bytes (``bytes_per_block`` is 1): arena groups have blocks of
    different sizes, so bytes are the common unit.  A free of a request the driver is about to
    requeue is a preemption (``KVCacheManager.preempt``); a free of a finished one is ``free``.
    """

    def __init__(
        self, manager: KVCacheManager, *, token_budget: int, compaction: bool = True
    ) -> None:
        layout = manager.layout
        self.manager = manager
        #: A running request's refused step first tries ``KVCacheManager.compact`` (as
        #: hybridkv's Scheduler does) before the driver preempts anyone.
        self.compaction = compaction
        self.moved_blocks = 0
        self.token_budget = token_budget
        self.total_bytes = layout.total_bytes
        self.scheduler_block_size = layout.schedule_alignment
        self.hash_block_size = layout.hash_block_size
        self.mamba_align = any(g.spec.kind is CacheKind.STATE for g in layout.groups)
        self.partial_hash_hits = False
        self.bytes_per_block = 1
        ops = (*vd.OPS, "admission_check")
        self.timings: dict[str, list[int]] = {op: [] for op in ops}  # wall ns per call
        self.cpu_ns: dict[str, int] = dict.fromkeys(ops, 0)  # thread CPU ns, all calls
        self._reqs: dict[str, Request] = {}
        self._pending: dict[str, ComputedBlocks] = {}

    def _timed(self, op: str, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        # the same clocks, in the same order, as VllmManagerAdapter._timed
        c0 = time.thread_time_ns()
        t0 = time.perf_counter_ns()
        out = fn(*args, **kw)
        t1 = time.perf_counter_ns()
        self.cpu_ns[op] += time.thread_time_ns() - c0
        self.timings[op].append(t1 - t0)
        return out

    def add_request(self, req: vd.SimRequest) -> None:
        self._reqs[req.request_id] = self._timed(
            "hash", self.manager.make_request, req.request_id, list(req.prompt_token_ids)
        )

    def new_step(self) -> None:
        pass

    def end_step(self) -> None:
        self.timings["end_step"].append(0)

    def lookup(self, req: vd.SimRequest) -> int:
        r = self._reqs[req.request_id]
        r.num_computed_tokens = 0
        hit: ComputedBlocks = self._timed(
            "get_computed_blocks", self.manager.get_computed_blocks, r
        )
        self._pending[req.request_id] = hit
        req.shared_prefix_boundary = hit.junction_tokens
        return hit.num_computed_tokens

    def allocate(
        self, req: vd.SimRequest, num_new_tokens: int, num_lookahead_tokens: int = 0, **kw: Any
    ) -> bool:
        r = self._reqs[req.request_id]
        hit = self._pending.get(req.request_id)
        if hit is not None and not self.manager.has_blocks(req.request_id):
            if kw.get("full_sequence_must_fit") and not self._timed(
                "admission_check", self._full_sequence_fits, req, hit
            ):
                return False
            r.num_computed_tokens = 0
            res = self._timed(
                "allocate_slots",
                self.manager.allocate_slots,
                r,
                num_new_tokens,
                num_new_computed_tokens=hit.num_computed_tokens,
                new_computed_blocks=hit,
                num_lookahead_tokens=num_lookahead_tokens,
            )
        else:
            r.num_computed_tokens = req.num_computed_tokens
            res = self._timed(
                "allocate_slots",
                self.manager.allocate_slots,
                r,
                num_new_tokens,
                num_lookahead_tokens=num_lookahead_tokens,
            )
            if res is None and self.compaction:
                res = self._timed(
                    "allocate_slots",
                    self._compact_and_retry,
                    r,
                    num_new_tokens,
                    num_lookahead_tokens,
                )
        if res is not None:
            self._pending.pop(req.request_id, None)
        return res is not None

    def _compact_and_retry(
        self, r: Request, num_new_tokens: int, num_lookahead_tokens: int
    ) -> AllocationResult | None:
        """A running request's refused step: compact and try again while that frees room."""
        mgr = self.manager
        while True:
            moves = mgr.compact(r, num_new_tokens, num_lookahead_tokens=num_lookahead_tokens)
            if not moves:
                return None
            self.moved_blocks += len(moves)
            res = mgr.allocate_slots(r, num_new_tokens, num_lookahead_tokens=num_lookahead_tokens)
            if res is not None:
                return res

    def _full_sequence_fits(self, req: vd.SimRequest, hit: ComputedBlocks) -> bool:
        """vLLM's admission gate (``full_sequence_must_fit``), with vLLM's per-kind counts:
        full attention and MLA the whole sequence, sliding windows ``cdiv(min(W - 1 +
        token_budget, L), bs) + 1``, chunked local the same with the chunk, states two new
        slots; minus the blocks the hit already holds (not for states), whose evictable
        (unreferenced) ones the hit takes out of the free count as vLLM's does.  A query:
        nothing changes."""
        length = req.num_tokens
        needs = []
        touches = [[b for b in held if b] for held in hit.blocks]  # the hit's real blocks
        for g, held in zip(self.manager.layout.groups, touches, strict=True):
            spec, bs = g.spec, g.block_size
            if spec.kind is CacheKind.STATE:
                # the running slot and the checkpoint its first chunk ends with, both new:
                # a hit checkpoint is copied into the running slot, not written in place
                needs.append(2)
                continue
            if isinstance(spec, SlidingWindowSpec):
                need = -(-min(spec.window - 1 + self.token_budget, length) // bs) + 1
            elif isinstance(spec, ChunkedLocalSpec):
                need = -(-min(spec.chunk_size - 1 + self.token_budget, length) // bs) + 1
            else:
                need = -(-length // bs)
            needs.append(max(0, need - len(held)))
        none: list[None] = [None] * len(needs)
        return bool(self.manager.pool.fits(none, none, [t or None for t in touches], needs))

    def append_token(self, req: vd.SimRequest, token_id: int) -> None:
        r = self._reqs[req.request_id]
        r.num_computed_tokens = req.num_computed_tokens
        self._timed("hash", r.append_token_ids, (token_id,))

    def free(self, req: vd.SimRequest) -> None:
        rid = req.request_id
        self._pending.pop(rid, None)
        if req.status in ("finished", "rejected"):
            if self.manager.has_blocks(rid):
                r = self._reqs[rid]
                r.num_computed_tokens = req.num_computed_tokens
                self._timed("free", self.manager.free, rid)
            del self._reqs[rid]
        elif self.manager.has_blocks(rid):
            self._timed("free", self.manager.preempt, rid)

    def usage(self) -> float:
        return float(self.manager.usage)

    def num_used_blocks(self) -> int:
        return int(self.manager.usage * self.total_bytes)
