"""Head to head: hybridkv's KVCacheManager vs vLLM 0.33's own KVCacheManager.

Both managers are driven by the same scheduler loop (``vllm_driver.run_minimal_scheduler``:
running requests first, FCFS admission with a prefix lookup, chunked prefill under a token
budget, preemption by recompute, and for recurrent-state models vLLM's "align" mode chunk
splits at block boundaries and at the shared-prefix junction) over the same requests, at the
same memory bytes.  Printed per model and system: token hit rate, preemptions, peak memory,
manager microseconds per step (get_computed_blocks + allocate_slots + free + end-of-step
bookkeeping) and hashing microseconds per step (vLLM: building the Request with its block
hashes and appending output tokens; hybridkv: make_request and append_token_ids), each side's
time over its own step count; and the ratios hybridkv / vLLM.  The time ratios are of TOTAL
time over the same workload (sum over the run of hybridkv's time / vLLM's), not of the
per-step figures, since the two sides may take different step counts: manager time alone,
and manager time plus hashing.  Thread CPU time per step is in the JSON as well.  Each side's
run starts with ``gc.collect(); gc.freeze()`` after its manager is built (as vLLM's engine
freezes its start-up heap) and ``gc.unfreeze()`` after.  ``--vllm-retention-interval`` sets
vLLM's ``CacheConfig.prefix_cache_retention_interval`` (default: vLLM's own, 0).

vLLM is optional: see docs/vllm.md for the CPU install recipe.  Without it the script prints
one line and exits 0.  Run it with the interpreter that has vLLM, e.g.

    /tmp/vllmenv/bin/python benchmarks/compare_vllm.py --requests 2000

hybridkv is imported from this checkout's ``src/`` (no install needed in vLLM's venv).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# HYBRIDKV_SRC: another build of this checkout (e.g. the compiled one, setup.py) to measure.
sys.path.insert(0, os.environ.get("HYBRIDKV_SRC", str(ROOT / "src")))
sys.path.insert(0, str(ROOT / "benchmarks"))

from hybridkv.cache import (  # noqa: E402
    KVCacheManager,
    compiled,
)
from hybridkv.cache.policies import CHECKPOINT_LIFE, DEAD_TAILS, drops_dead_tails  # noqa: E402
from hybridkv.cache.pool_base import DEFAULT_CHANCES  # noqa: E402
from hybridkv.models import resolve_model  # noqa: E402
from hybridkv.plan import make_plan  # noqa: E402
from hybridkv.specs import (  # noqa: E402
    AttentionSpec,
    LayerSpec,
    MLASpec,
    ModelSpec,
    NoCacheSpec,
    SlidingWindowSpec,
    StateSpec,
)
from hybridkv.workloads import (  # noqa: E402
    StepRequest,
    WorkloadError,
    load_mooncake_trace,
    step_requests,
)

import vllm_driver as vd  # noqa: E402
from bench_cli import out_path  # noqa: E402
from hybridkv_adapter import MANAGER_OPS, HybridkvAdapter  # noqa: E402

DEFAULT_TRACE = ROOT.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"


def vllm_groups(model: ModelSpec, block_size: int) -> list[vd.GroupDesc]:
    """vLLM group descriptions of ``model``'s caching layers (attention and Mamba-like)."""
    out: list[dict[str, Any]] = []
    counts: dict[Any, int] = {}
    for _, _, spec in model.entries():
        counts[spec] = counts.get(spec, 0) + 1
    for spec, n in counts.items():
        if isinstance(spec, StateSpec):
            out.append(
                {
                    "kind": "mamba",
                    "num_layers": n,
                    "block_size": block_size,
                    "mamba_shapes": tuple(t.shape for t in spec.tensors),
                    "mamba_dtype_bytes": tuple(t.dtype.itemsize for t in spec.tensors),
                }
            )
        elif isinstance(spec, MLASpec):
            out.append(
                {
                    "kind": "mla",
                    "num_layers": n,
                    "num_kv_heads": 1,
                    "head_dim": spec.latent_dim,
                    "dtype_bytes": spec.dtype.itemsize,
                    "block_size": block_size,
                }
            )
        elif isinstance(spec, AttentionSpec):
            out.append(
                {
                    "kind": "sliding" if isinstance(spec, SlidingWindowSpec) else "full",
                    "num_layers": n,
                    "num_kv_heads": spec.num_kv_heads,
                    "head_dim": spec.head_dim,
                    "dtype_bytes": spec.dtype.itemsize,
                    "window": spec.window if isinstance(spec, SlidingWindowSpec) else 0,
                    "block_size": block_size,
                }
            )
        else:
            raise SystemExit(f"compare_vllm: no vLLM mapping for {spec.kind.value} layers")
    return [vd.GroupDesc.from_any(g) for g in out]


