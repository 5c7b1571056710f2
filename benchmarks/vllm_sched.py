"""The vLLM driver's minimal scheduler: :func:`run_minimal_scheduler` drives any
:class:`ManagerAdapter` (vLLM's or hybridkv's) as vLLM 0.33's scheduler does.

Plain Python (never imports vLLM); :mod:`vllm_driver` re-exports these names.  Requests are
:class:`hybridkv.workloads.StepRequest`; ``hybridkv.workloads`` (standard library only) is
imported from this checkout's ``src/``, so vLLM's interpreter needs no hybridkv install.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from hybridkv.workloads import StepRequest, arrival_order

__all__ = [
    "OPS",
    "ManagerAdapter",
    "SimRequest",
    "op_stats",
    "run_minimal_scheduler",
]

OPS = ("get_computed_blocks", "allocate_slots", "free", "end_step", "hash")


class _Arrivals:
    """Releases requests at their arrival step, follow-ups only after their parent ended."""

    def __init__(self, requests: Sequence[StepRequest]) -> None:
        self.order = arrival_order(requests)
        self.next = 0
        self.gated: list[StepRequest] = []
        self.ended_at: dict[str, int] = {}

    def pending(self) -> bool:
        return self.next < len(self.order) or bool(self.gated)

    def ready(self, step: int) -> list[StepRequest]:
        while self.next < len(self.order) and self.order[self.next].arrival_step <= step:
            self.gated.append(self.order[self.next])
            self.next += 1
        ok: list[StepRequest] = []
        held: list[StepRequest] = []
        for w in self.gated:
            p = w.parent_id
            free = p is None or step >= self.ended_at.get(p, step + 1) + w.think_steps
            (ok if free else held).append(w)
        self.gated = held
        return ok

    def skip_idle(self, step: int) -> int:
        """The next step at which something can arrive (>= step + 1)."""
        cands = [self.order[self.next].arrival_step] if self.next < len(self.order) else []
        ended = self.ended_at
        cands += [ended[p] + w.think_steps for w in self.gated if (p := w.parent_id) in ended]
        return max(step + 1, min(cands, default=step + 1))


# ------------------------------------------------------------------------------ the adapter
@dataclass(kw_only=True)
class SimRequest:
    """Scheduler-side request state, owned and mutated by :func:`run_minimal_scheduler`."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: str = "waiting"  # waiting | running | preempted | finished | rejected
    shared_prefix_boundary: int = 0  # set by lookup(): uncached shared-prefix junction (tokens)
    num_preemptions: int = 0
    first_hit_tokens: int | None = None
    source: StepRequest  # the workload request; its output_token_ids are the sampled tokens

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


class ManagerAdapter(Protocol):
    """What :func:`run_minimal_scheduler` needs from a KV cache manager (vLLM's or hybridkv's).

    ``lookup`` finds the cached prefix of a request that holds no blocks (and may set
    ``req.shared_prefix_boundary``); the next ``allocate`` of that request adopts it.
    ``allocate`` returns False, changing nothing, when the blocks do not fit.  ``free`` is
    called with ``req.status`` "running" for a preemption (the request is requeued and later
    looked up again) and "finished" or "rejected" when it is gone for good.  ``new_step`` /
    ``end_step`` bracket the scheduling of one step (vLLM drains copy-on-write and per-step
    Mamba bookkeeping there)."""

    scheduler_block_size: int
    hash_block_size: int
    mamba_align: bool
    partial_hash_hits: bool
    bytes_per_block: int

    def add_request(self, req: SimRequest) -> None: ...
    def new_step(self) -> None: ...
    def end_step(self) -> None: ...
    def lookup(self, req: SimRequest) -> int: ...
    def allocate(
        self, req: SimRequest, num_new_tokens: int, num_lookahead_tokens: int = 0, **kw: Any
    ) -> bool: ...
    def append_token(self, req: SimRequest, token_id: int) -> None: ...
    def free(self, req: SimRequest) -> None: ...
    def usage(self) -> float: ...
    def num_used_blocks(self) -> int: ...


