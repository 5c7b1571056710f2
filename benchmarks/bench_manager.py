"""Replay a hybrid workload through KVCacheManager with a minimal scheduler; time every call.

The scheduler mimics vLLM v1's: an 8192-token budget per step, running requests first
(continuing prefill in chunks, then decode), then waiting requests admitted with their prefix
hit; when an allocation fails the most recently admitted running request is preempted
(recompute).  With a state group, prefill chunks end at block boundaries: at the junction
where the prompt leaves the cached prefix, and at the last aligned boundary of the prompt,
so checkpoints land where later requests can hit them.

Layouts (block 16, every group 4 layers of 8 KV heads x 128 dims in bf16, 256 KiB per block;
the toy state spec is sized to the same block bytes so that 6000 blocks are the same memory
for every strategy): ``full+swa`` (window 128), ``full+state`` (Mamba-like), and
``full+swa+state``.  Strategies: ``uniform`` (one pool of 6000 blocks, as vLLM), ``pools``
(6000 blocks split statically with SGLang's default ratios: sliding window 0.8, state 0.9 of
the full-attention pool), ``arena`` (1500 chunks of 4 blocks; chunk 0 reserved; chunk-level
LRU across groups) and ``arena_own`` (the same arena, each group evicting its own blocks
first).

Workload: :func:`hybridkv.workloads.conversation_workload` (seeded; multi-turn follow-ups are
released ``think_steps`` after the turn they continue finished), or with ``--trace`` a
Mooncake trace read by :func:`hybridkv.workloads.load_mooncake_trace` (prompts up to 32768
tokens) at ``--ms-per-step``.

Each configuration is replayed ``--repeat`` times (the replay is deterministic, so hit rates
do not change) and the fastest replay's timings are reported, to damp interference from other
processes on a shared machine.

Usage::

    python benchmarks/bench_manager.py                        # synthetic, all layouts x strategies
    python benchmarks/bench_manager.py --trace PATH --requests 300
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybridkv.cache import KVCacheManager, Request, compiled
from hybridkv.plan.layout import ArenaPlan, GroupPlan, MemoryLayout, PoolPlan, Strategy
from hybridkv.specs import (
    CacheKind,
    CacheSpec,
    DType,
    FullAttentionSpec,
    SlidingWindowSpec,
    StateMixer,
    StateSpec,
    StateTensor,
)
from hybridkv.workloads import (
    ConversationConfig,
    StepRequest,
    WorkloadError,
    conversation_workload,
    load_mooncake_trace,
    step_requests,
    step_summary,
)

from bench_cli import out_path

#: Where the Mooncake conversation trace lives in this workspace (not in the repository).
DEFAULT_TRACE = (
    Path(__file__).resolve().parents[2] / "shared/traces/mooncake_conversation_trace.jsonl"
)

BLOCK_SIZE = 16
LAYERS_PER_GROUP = 4
_ATTN = {"num_kv_heads": 8, "head_dim": 128, "dtype": DType.BF16}
#: ``wall``: elapsed time (what an engine waits); ``cpu``: this thread's CPU time, which
#: leaves out time the OS gave to other processes (use it on a shared machine).
CLOCKS: dict[str, Callable[[], int]] = {"wall": time.perf_counter_ns, "cpu": time.thread_time_ns}
#: SGLang's default static split, relative to the full-attention pool.
POOL_WEIGHTS = {CacheKind.FULL: 1.0, CacheKind.SLIDING: 0.8, CacheKind.STATE: 0.9}


#: The layouts (``--models``) and strategies (``--strategies``) this benchmark builds.
LAYOUTS = ("full+swa", "full+state", "full+swa+state")
STRATEGIES = ("uniform", "pools", "arena", "arena_own")


def _specs(name: str) -> list[CacheSpec]:
    full = FullAttentionSpec(**_ATTN)  # type: ignore[arg-type]
    swa = SlidingWindowSpec(window=128, **_ATTN)  # type: ignore[arg-type]
    page = full.bytes_per_block(BLOCK_SIZE)
    state = StateSpec(
        mixer=StateMixer.MAMBA2,
        tensors=(StateTensor(name="ssm", shape=(page // 2,), dtype=DType.BF16),),
    )
    return {
        "full+swa": [full, swa],
        "full+state": [full, state],
        "full+swa+state": [full, swa, state],
    }[name]


def build_layout(model: str, strategy: str, num_blocks: int, chunk_blocks: int) -> MemoryLayout:
    """The benchmark layout: ``num_blocks`` blocks' worth of memory for any strategy."""
    groups = []
    for gid, spec in enumerate(_specs(model)):
        members = tuple((gid * LAYERS_PER_GROUP + i, 0) for i in range(LAYERS_PER_GROUP))
        groups.append(
            GroupPlan(
                group_id=gid,
                spec=spec,
                members=members,
                block_size=BLOCK_SIZE,
                kernel_block_size=BLOCK_SIZE,
                page_bytes=spec.bytes_per_block(BLOCK_SIZE),
            )
        )
    block_bytes = groups[0].block_bytes
    assert all(g.block_bytes == block_bytes for g in groups)
    if strategy == "uniform":
        pool = PoolPlan(
            pool_id=0,
            group_ids=tuple(range(len(groups))),
            block_bytes=block_bytes,
            num_blocks=num_blocks,
        )
        return MemoryLayout(strategy=Strategy.UNIFORM, groups=tuple(groups), pools=(pool,))
    if strategy == "pools":
        weights = [POOL_WEIGHTS[g.spec.kind] for g in groups]
        counts = [int(num_blocks * w / sum(weights)) for w in weights]
        plans = tuple(
            PoolPlan(
                pool_id=g.group_id, group_ids=(g.group_id,), block_bytes=block_bytes, num_blocks=n
            )
            for g, n in zip(groups, counts, strict=True)
        )
        return MemoryLayout(strategy=Strategy.POOLS, groups=tuple(groups), pools=plans)
    arena = ArenaPlan(chunk_bytes=block_bytes * chunk_blocks, num_chunks=num_blocks // chunk_blocks)
    return MemoryLayout(strategy=Strategy.ARENA, groups=tuple(groups), arena=arena)


@dataclass
class _Live:
    spec: StepRequest
    req: Request
    generated: int = 0
    admitted: bool = False  # a first admission counted its hit (later ones re-read its own)


@dataclass
class RunResult:
    times: dict[str, list[int]] = field(
        default_factory=lambda: {
            k: [] for k in ("get_computed_blocks", "allocate_slots", "free", "preempt")
        }
    )
    steps: int = 0
    wall_s: float = 0.0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    preemptions: int = 0
    finished: int = 0
    #: Requests that did not fit the cache even with nothing else in it (dropped, not run).
    rejected: int = 0
    peak_usage: float = 0.0


def _split(start: int, end: int, junction: int, prompt_end: int, align: int) -> int:
    """End of a state-layout prefill chunk: the junction, else an aligned boundary."""
    if start < junction < end:
        return junction
    aligned = end - end % align
    if end == prompt_end and aligned > start:
        return aligned
    if end < prompt_end and aligned > start:
        return aligned
    return end


def simulate(
    mgr: KVCacheManager,
    workload: Sequence[StepRequest],
    *,
    budget: int = 8192,
    max_steps: int = 1_000_000,
    clock: Callable[[], int] = time.perf_counter_ns,
) -> RunResult:
    """Run ``workload`` to completion through ``mgr``; time every manager call with ``clock``
    (nanoseconds; the clock's own cost is subtracted from every sample)."""
    res = RunResult()
    split = any(g.spec.kind is CacheKind.STATE for g in mgr.layout.groups)
    align = mgr.schedule_alignment
    t_gcb, t_alloc, t_free, t_pre = (res.times[k] for k in res.times)
    overhead = _clock_overhead(clock)
    pending = deque(
        sorted((r for r in workload if r.parent_id is None), key=lambda r: r.arrival_step)
    )
    children: dict[str, list[StepRequest]] = {}
    for r in workload:
        if r.parent_id is not None:
            children.setdefault(r.parent_id, []).append(r)
    delayed: list[tuple[int, StepRequest]] = []
    waiting: deque[_Live] = deque()
    running: list[_Live] = []
    total = len(workload)
    start = time.perf_counter()
    step = 0
    while res.finished + res.rejected < total and step < max_steps:
        while pending and pending[0].arrival_step <= step:
            w = pending.popleft()
            waiting.append(_Live(w, mgr.make_request(w.request_id, list(w.prompt_token_ids))))
        if delayed:
            ready = [d for d in delayed if d[0] <= step]
            for d in ready:
                delayed.remove(d)
                spec = d[1]
                waiting.append(
                    _Live(spec, mgr.make_request(spec.request_id, list(spec.prompt_token_ids)))
                )
        left = budget
        scheduled: list[tuple[_Live, int]] = []
        preempted = False
        i = 0
        while i < len(running) and left > 0:
            live = running[i]
            req = live.req
            n = min(req.num_tokens - req.num_computed_tokens, left)
            if split and req.num_computed_tokens < live.spec.prompt_len:
                s = req.num_computed_tokens
                n = _split(s, s + n, -1, live.spec.prompt_len, align) - s
            while True:
                t0 = clock()
                out = mgr.allocate_slots(req, n)
                t_alloc.append(clock() - t0)
                if out is not None:
                    break
                victim = running.pop()
                t0 = clock()
                mgr.preempt(victim.req.request_id)
                t_pre.append(clock() - t0)
                waiting.appendleft(victim)
                res.preemptions += 1
                preempted = True
                if victim is live:
                    break
            if out is None:
                break
            scheduled.append((live, n))
            left -= n
            i += 1
        while waiting and left > 0 and not preempted:
            live = waiting[0]
            req = live.req
            t0 = clock()
            hit = mgr.get_computed_blocks(req)
            t_gcb.append(clock() - t0)
            h = hit.num_computed_tokens
            n = min(req.num_tokens - h, left)
            if split:
                n = _split(h, h + n, hit.junction_tokens, live.spec.prompt_len, align) - h
            t0 = clock()
            out = mgr.allocate_slots(req, n, num_new_computed_tokens=h, new_computed_blocks=hit)
            t_alloc.append(clock() - t0)
            if out is None:
                break
            waiting.popleft()
            running.append(live)
            req.num_computed_tokens = h
            if not live.admitted:  # the first admission's hit; a preempted request's return
                live.admitted = True  # re-reads its own blocks, which is no prefix reuse
                res.hit_tokens += h
                res.prompt_tokens += req.num_tokens
            scheduled.append((live, n))
            left -= n
        if not scheduled and not running and waiting and not preempted:
            # The cache holds nothing running, and the head of the queue still does not fit:
            # it never will, so it is dropped (with the turns that continue it) and counted.
            # (It holds no blocks: a failed allocation takes none, a preemption freed them.)
            dropped = [waiting.popleft().spec]
            while dropped:
                spec = dropped.pop()
                res.rejected += 1
                dropped.extend(children.pop(spec.request_id, ()))
        res.peak_usage = max(res.peak_usage, mgr.usage)
        for live, n in scheduled:
            req = live.req
            req.num_computed_tokens += n
            if req.num_computed_tokens < req.num_tokens:
                continue
            req.append_token_ids([live.spec.output_token_ids[live.generated]])
            live.generated += 1
            if live.generated == live.spec.output_len:
                t0 = clock()
                mgr.free(req.request_id)
                t_free.append(clock() - t0)
                running.remove(live)
                res.finished += 1
                for child in children.get(live.spec.request_id, ()):
                    delayed.append((max(child.arrival_step, step + child.think_steps), child))
        step += 1
    res.steps = step
    res.wall_s = time.perf_counter() - start
    for samples in res.times.values():
        samples[:] = [max(0, t - overhead) for t in samples]
    return res


def _clock_overhead(clock: Callable[[], int], n: int = 20_000) -> int:
    """Median cost of reading ``clock`` twice back to back (ns)."""
    samples = []
    for _ in range(n):
        t0 = clock()
        samples.append(clock() - t0)
    samples.sort()
    return samples[n // 2]


def _summary(ns: list[int]) -> dict[str, float]:
    if not ns:
        return {"count": 0, "mean_us": 0.0, "p50_us": 0.0, "p99_us": 0.0}
    s = sorted(ns)
    return {
        "count": len(s),
        "mean_us": statistics.fmean(s) / 1000,
        "p50_us": s[len(s) // 2] / 1000,
        "p99_us": s[min(len(s) - 1, int(len(s) * 0.99))] / 1000,
    }


def run_one(
    model: str, strategy: str, workload: Sequence[StepRequest], args: argparse.Namespace
) -> dict[str, Any]:
    kind = "arena" if strategy.startswith("arena") else strategy
    layout = build_layout(model, kind, args.num_blocks, args.chunk_blocks)
    eviction = "own_first" if strategy == "arena_own" else "chunk_lru"
    best: tuple[RunResult, KVCacheManager] | None = None
    for _ in range(args.repeat):  # the replay is deterministic: repeats differ only in timing
        mgr = KVCacheManager(layout, hasher=args.hasher, arena_eviction=eviction)
        gc.collect()
        gc.disable()
        try:
            res = simulate(mgr, workload, budget=args.budget, clock=CLOCKS[args.clock])
        finally:
            gc.enable()
        mgr.check_invariants()
        if best is None or res.wall_s < best[0].wall_s:
            best = (res, mgr)
    assert best is not None
    res, mgr = best
    stats = mgr.stats
    return {
        "model": model,
        "strategy": strategy,
        "calls": {k: _summary(v) for k, v in res.times.items()},
        "steps": res.steps,
        "steps_per_s": res.steps / res.wall_s if res.wall_s else 0.0,
        "wall_s": res.wall_s,
        "manager_us_per_step": sum(map(sum, res.times.values())) / 1000 / res.steps
        if res.steps
        else 0.0,
        "token_hit_rate": res.hit_tokens / res.prompt_tokens if res.prompt_tokens else 0.0,
        "manager_hit_rate": stats.hit_rate,
        "alone_hit_rate": [a / stats.query_tokens for a in stats.group_alone_hit_tokens]
        if stats.query_tokens
        else [],
        "preemptions": res.preemptions,
        "finished": res.finished,
        "rejected": res.rejected,
        "requests": len(workload),
        "peak_usage": res.peak_usage,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="full+swa,full+state,full+swa+state")
    p.add_argument("--strategies", default="uniform,pools,arena,arena_own")
    p.add_argument("--num-requests", type=int, default=200, help="synthetic workload size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-blocks", type=int, default=6000)
    p.add_argument("--chunk-blocks", type=int, default=4, help="arena: blocks per chunk")
    p.add_argument("--budget", type=int, default=8192, help="tokens per step")
    p.add_argument("--hasher", default="sha256", choices=["xxh3", "sha256", "builtin"])
    p.add_argument("--arrival-interval", type=float, default=4.0, help="steps between arrivals")
    p.add_argument("--trace", type=Path, default=None, help="Mooncake trace (JSONL) instead")
    p.add_argument("--requests", type=int, default=300, help="trace requests to replay")
    p.add_argument("--ms-per-step", type=float, default=50.0, help="trace time per step")
    p.add_argument(
        "--repeat", type=int, default=3, help="replays per configuration; the fastest is kept"
    )
    p.add_argument("--clock", choices=sorted(CLOCKS), default="wall", help="per-call timer")
    p.add_argument("--out", type=Path, default=Path("results/bench_manager.json"))
    args = p.parse_args(argv)
    models, strategies = args.models.split(","), args.strategies.split(",")
    for flag, names, valid in (
        ("--models", models, LAYOUTS),
        ("--strategies", strategies, STRATEGIES),
    ):
        bad = [n for n in names if n not in valid]
        if bad:
            p.error(f"{flag}: unknown {', '.join(map(repr, bad))}; valid: {', '.join(valid)}")
    for name in ("num_requests", "num_blocks", "chunk_blocks", "budget", "requests", "repeat"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}: must be at least 1, got {getattr(args, name)}")
    args.out = out_path(p, args.out)

    if args.trace is not None:
        path = DEFAULT_TRACE if str(args.trace) == "default" else args.trace
        if not path.exists():
            if str(args.trace) != "default":  # a path the user gave must exist
                p.error(f"--trace: {path} does not exist")
            print(f"bench_manager: trace {path} not found; skipping")
            return 0
        try:
            trace = load_mooncake_trace(path, limit=args.requests, max_prompt_tokens=32768)
        except WorkloadError as exc:
            print(f"bench_manager: {exc}", file=sys.stderr)
            return 2
        workload = step_requests(trace, ms_per_step=args.ms_per_step)
        source = f"mooncake:{path.name}:{len(workload)}"
    else:
        workload = conversation_workload(
            ConversationConfig(
                num_requests=args.num_requests,
                seed=args.seed,
                arrival_gap_steps=args.arrival_interval,
            )
        )
        source = "synthetic"
    info = step_summary(workload)
    print(f"workload {source}: {json.dumps(info)}; build: {'compiled' if compiled() else 'pure'}")
    results = []
    header = (
        f"{'layout':<16}{'strategy':<10}{'gcb mean/p50/p99 us':>22}{'alloc mean/p50/p99 us':>24}"
        f"{'free mean us':>13}{'us/step':>9}{'steps/s':>9}{'hit':>7}{'preempt':>8}{'done':>12}"
    )
    print(header)
    incomplete = []
    for model in models:
        for strategy in strategies:
            r = run_one(model, strategy, workload, args)
            results.append(r)
            g, a, f = (r["calls"][k] for k in ("get_computed_blocks", "allocate_slots", "free"))
            done = f"{r['finished']}/{r['requests']}"
            print(
                f"{model:<16}{strategy:<10}"
                f"{g['mean_us']:>8.1f}/{g['p50_us']:>5.1f}/{g['p99_us']:>6.1f}"
                f"{a['mean_us']:>10.1f}/{a['p50_us']:>5.1f}/{a['p99_us']:>6.1f}"
                f"{f['mean_us']:>13.1f}{r['manager_us_per_step']:>9.1f}{r['steps_per_s']:>9.0f}"
                f"{r['token_hit_rate']:>7.1%}{r['preemptions']:>8}{done:>12}"
            )
            if r["rejected"]:
                print(
                    f"  warning: {r['rejected']} requests never fit this cache alone and were "
                    "dropped (not in the hit rate); give more --num-blocks",
                    file=sys.stderr,
                )
            if r["finished"] + r["rejected"] < r["requests"]:
                incomplete.append(f"{model}/{strategy}")
    print(
        "gcb: get_computed_blocks (hashing is in make_request, not timed); us/step: every "
        "timed manager call per step; hit: prompt tokens served from cache at each request's "
        "first admission; done: finished/requests"
    )
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    payload = {
        "source": source,
        "workload": info,
        "config": config,
        "compiled": compiled(),
        "results": results,
    }
    args.out.write_text(json.dumps(payload, indent=2))
    print(f"wrote {args.out}")
    if incomplete:
        print(
            f"bench_manager: {', '.join(incomplete)} stopped at the step limit with requests "
            "unfinished; their timings are not comparable",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
