"""The workload simulator: the real scheduler and cache manager, a simulated model runner.

Every step is planned by :class:`hybridkv.scheduler.Scheduler` over a real
:class:`hybridkv.cache.KVCacheManager` built from a real plan; instead of running a model, the
step's duration comes from :class:`hybridkv.sim.cost.StepCostModel` and the sampled tokens are
the workload's predetermined outputs.  A simulated clock orders arrivals (by timestamp, or all at
once) and steps.  No torch.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hybridkv.cache import KVCacheManager
from hybridkv.cache.policies import drops_dead_tails
from hybridkv.cache.tiers import tier_hit_tokens
from hybridkv.errors import brief_repr
from hybridkv.plan import make_plan
from hybridkv.plan.result import Plan
from hybridkv.scheduler import Scheduler, SchedulerConfig
from hybridkv.sim.config import PROTECT_MODES, SimConfig, SimulationError
from hybridkv.sim.cost import ACCELERATORS, ModelProfile, StepCostModel
from hybridkv.specs import (
    CacheKind,
    CacheSpec,
    ChunkedLocalSpec,
    ModelSpec,
    SlidingWindowSpec,
)
from hybridkv.workloads import Workload, WorkloadRequest
from hybridkv.workloads.sessions import continuations

__all__ = [
    "PROTECT_MODES",
    "Rejection",
    "SimConfig",
    "SimResult",
    "SimulationError",
    "TimelinePoint",
    "plan_for",
    "simulate",
]


@dataclass(frozen=True, slots=True)
class TimelinePoint:
    """State of the cache after one step (sampled)."""

    time_s: float
    step: int
    running: int
    waiting: int
    used_bytes: int
    need_bytes: int
    group_blocks: tuple[int, ...]
    hit_rate: float


@dataclass(frozen=True, slots=True)
class Rejection:
    """A request the simulator could not admit, and why."""

    request_id: str
    prompt_len: int
    reason: str


@dataclass
class SimResult:
    """What a simulated run measured.  ``summary()`` gives the headline numbers.

    ``prompt_tokens`` counts every request of the workload, rejected ones included, so the
    hit rate is the share of all prompt tokens served from the cache (a rejected request is
    all misses); ``admitted_prompt_tokens`` counts the admitted ones only.
    """

    strategy: str
    plan: Plan
    workload: str
    num_requests: int
    finished: int
    rejected: list[Rejection]
    prompt_tokens: int
    admitted_prompt_tokens: int
    cached_tokens: int
    computed_tokens: int
    output_tokens: int
    preemptions: int
    steps: int
    sim_time_s: float
    wall_time_s: float
    peak_running: int
    peak_used_bytes: int
    peak_need_bytes: int
    ttft_s: list[float]
    tpot_s: list[float]
    group_hit_rates: tuple[float, ...]
    group_labels: tuple[str, ...]
    manager_us_per_step: float
    timeline: list[TimelinePoint] = field(default_factory=list)
    #: :meth:`KVCacheManager.checkpoint_admission_report` at the end (None: no state group,
    #: or every checkpoint saved).
    checkpoint_admission: dict[str, dict[str, float | bool]] | None = None
    #: Per lower tier: prompt tokens of admissions read back from it (part of
    #: ``cached_tokens``), and :meth:`KVCacheManager.tier_stats` at the end.
    tier_hit_tokens: dict[str, int] = field(default_factory=dict)
    tiers: dict[str, dict[str, int]] = field(default_factory=dict)
    #: Protected sessions the manager ended (a tier over its ``protect_share``, or more
    #: protected hashes than it allows: :meth:`KVCacheManager.session_stats`).
    sessions_expired: int = 0
    #: Blocks the scheduler's compaction moved instead of preempting (a device copy each,
    #: charged at the accelerator's memory bandwidth).
    moved_blocks: int = 0
    #: Admitted requests whose outputs were cut at ``max_model_len`` (prompt plus the
    #: workload's output length past it): they finish early, with fewer output tokens.
    truncated: int = 0

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def summary(self) -> dict[str, Any]:
        """The run's figures as plain data; a latency or throughput nothing measured (no
        request got a first token, none a second, no time passed) is None, not 0."""

        def pct(values: list[float], q: float) -> float | None:
            if not values:
                return None
            s = sorted(values)
            return s[min(len(s) - 1, int(q * len(s)))]

        throughput = self.output_tokens / self.sim_time_s if self.sim_time_s else None
        return {
            "strategy": self.strategy,
            "workload": self.workload,
            "requests": self.num_requests,
            "finished": self.finished,
            "rejected": len(self.rejected),
            "truncated": self.truncated,
            "max_model_len": self.plan.max_model_len,
            "prompt_tokens": self.prompt_tokens,
            "admitted_prompt_tokens": self.admitted_prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "token_hit_rate": self.hit_rate,
            "group_hit_rates": dict(zip(self.group_labels, self.group_hit_rates, strict=True)),
            "preemptions": self.preemptions,
            "moved_blocks": self.moved_blocks,
            "peak_running": self.peak_running,
            "peak_used_bytes": self.peak_used_bytes,
            "peak_need_bytes": self.peak_need_bytes,
            "budget_bytes": self.plan.memory_bytes,
            "steps": self.steps,
            "sim_time_s": self.sim_time_s,
            "output_tokens_per_s": throughput,
            "ttft_mean_s": sum(self.ttft_s) / len(self.ttft_s) if self.ttft_s else None,
            "ttft_p50_s": pct(self.ttft_s, 0.5),
            "ttft_p99_s": pct(self.ttft_s, 0.99),
            "tpot_mean_s": sum(self.tpot_s) / len(self.tpot_s) if self.tpot_s else None,
            "manager_us_per_step": self.manager_us_per_step,
            "wall_time_s": self.wall_time_s,
            "checkpoint_admission": self.checkpoint_admission,
            "tier_hit_rates": {
                k: v / self.prompt_tokens if self.prompt_tokens else 0.0
                for k, v in self.tier_hit_tokens.items()
            },
            "tiers": self.tiers,
            "sessions_expired": self.sessions_expired,
        }


def group_label(plan: Plan, g: int) -> str:
    group = plan.layout.groups[g]
    spec = group.spec
    detail = ""
    if hasattr(spec, "window"):
        detail = f"({spec.window})"
    elif hasattr(spec, "chunk_size"):
        detail = f"({spec.chunk_size})"
    n = group.num_members
    return f"g{g}:{spec.kind.value}{detail}, {n} layer{'s' if n != 1 else ''}"


def _need_function(model: ModelSpec) -> Callable[[int], int]:
    """``f(n)`` = ``model.resident_bytes(n)``, with the per-layer loop folded into a few terms."""
    full = 0  # bytes per token of layers keeping every token
    state = 0
    windows: dict[int, int] = {}  # window -> bytes per token
    chunks: dict[int, int] = {}  # chunk size -> bytes per token
    other: dict[CacheSpec, int] = {}  # anything else (sink tokens): exact per-spec rule
    for _, _, spec in model.entries():
        kind = spec.kind
        if kind in (CacheKind.FULL, CacheKind.MLA):
            full += spec.bytes_per_token
        elif kind is CacheKind.STATE:
            state += spec.state_bytes
        elif isinstance(spec, SlidingWindowSpec) and not spec.sink_tokens:
            windows[spec.window] = windows.get(spec.window, 0) + spec.bytes_per_token
        elif isinstance(spec, ChunkedLocalSpec):
            chunks[spec.chunk_size] = chunks.get(spec.chunk_size, 0) + spec.bytes_per_token
        else:
            other[spec] = other.get(spec, 0) + 1
    win = list(windows.items())
    chk = list(chunks.items())
    oth = list(other.items())

    def need(n: int) -> int:
        if n <= 0:
            return 0
        total = full * n + state
        for w, bpt in win:
            total += bpt * (n if n < w else w)
        for c, bpt in chk:
            total += bpt * ((n - 1) % c + 1)
        for spec, count in oth:
            total += count * spec.resident_bytes(n)
        return total

    return need


def _check_arg(name: str, value: object, kind: type, hint: str) -> None:
    if not isinstance(value, kind):
        raise SimulationError(
            f"{name}: expected a {kind.__name__} ({hint}), got {brief_repr(value)}"
        )


def plan_for(model: ModelSpec, config: SimConfig) -> Plan:
    """The plan a simulation of ``config`` runs on; raises :class:`PlanError` when none fits
    (or ``model`` is not a :class:`ModelSpec`) and :class:`SimulationError` for a ``config``
    that is not a :class:`SimConfig`."""
    _check_arg("config", config, SimConfig, "SimConfig(memory_bytes=..., max_model_len=...)")
    return make_plan(
        model,
        memory_bytes=config.memory_bytes,
        max_model_len=config.max_model_len,
        strategy=config.strategy,
        block_size=config.block_size,
        kernel_block_size=config.kernel_block_size,
        state_block_size=config.state_block_size,
        pool_ratios=config.pool_ratios,
        chunk_alignment=config.chunk_alignment,
        state_split=config.state_split,
        one_slot_chunks=drops_dead_tails(config.dead_tails, bool(config.tiers())),
    )


def scheduler_for(mgr: KVCacheManager, config: SimConfig) -> Scheduler:
    """The scheduler a simulated instance runs over ``mgr`` (no block tables: no model)."""
    return Scheduler(
        mgr,
        SchedulerConfig(
            token_budget=config.token_budget,
            max_num_seqs=config.max_num_seqs,
            collect_block_ids=False,
            checkpoint_before_end=config.checkpoint_before_end,
            admission=config.admission,
            compaction=config.compaction,
        ),
        max_model_len=config.max_model_len,
    )


def simulate(
    model: ModelSpec,
    profile: ModelProfile,
    workload: Workload,
    config: SimConfig,
    *,
    progress: Callable[[int, int], None] | None = None,
) -> SimResult:
    """Replay ``workload`` through the scheduler and cache manager of a ``config`` plan.

    ``progress(done, total)`` is called as requests finish.  Raises :class:`SimulationError`
    when a request can never fit or an argument is not of its type, and plan errors for an
    impossible plan.
    """
    _check_arg("profile", profile, ModelProfile, "ModelProfile.from_config(load_model_config(...))")
    _check_arg("workload", workload, Workload, "hybridkv.workloads.load_workload(...)")
    plan = plan_for(model, config)
    layout = plan.layout
    mgr = KVCacheManager(
        layout,
        hasher=config.hasher,
        max_model_len=config.max_model_len,
        publish=config.publish,
        window_retention=config.window_retention,
        checkpoint_admission=config.checkpoint_admission,
        tier_admission=config.tier_admission,
        second_chance=config.second_chance,
        window_chances=config.window_chances,
        eviction=config.eviction,
        dead_tails=config.dead_tails,
        checkpoint_life=config.checkpoint_life,
        group_hit_stats=True,  # the report's per-group hit rates
        tiers=config.tiers(),
        tier_write_through=config.write_through,
        checkpoint_when_full=config.checkpoint_when_full,
        protect_share=config.protect_share,
    )
    sched = scheduler_for(mgr, config)
    cost = StepCostModel(model, profile, ACCELERATORS[config.accelerator])
    need_of = _need_function(model)

    n_groups = len(layout.groups)
    pool = mgr.pool

    reqs = list(workload.requests)
    sessions = (
        continuations(reqs, config.block_size, source_block=workload.source_block)
        if config.protect == "oracle"
        else {}
    )
    #: The oracle's bookkeeping: each continued request's predecessor, and the requests that
    #: finished or were rejected (a session ends once its last live turn is done).
    before = {c.successor: rid for rid, c in sessions.items() if c.successor is not None}
    over: set[str] = set()
    by_id: dict[str, WorkloadRequest] = {}
    arrival: dict[str, float] = {}
    first_token: dict[str, float] = {}
    rejected: list[Rejection] = []
    ttft: list[float] = []
    tpot: list[float] = []
    cached_tokens = computed = output_tokens = prompt_tokens = admitted_tokens = 0
    truncated = 0
    peak_running = peak_used = peak_need = finished = steps = moved_blocks = 0
    timeline: list[TimelinePoint] = []
    sample_every = 1
    manager_ns = 0
    clock = 0.0
    idx = 0
    wall0 = time.perf_counter()
    admitted_hits: dict[str, int] = {}
    tier_tokens = {"host": 0, "disk": 0}
    block_sizes = [g.block_size for g in layout.groups]
    tiered = bool(config.tiers())
    from_device = 0  # bytes the lower tiers took from the device, as of the last step

    def point() -> TimelinePoint:
        """The cache's state after the step that just ended."""
        return TimelinePoint(
            time_s=clock,
            step=steps,
            running=sched.num_running,
            waiting=len(sched.waiting),
            used_bytes=pool.used_bytes,
            need_bytes=sum(need_of(s.request.num_computed_tokens) for s in sched.running),
            group_blocks=tuple(pool.used_per_group()),
            hit_rate=sum(admitted_hits.values()) / prompt_tokens if prompt_tokens else 0.0,
        )

    while idx < len(reqs) or sched.has_unfinished():
        while idx < len(reqs) and (
            not config.use_arrivals or reqs[idx].arrival_ms / 1000.0 <= clock
        ):
            r = reqs[idx]
            idx += 1
            prompt_tokens += r.prompt_len
            if r.prompt_len >= config.max_model_len:
                rejected.append(
                    Rejection(
                        r.request_id,
                        r.prompt_len,
                        f"prompt of {r.prompt_len} tokens leaves no room for an output token "
                        f"within max_model_len {config.max_model_len}",
                    )
                )
                if progress is not None:
                    progress(finished + len(rejected), len(reqs))
                if sessions:  # the conversation cannot go on: a finished predecessor lets go
                    over.add(r.request_id)
                    if before.get(r.request_id) in over:
                        mgr.unprotect(sessions[r.request_id].session)
                continue
            max_tokens = min(r.output_len, config.max_model_len - r.prompt_len)
            truncated += max_tokens < r.output_len
            c = sessions.get(r.request_id)
            sched.add_request(
                r.request_id,
                r.prompt_token_ids,
                max_tokens=max_tokens,
                protect_as=c.session if c is not None and c.successor is not None else None,
            )
            by_id[r.request_id] = r
            arrival[r.request_id] = r.arrival_ms / 1000.0 if config.use_arrivals else 0.0
            admitted_tokens += r.prompt_len
        if not sched.has_unfinished():
            if idx < len(reqs):
                clock = max(clock, reqs[idx].arrival_ms / 1000.0)
            continue
        t0 = time.perf_counter_ns()
        out = sched.schedule()
        manager_ns += time.perf_counter_ns() - t0
        if out.is_empty and not out.preempted:
            if not sched.running and sched.waiting:
                rid = sched.waiting[0].request_id
                raise SimulationError(
                    f"request {rid!r} ({by_id[rid].prompt_len} prompt tokens) cannot be "
                    "scheduled even with an empty cache; raise --memory or the token budget"
                )
            if idx < len(reqs):
                clock = max(clock, reqs[idx].arrival_ms / 1000.0)
            continue
        steps += 1
        moved = {"host": 0, "disk": 0}
        new_tokens: dict[str, int] = {}
        for item in out.scheduled:
            new_tokens[item.request_id] = item.num_new_tokens
            if sessions and item.request_id not in admitted_hits and item.request_id in before:
                # the next turn is admitted: its hit is read now, so the protection its
                # predecessor left ends (it protects again when it finishes)
                mgr.unprotect(sessions[item.request_id].session)
            for load in item.allocation.loads:  # every admission's reads, a re-admission's too
                moved[load.tier] += layout.groups[load.group_id].block_bytes
            if item.num_cached_tokens and item.request_id not in admitted_hits:
                admitted_hits[item.request_id] = item.num_cached_tokens
                if item.allocation.loads:
                    served = tier_hit_tokens(item.allocation.loads, block_sizes)
                    for tier, n in served.items():
                        tier_tokens[tier] += n
            elif item.request_id not in admitted_hits:
                admitted_hits[item.request_id] = 0
            computed += item.num_new_tokens
        load_s = cost.load_seconds(moved["host"], moved["disk"]) if any(moved.values()) else 0.0
        if tiered:  # what the tiers took from the device since the last step (both directions
            # of the host link run at once)
            now = sum(t["from_device_bytes"] for t in mgr.tier_stats().values())
            load_s = max(load_s, cost.store_seconds(now - from_device))
            from_device = now
        clock += cost.step_seconds([(s.start, s.num_new_tokens) for s in out.scheduled], load_s)
        if out.moves:  # compaction's copies run before the pass
            moved_blocks += len(out.moves)
            clock += cost.copy_seconds(
                sum(layout.groups[m.group_id].block_bytes for m in out.moves)
            )
        sampled: dict[str, int] = {}
        for item in out.scheduled:
            if item.samples:
                seq = sched.seqs[item.request_id]
                sampled[item.request_id] = by_id[item.request_id].output_token_ids[
                    seq.num_output_tokens
                ]
        # Peaks as the step runs (before the update frees what finished in it): the memory
        # held, the requests running and what they need with this step's tokens computed.
        peak_running = max(peak_running, sched.num_running)
        peak_used = max(peak_used, pool.used_bytes)
        peak_need = max(
            peak_need,
            sum(
                need_of(s.request.num_computed_tokens + new_tokens.get(s.request.request_id, 0))
                for s in sched.running
            ),
        )
        t0 = time.perf_counter_ns()
        results = sched.update(out, sampled)
        manager_ns += time.perf_counter_ns() - t0
        for res in results:
            rid = res.request_id
            output_tokens += 1
            if rid not in first_token:
                first_token[rid] = clock
                ttft.append(clock - arrival[rid])
            if res.finished:
                finished += 1
                c = sessions.get(rid)
                if c is not None:
                    over.add(rid)
                    # nothing left to read it: no next turn, or one already admitted (its
                    # hit was read then; found by review: 168 protections nobody read)
                    if c.successor is None or c.successor in over or c.successor in admitted_hits:
                        mgr.unprotect(c.session)
                if res.num_output_tokens > 1:
                    tpot.append((clock - first_token[rid]) / (res.num_output_tokens - 1))
                if progress is not None:
                    progress(finished + len(rejected), len(reqs))
        if steps % sample_every == 0:
            timeline.append(point())
            if len(timeline) >= 2 * config.timeline_points:
                # keep the multiples of the new spacing: the samples stay evenly spaced in
                # steps (keeping every other one mixed odd and even steps)
                sample_every *= 2
                timeline = [p for p in timeline if p.step % sample_every == 0]
    if steps and (not timeline or timeline[-1].step != steps):
        timeline.append(point())  # the last step, whatever the spacing

    cached_tokens = sum(admitted_hits.values())
    stats = mgr.stats
    q = stats.query_tokens or 1
    return SimResult(
        strategy=config.label or str(config.strategy),
        plan=plan,
        workload=workload.name,
        num_requests=len(reqs),
        finished=finished,
        rejected=rejected,
        prompt_tokens=prompt_tokens,
        admitted_prompt_tokens=admitted_tokens,
        cached_tokens=cached_tokens,
        computed_tokens=computed,
        output_tokens=output_tokens,
        preemptions=sched.num_preemptions,
        moved_blocks=moved_blocks,
        truncated=truncated,
        steps=steps,
        sim_time_s=clock,
        wall_time_s=time.perf_counter() - wall0,
        peak_running=peak_running,
        peak_used_bytes=peak_used,
        peak_need_bytes=peak_need,
        ttft_s=ttft,
        tpot_s=tpot,
        group_hit_rates=tuple(h / q for h in stats.group_alone_hit_tokens),
        group_labels=tuple(group_label(plan, g) for g in range(n_groups)),
        manager_us_per_step=manager_ns / 1000.0 / steps if steps else 0.0,
        timeline=timeline,
        checkpoint_admission=mgr.checkpoint_admission_report(),
        tier_hit_tokens={k: v for k, v in tier_tokens.items() if k in mgr.tier_stats()},
        tiers=mgr.tier_stats(),
        sessions_expired=mgr.session_stats()["expired"],
    )