# ----------------------------------------------------------------------------- the scheduler
def _align_chunk(adapter: ManagerAdapter, req: SimRequest, start: int, n: int, budget: int) -> int:
    """Shorten the prefill chunk [start, start + n) as vLLM 0.33's scheduler does in Mamba
    "align" mode (no EAGLE, lookahead or in-kernel checkpoints): a non-final chunk ends on a
    block boundary; a chunk stops early at the next boundary when it starts mid-block, at the
    last cacheable boundary, at the prompt's hash-aligned tail (fine-grained hits only) and at
    the block-floored uncached shared-prefix junction reported by lookup()."""
    prompt_len = len(req.prompt_token_ids)
    prefill_end = max(prompt_len, req.num_tokens - 1)
    if start >= prefill_end:
        return n
    bs, hbs = adapter.scheduler_block_size, adapter.hash_block_size
    end = start + n
    if end < prefill_end and (end // bs * bs > start or bs <= budget):
        end = end // bs * bs
    last_cacheable = (req.num_tokens - 1) // bs * bs
    tail = (prompt_len - 1) // hbs * hbs if adapter.partial_hash_hits else 0
    junction = req.shared_prefix_boundary
    stops = (
        (start // bs + 1) * bs if start % bs else 0,
        last_cacheable,
        tail if last_cacheable < tail < prompt_len else 0,
        start + (junction - start) // bs * bs if start < junction < end else 0,
    )
    end = min((s for s in stops if start < s < end), default=end)
    return max(end - start, 0)


def op_stats(
    timings: Mapping[str, list[int]], cpu_ns: Mapping[str, int] | None = None
) -> dict[str, dict[str, float]]:
    """Per timed operation: calls; mean, p50 and p99 (nearest rank) wall time; and, given
    ``cpu_ns``, the mean thread CPU time (unaffected by waiting for a core).  Microseconds."""
    out = {}
    for op, ts in timings.items():
        s = sorted(ts) or [0]
        p50, p99 = (s[min(len(s) - 1, int(q * len(s)))] / 1e3 for q in (0.5, 0.99))
        out[op] = {"calls": len(ts), "mean_us": sum(s) / len(s) / 1e3, "p50_us": p50, "p99_us": p99}
        if cpu_ns is not None:
            out[op]["cpu_mean_us"] = cpu_ns[op] / max(len(ts), 1) / 1e3
    return out


def run_minimal_scheduler(
    adapter: ManagerAdapter,
    requests: Sequence[StepRequest],
    token_budget: int = 8192,
    *,
    max_num_seqs: int = 256,
    max_model_len: int = 16_384,
    progress: Callable[[dict[str, Any]], None] | None = None,
    progress_every: int = 0,
) -> dict[str, Any]:
    """Serve ``requests`` step by step, driving the manager as vLLM 0.33's scheduler does
    (synchronous, no speculation, no connector).

    Each step: running requests first, in order, each its remaining prefill or one decode token
    within the token budget; while allocate fails the newest running request is preempted
    (freed, requeued at the front, recomputed later).  Then, unless something was preempted,
    waiting requests in FCFS order: lookup, then allocate the hit plus a chunk under the budget
    with ``full_sequence_must_fit`` (vLLM's default admission gate); the first failure ends
    admission.  A request whose prompt is done samples its next ``output_token_ids`` entry each
    step and finishes after the last one (or at ``max_model_len``).  Mamba groups get
    :func:`_align_chunk` splits.  A request that does not fit an empty pool is rejected.
    Returns the metrics (hit rate = first-admission hit tokens / prompt tokens of finished
    requests)."""
    t_start = time.perf_counter()
    arrivals = _Arrivals(requests)
    waiting: deque[SimRequest] = deque()
    running: list[SimRequest] = []
    sims: list[SimRequest] = []
    step = busy = preemptions = rejected = computed = peak = hits_all = tokens_all = 0
    while arrivals.pending() or waiting or running:
        for w in arrivals.ready(step):
            sims.append(
                SimRequest(
                    request_id=w.request_id,
                    prompt_token_ids=w.prompt_token_ids,
                    max_tokens=w.output_len,
                    source=w,
                )
            )
            adapter.add_request(sims[-1])
            waiting.append(sims[-1])
        if not waiting and not running:
            step = arrivals.skip_idle(step)
            continue
        adapter.new_step()
        budget, scheduled, preempted, i = token_budget, [], False, 0
        while i < len(running) and budget > 0:
            req = running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            n = min(n, max_model_len - req.num_computed_tokens - 1)
            if adapter.mamba_align:
                n = _align_chunk(adapter, req, req.num_computed_tokens, n, token_budget)
            if n <= 0:
                i += 1
                continue
            while not (ok := adapter.allocate(req, n)):
                victim = running.pop()
                adapter.free(victim)
                victim.status, victim.num_computed_tokens = "preempted", 0
                victim.num_preemptions += 1
                waiting.appendleft(victim)
                preemptions, preempted = preemptions + 1, True
                if victim is req:
                    break
            if not ok:
                break
            scheduled.append((req, n))
            budget, i = budget - n, i + 1
        while not preempted and waiting and budget > 0 and len(running) < max_num_seqs:
            req = waiting[0]
            hit = adapter.lookup(req)
            n = min(req.num_tokens - hit, budget)
            if adapter.mamba_align:
                n = _align_chunk(adapter, req, hit, n, token_budget)
            if n <= 0:  # less than one aligned block of budget left
                break
            if not adapter.allocate(
                req, n, full_sequence_must_fit=True, has_scheduled_reqs=bool(running)
            ):
                if scheduled or adapter.num_used_blocks():
                    break
                waiting.popleft()  # does not fit even an empty pool
                req.status = "rejected"
                adapter.free(req)
                arrivals.ended_at[req.request_id] = step  # releases its follow-ups
                rejected += 1
                continue
            waiting.popleft()
            running.append(req)
            if req.first_hit_tokens is None:
                req.first_hit_tokens = hit
            hits_all, tokens_all = hits_all + hit, tokens_all + req.num_tokens
            req.status, req.num_computed_tokens = "running", hit
            scheduled.append((req, n))
            budget -= n
        adapter.end_step()
        peak = max(peak, adapter.num_used_blocks())
        busy += bool(scheduled)
        for req, n in scheduled:  # "execute" the step
            req.num_computed_tokens += n
            computed += n
            if req.num_computed_tokens < req.num_tokens:
                continue  # a non-final prefill chunk samples nothing
            tok = req.source.output_token_ids[len(req.output_token_ids)]
            req.output_token_ids.append(tok)
            adapter.append_token(req, tok)
            if len(req.output_token_ids) >= req.max_tokens or req.num_tokens >= max_model_len:
                req.status = "finished"
                adapter.free(req)
                running.remove(req)
                arrivals.ended_at[req.request_id] = step
        step += 1
        if progress and progress_every and step % progress_every == 0:
            progress(
                {
                    "step": step,
                    "ended": len(arrivals.ended_at),
                    "running": len(running),
                    "waiting": len(waiting),
                    "usage": round(adapter.usage(), 4),
                }
            )
    done = [s for s in sims if s.status == "finished"]
    prompt_tokens = sum(len(s.prompt_token_ids) for s in done)
    hit_tokens = sum(s.first_hit_tokens or 0 for s in done)
    return {
        "requests": len(arrivals.order),
        "finished": len(done),
        "rejected": rejected,
        "prompt_tokens": prompt_tokens,
        "hit_tokens": hit_tokens,
        "token_hit_rate": hit_tokens / prompt_tokens if prompt_tokens else 0.0,
        "hit_rate_incl_resumes": hits_all / tokens_all if tokens_all else 0.0,
        "preemptions": preemptions,
        "computed_tokens": computed,
        "steps": step,
        "busy_steps": busy,
        "peak_used_blocks": peak,
        "peak_used_bytes": peak * adapter.bytes_per_block,
        "wall_s": time.perf_counter() - t_start,
    }