def without_state(model: ModelSpec) -> ModelSpec | None:
    """``model`` with its recurrent-state caches storing nothing (None: it has none).

    Run through the same loop it gives ``--ceiling``: the hit rate a state that took no
    memory and could be restored at every block would allow, with the attention layers and
    everything else unchanged.  No state policy can beat it at the same memory."""
    if not any(isinstance(spec, StateSpec) for _, _, spec in model.entries()):
        return None
    layers = []
    for layer in model.layers:
        kept = tuple(c for c in layer.caches if not isinstance(c, StateSpec))
        layers.append(
            LayerSpec(
                index=layer.index,
                layer_type=layer.layer_type,
                caches=kept or (NoCacheSpec(),),
                tag=layer.tag,
            )
        )
    return ModelSpec(
        name=f"{model.name} (state-free)",
        model_type=model.model_type,
        layers=tuple(layers),
        tp_size=model.tp_size,
        max_position_embeddings=model.max_position_embeddings,
    )


def _summary(
    metrics: dict[str, Any], timings: dict[str, list[int]], cpu_ns: dict[str, int]
) -> dict[str, Any]:
    """One run of one side: its decisions, and its times from the adapter's ``timings``
    (wall ns per call) and ``cpu_ns`` (thread CPU ns per operation, all calls): totals in
    ns (``manager_ns``: the :data:`MANAGER_OPS`; ``hash_ns``: the "hash" op) for the ratios,
    and the same per step of this side's own run for display."""
    steps = max(1, metrics["steps"])
    manager_ns = sum(sum(timings.get(op, ())) for op in MANAGER_OPS)
    hash_ns = sum(timings.get("hash", ()))
    manager_cpu_ns = sum(cpu_ns.get(op, 0) for op in MANAGER_OPS)
    hash_cpu_ns = cpu_ns.get("hash", 0)
    return {
        "token_hit_rate": metrics["token_hit_rate"],
        "preemptions": metrics["preemptions"],
        "peak_used_bytes": metrics["peak_used_bytes"],
        "finished": metrics["finished"],
        "rejected": metrics["rejected"],
        "steps": metrics["steps"],
        "manager_ns": manager_ns,
        "hash_ns": hash_ns,
        "manager_cpu_ns": manager_cpu_ns,
        "hash_cpu_ns": hash_cpu_ns,
        "manager_us_per_step": manager_ns / 1e3 / steps,
        "hash_us_per_step": hash_ns / 1e3 / steps,
        "manager_cpu_us_per_step": manager_cpu_ns / 1e3 / steps,
        "hash_cpu_us_per_step": hash_cpu_ns / 1e3 / steps,
        "calls": vd.op_stats(timings, {op: cpu_ns.get(op, 0) for op in timings}),
        "wall_s": metrics["wall_s"],
    }


#: Summary keys every repeated run of one side must reproduce exactly (the decisions).
DECISIONS = ("token_hit_rate", "preemptions", "peak_used_bytes", "finished", "rejected", "steps")

#: Summary keys :func:`merge_runs` takes from the median run (by manager time).
TIMES = (
    "manager_ns",
    "hash_ns",
    "manager_cpu_ns",
    "hash_cpu_ns",
    "manager_us_per_step",
    "hash_us_per_step",
    "manager_cpu_us_per_step",
    "hash_cpu_us_per_step",
    "calls",
)


def merge_runs(
    runs: Sequence[dict[str, Any]], side: str, decisions: Sequence[str] = DECISIONS
) -> dict[str, Any]:
    """One side's repeated runs as one summary: the ``decisions`` (default :data:`DECISIONS`)
    must be identical in every run (the loop is deterministic; a difference is a bug,
    raised); the times (:data:`TIMES`) are all the median run's (by manager time), with
    every run's manager and hashing time per step in ``manager_us_per_step_runs`` and
    ``hash_us_per_step_runs``."""
    if not runs:
        raise ValueError(f"{side}: no runs to merge")
    first = runs[0]
    for key in decisions:
        seen = [r[key] for r in runs]
        if any(x != seen[0] for x in seen):
            raise RuntimeError(f"{side}: {key} differs between repeated runs: {seen}")
    times = [r["manager_us_per_step"] for r in runs]
    order = sorted(range(len(runs)), key=times.__getitem__)
    mid = runs[order[(len(runs) - 1) // 2]]  # the lower median: a run that happened
    return {
        **first,
        **{key: mid[key] for key in TIMES},
        "wall_s": sum(r["wall_s"] for r in runs),
        "manager_us_per_step_runs": times,
        "hash_us_per_step_runs": [r["hash_us_per_step"] for r in runs],
    }


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def time_ratios(vllm: dict[str, Any], ours: dict[str, Any]) -> dict[str, float | None]:
    """hybridkv / vLLM of the TOTAL time over the same workload (the summaries' ns totals),
    not of the per-step figures (each side's steps are its own): manager time, manager time
    plus hashing, and the same two in thread CPU time.  None where vLLM's is 0."""
    return {
        "manager_time": _ratio(ours["manager_ns"], vllm["manager_ns"]),
        "manager_time_with_hash": _ratio(
            ours["manager_ns"] + ours["hash_ns"], vllm["manager_ns"] + vllm["hash_ns"]
        ),
        "manager_cpu_time": _ratio(ours["manager_cpu_ns"], vllm["manager_cpu_ns"]),
        "manager_cpu_time_with_hash": _ratio(
            ours["manager_cpu_ns"] + ours["hash_cpu_ns"],
            vllm["manager_cpu_ns"] + vllm["hash_cpu_ns"],
        ),
    }


def parse_retention_interval(text: str) -> int | str | None:
    """``--vllm-retention-interval``: "default" (vLLM's own, :data:`vd.DEFAULT_RETENTION`),
    "none" (None: dense) or a positive int of tokens.  ValueError (one line) otherwise;
    whether vLLM accepts the int for a model (a multiple of its scheduler block size, a
    sliding-window or Mamba group) is checked per model once vLLM is importable."""
    word = text.strip().lower()
    if word == vd.DEFAULT_RETENTION:
        return vd.DEFAULT_RETENTION
    if word == "none":
        return None
    try:
        value = int(word)
    except ValueError:
        raise ValueError(
            f"--vllm-retention-interval: {text!r} is not 'default', 'none' or a positive integer"
        ) from None
    if value <= 0:
        raise ValueError(
            f"--vllm-retention-interval: {text!r} must be a positive integer ('default' is "
            "vLLM's own 0; 'none' keeps every block)"
        )
    return value


def _retention_label(value: int | str | None) -> str:
    return "none" if value is None else str(value)


def _run_frozen(
    adapter: Any, requests: Sequence[StepRequest], token_budget: int, max_model_len: int
) -> dict[str, Any]:
    """One side's run with everything that exists before it (its manager included) out of
    the collector's way, as vLLM's engine does after start-up (``gc.freeze``); both sides
    alike."""
    gc.collect()
    gc.freeze()
    try:
        return vd.run_minimal_scheduler(
            adapter, requests, token_budget, max_model_len=max_model_len
        )
    finally:
        gc.unfreeze()


def compare(
    name: str,
    requests: Sequence[StepRequest],
    *,
    memory_bytes: int,
    max_model_len: int,
    token_budget: int,
    strategy: str,
    block_size: int,
    state_block_size: int | None,
    chunk_alignment: int | None = None,
    second_chance: int = DEFAULT_CHANCES,
    window_chances: int | None = None,
    state_split: int | None = None,
    compaction: bool = True,
    repeat: int = 1,
    eviction: str = "lru",
    dead_tails: str = "auto",
    ceiling: bool = False,
    checkpoint_life: str = "auto",
    vllm_retention_interval: int | str | None = vd.DEFAULT_RETENTION,
) -> dict[str, Any]:
    """One model's head to head; ``repeat`` runs of each side, alternating, report the
    median manager time (decisions must repeat exactly).  ``ceiling``: also run the
    hybridkv side once on the model without its state (:func:`without_state`).
    ``vllm_retention_interval``: vLLM's ``prefix_cache_retention_interval`` ("default":
    vLLM's own; see :func:`parse_retention_interval`)."""
    model = resolve_model(name)

    def plan_for(spec: ModelSpec) -> Any:
        return make_plan(
            spec,
            memory_bytes=memory_bytes,
            max_model_len=max_model_len,
            strategy=strategy,
            block_size=block_size,
            state_block_size=state_block_size,
            **({} if chunk_alignment is None else {"chunk_alignment": chunk_alignment}),
            **({} if state_split is None else {"state_split": state_split}),
            one_slot_chunks=drops_dead_tails(dead_tails, False),  # no tiers here
        )

    def run_ours(layout: Any) -> tuple[dict[str, Any], HybridkvAdapter]:
        ours = HybridkvAdapter(
            KVCacheManager(
                layout,
                hasher="sha256",
                second_chance=second_chance,
                window_chances=window_chances,
                eviction=eviction,
                dead_tails=dead_tails,
                checkpoint_life=checkpoint_life,
            ),
            token_budget=token_budget,
            compaction=compaction,
        )
        h = _run_frozen(ours, requests, token_budget, max_model_len)
        return h, ours

    plan = plan_for(model)
    vruns: list[dict[str, Any]] = []
    hruns: list[dict[str, Any]] = []
    for _ in range(repeat):  # the two sides alternate, so a drift of the machine hits both
        setup = vd.build_vllm_manager(
            vllm_groups(model, block_size),
            memory_bytes=memory_bytes,
            max_model_len=max_model_len,
            token_budget=token_budget,
            retention_interval=vllm_retention_interval,
        )
        vllm_adapter = vd.VllmManagerAdapter(setup)
        v = _run_frozen(vllm_adapter, requests, token_budget, max_model_len)
        vruns.append(_summary(v, vllm_adapter.timings, vllm_adapter.cpu_ns))
        h, ours = run_ours(plan.layout)
        hruns.append({**_summary(h, ours.timings, ours.cpu_ns), "moved_blocks": ours.moved_blocks})
    vs = merge_runs(vruns, "vLLM")
    hs = merge_runs(hruns, "hybridkv", (*DECISIONS, "moved_blocks"))
    stateless = without_state(model) if ceiling else None
    bound: dict[str, Any] | None = None
    if stateless is not None:
        h, ours = run_ours(plan_for(stateless).layout)
        b = _summary(h, ours.timings, ours.cpu_ns)
        bound = {k: b[k] for k in ("token_hit_rate", "preemptions", "steps")}
    return {
        "model": name,
        "memory_bytes": memory_bytes,
        "vllm": {
            **vs,
            "groups": setup.groups,
            "scheduler_block_size": setup.scheduler_block_size,
            # the option as given ("default": not passed) and the value vLLM ran with
            "retention_interval": _retention_label(vllm_retention_interval),
            "prefix_cache_retention_interval": (
                setup.vllm_config.cache_config.prefix_cache_retention_interval
            ),
        },
        "hybridkv": {
            **hs,
            "strategy": strategy,
            "second_chance": second_chance,
            "window_chances": window_chances,
            "eviction": eviction,
            "dead_tails": dead_tails,
            "checkpoint_life": checkpoint_life,
            "compaction": compaction,
            "schedule_alignment": plan.layout.schedule_alignment,
            "state_split": plan.options.state_split,
            "groups": [
                {"kind": g.spec.kind.value, "layers": g.num_members, "block_size": g.block_size}
                for g in plan.layout.groups
            ],
        },
        "ceiling": bound,
        "ratios": {
            "hit_rate": hs["token_hit_rate"] / vs["token_hit_rate"]
            if vs["token_hit_rate"]
            else None,
            "ceiling_hit_rate": bound["token_hit_rate"] / vs["token_hit_rate"]
            if bound and vs["token_hit_rate"]
            else None,
            **time_ratios(vs, hs),  # of total time over the workload, not per step
            "peak_bytes": hs["peak_used_bytes"] / vs["peak_used_bytes"]
            if vs["peak_used_bytes"]
            else None,
        },
    }


def _print(result: dict[str, Any]) -> None:
    v, h, r = result["vllm"], result["hybridkv"], result["ratios"]
    gib = float(1 << 30)
    ret = v.get("retention_interval", "default")
    if ret == "default":
        ret = f"default ({v.get('prefix_cache_retention_interval')})"
    print(
        f"\n{result['model']} at {result['memory_bytes'] / gib:.1f} GiB; "
        f"vLLM prefix_cache_retention_interval: {ret}"
    )
    print(
        f"  {'':16} {'hit rate':>9} {'preempt':>8} {'steps':>7} {'peak GiB':>9} "
        f"{'mgr us/step':>12} {'hash us/step':>13}"
    )
    for label, s in (("vLLM 0.33", v), (f"hybridkv/{h['strategy']}", h)):
        print(
            f"  {label:16} {s['token_hit_rate']:9.1%} {s['preemptions']:8d} {s['steps']:7d} "
            f"{s['peak_used_bytes'] / gib:9.2f} {s['manager_us_per_step']:12.1f} "
            f"{s['hash_us_per_step']:13.1f}"
        )

    def x(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.2f}x"

    print(
        f"  hybridkv / vLLM: hit rate {x(r['hit_rate'])}; total time over the workload: "
        f"manager {x(r['manager_time'])}, manager + hashing {x(r['manager_time_with_hash'])}"
    )
    c = result.get("ceiling")
    if c is not None:
        cr = r["ceiling_hit_rate"]
        vs = "n/a" if cr is None else f"{cr:.2f}x vLLM's"
        print(
            f"  ceiling (state-free, same loop): hit rate {c['token_hit_rate']:.2%} ({vs}); "
            f"hybridkv reaches {h['token_hit_rate'] / c['token_hit_rate']:.0%} of it"
            if c["token_hit_rate"]
            else "  ceiling (state-free, same loop): hit rate 0"
        )
    if len(v["manager_us_per_step_runs"]) > 1:
        for label, s in (("vLLM", v), ("hybridkv", h)):
            runs = ", ".join(f"{t:.0f}" for t in s["manager_us_per_step_runs"])
            print(f"  {label} us/step per run (alternating; median above): {runs}")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="gpt-oss-20b,Qwen3-Next-80B-A3B")
    p.add_argument("--trace", default=str(DEFAULT_TRACE))
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--memory", default="16GiB")
    p.add_argument("--max-model-len", type=int, default=131072)
    p.add_argument("--token-budget", type=int, default=8192)
    p.add_argument("--ms-per-step", type=float, default=50.0)
    p.add_argument("--strategy", default="arena")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--state-block-size", type=int, default=None)
    p.add_argument("--chunk-alignment", default=None, help="arena chunk alignment (e.g. 2MiB)")
    p.add_argument(
        "--state-split",
        type=int,
        default=None,
        help="cut each state group into this many groups of layers (default: the planner's "
        "choice, state_split='auto')",
    )
    p.add_argument(
        "--second-chance",
        type=int,
        default=DEFAULT_CHANCES,
        help="chances a cached block that served hits holds at most (0 off; hybridkv side)",
    )
    p.add_argument(
        "--window-chances",
        type=int,
        default=None,
        help="the same for sliding-window / local-chunk blocks (default: hybridkv's)",
    )
    p.add_argument(
        "--eviction",
        choices=("lru", "2q"),
        default="lru",
        help="hybridkv's order of its free-list pools (uniform, pools, the flat arena): lru, "
        "or 2q (blocks used once on probation; KVCacheManager's eviction)",
    )
    p.add_argument(
        "--dead-tails",
        choices=DEAD_TAILS,
        default="auto",
        help="hybridkv's freed attention blocks no hit can read: auto (the default: drop "
        "them, as there are no tiers here), drop, or keep (LRU); KVCacheManager's dead_tails",
    )
    p.add_argument(
        "--checkpoint-life",
        choices=CHECKPOINT_LIFE,
        default="auto",
        help="how long hybridkv keeps a state checkpoint: kv (as long as the KV it ends), "
        "alone (it ages from when it was saved) or auto (the default: kv, as there are no "
        "tiers here); KVCacheManager's checkpoint_life",
    )
    p.add_argument(
        "--no-compaction",
        action="store_true",
        help="preempt without first compacting the arena (KVCacheManager.compact; hybridkv side)",
    )
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="runs of each side per model, alternating; manager time is the median run's",
    )
    p.add_argument(
        "--vllm-retention-interval",
        default="default",
        metavar="{default,none,N}",
        help="vLLM's CacheConfig.prefix_cache_retention_interval: default (vLLM's own, 0: "
        "sliding-window blocks and Mamba states kept only at the prompt's end and "
        "shared-prefix junctions), none (kept at every block) or N tokens (a positive "
        "multiple of vLLM's scheduler block size, for models with sliding-window or Mamba "
        "layers).  The time ratios printed are of total time over the workload",
    )
    p.add_argument(
        "--ceiling",
        action="store_true",
        help="for models with recurrent state, also run hybridkv once with the state layers "
        "storing nothing: the hit rate no state policy can beat at this memory",
    )
    p.add_argument("--out", default="results/compare_vllm.json")
    args = p.parse_args(argv)
    if args.repeat < 1:
        print(f"compare_vllm: --repeat must be at least 1, got {args.repeat}", file=sys.stderr)
        return 2
    try:
        retention = parse_retention_interval(args.vllm_retention_interval)
    except ValueError as exc:
        print(f"compare_vllm: {exc}", file=sys.stderr)
        return 2
    from hybridkv.errors import HybridKVError
    from hybridkv.units import parse_bytes

    try:
        memory = parse_bytes(args.memory, field="--memory")
        for name in args.models.split(","):
            resolve_model(name)
    except HybridKVError as exc:
        p.error(str(exc))
    trace = Path(args.trace)
    if not trace.is_file() and args.trace != str(DEFAULT_TRACE):  # a path the user gave
        p.error(f"--trace: {trace} is not a file")
    out = out_path(p, args.out)
    if not vd.vllm_available():
        print("compare_vllm: vLLM is not importable here; see docs/vllm.md (skipped)")
        return 0
    if isinstance(retention, int):  # vLLM's rule per model, before any run
        for name in args.models.split(","):
            try:
                vd.check_retention_interval(
                    vllm_groups(resolve_model(name), args.block_size),
                    retention,
                    memory_bytes=memory,
                    max_model_len=args.max_model_len,
                    token_budget=args.token_budget,
                )
            except ValueError as exc:
                print(f"compare_vllm: --vllm-retention-interval: {name}: {exc}", file=sys.stderr)
                return 2
    if not trace.is_file():
        print(f"compare_vllm: trace {trace} not found (skipped)")
        return 0
    try:
        workload = load_mooncake_trace(
            trace, limit=args.requests, max_prompt_tokens=args.max_model_len - 1
        )
    except WorkloadError as exc:
        print(f"compare_vllm: {exc}", file=sys.stderr)
        return 2
    requests = step_requests(workload, ms_per_step=args.ms_per_step)
    print(
        f"{len(requests)} requests from {trace.name} ({workload.skipped} skipped: prompt "
        f"longer than max_model_len - 1); hybridkv build: {'compiled' if compiled() else 'pure'}"
    )
    results = []
    for name in args.models.split(","):
        t0 = time.perf_counter()
        res = compare(
            name,
            requests,
            memory_bytes=memory,
            max_model_len=args.max_model_len,
            token_budget=args.token_budget,
            strategy=args.strategy,
            block_size=args.block_size,
            state_block_size=args.state_block_size,
            chunk_alignment=(
                None
                if args.chunk_alignment is None
                else parse_bytes(args.chunk_alignment, field="--chunk-alignment")
            ),
            second_chance=args.second_chance,
            window_chances=args.window_chances,
            state_split=args.state_split,
            compaction=not args.no_compaction,
            repeat=args.repeat,
            eviction=args.eviction,
            dead_tails=args.dead_tails,
            ceiling=args.ceiling,
            checkpoint_life=args.checkpoint_life,
            vllm_retention_interval=retention,
        )
        res["wall_s"] = time.perf_counter() - t0
        _print(res)
        results.append(res)
    payload = {
        "args": vars(args),
        "compiled": compiled(),
        "gc": "collect + freeze before each side's run, unfreeze after",
        "time_ratios": "total time over the workload, hybridkv / vLLM",
        "results": results,
    }
    out.write_text(json.dumps(payload, indent=1))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
