"""Head to head: hybridkv's KVCacheManager vs vLLM 0.33's own KVCacheManager.

Both managers are driven by the same scheduler loop (``vllm_driver.run_minimal_scheduler``:
running requests first, FCFS admission with a prefix lookup, chunked prefill under a token
budget, preemption by recompute, and for recurrent-state models vLLM's "align" mode chunk
splits at block boundaries and at the shared-prefix junction) over the same requests, at the
same memory bytes.  Printed per model and system: token hit rate, preemptions, peak memory,
manager microseconds per step (get_computed_blocks + allocate_slots + free + end-of-step
bookkeeping; request hashing reported apart), and the ratios hybridkv / vLLM.

vLLM is optional: see docs/vllm.md for the CPU install recipe.  Without it the script prints
one line and exits 0.  Run it with the interpreter that has vLLM, e.g.

    /tmp/vllmenv/bin/python benchmarks/compare_vllm.py --requests 2000

hybridkv is imported from this checkout's ``src/`` (no install needed in vLLM's venv).
"""

from __future__ import annotations

import argparse
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


def _summary(metrics: dict[str, Any], timings: dict[str, list[int]]) -> dict[str, Any]:
    steps = max(1, metrics["steps"])
    manager_ns = sum(sum(timings.get(op, ())) for op in MANAGER_OPS)
    return {
        "token_hit_rate": metrics["token_hit_rate"],
        "preemptions": metrics["preemptions"],
        "peak_used_bytes": metrics["peak_used_bytes"],
        "finished": metrics["finished"],
        "rejected": metrics["rejected"],
        "steps": metrics["steps"],
        "manager_us_per_step": manager_ns / 1e3 / steps,
        "hash_us_per_step": sum(timings.get("hash", ())) / 1e3 / steps,
        "calls": vd.op_stats(timings),
        "wall_s": metrics["wall_s"],
    }


#: Summary keys every repeated run of one side must reproduce exactly (the decisions).
DECISIONS = ("token_hit_rate", "preemptions", "peak_used_bytes", "finished", "rejected", "steps")


def merge_runs(
    runs: Sequence[dict[str, Any]], side: str, decisions: Sequence[str] = DECISIONS
) -> dict[str, Any]:
    """One side's repeated runs as one summary: the ``decisions`` (default :data:`DECISIONS`)
    must be identical in every run (the loop is deterministic; a difference is a bug,
    raised); the times are the median run's, with every run's manager time in
    ``manager_us_per_step_runs``."""
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
        "manager_us_per_step": mid["manager_us_per_step"],
        "hash_us_per_step": mid["hash_us_per_step"],
        "calls": mid["calls"],
        "wall_s": sum(r["wall_s"] for r in runs),
        "manager_us_per_step_runs": times,
    }


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
) -> dict[str, Any]:
    """One model's head to head; ``repeat`` runs of each side, alternating, report the
    median manager time (decisions must repeat exactly).  ``ceiling``: also run the
    hybridkv side once on the model without its state (:func:`without_state`)."""
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
        h = vd.run_minimal_scheduler(ours, requests, token_budget, max_model_len=max_model_len)
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
        )
        vllm_adapter = vd.VllmManagerAdapter(setup)
        v = vd.run_minimal_scheduler(
            vllm_adapter, requests, token_budget, max_model_len=max_model_len
        )
        vruns.append(_summary(v, vllm_adapter.timings))
        h, ours = run_ours(plan.layout)
        hruns.append({**_summary(h, ours.timings), "moved_blocks": ours.moved_blocks})
    vs = merge_runs(vruns, "vLLM")
    hs = merge_runs(hruns, "hybridkv", (*DECISIONS, "moved_blocks"))
    stateless = without_state(model) if ceiling else None
    bound: dict[str, Any] | None = None
    if stateless is not None:
        h, ours = run_ours(plan_for(stateless).layout)
        b = _summary(h, ours.timings)
        bound = {k: b[k] for k in ("token_hit_rate", "preemptions", "steps")}
    return {
        "model": name,
        "memory_bytes": memory_bytes,
        "vllm": {**vs, "groups": setup.groups, "scheduler_block_size": setup.scheduler_block_size},
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
            "manager_time": hs["manager_us_per_step"] / vs["manager_us_per_step"]
            if vs["manager_us_per_step"]
            else None,
            "peak_bytes": hs["peak_used_bytes"] / vs["peak_used_bytes"]
            if vs["peak_used_bytes"]
            else None,
        },
    }


def _print(result: dict[str, Any]) -> None:
    v, h, r = result["vllm"], result["hybridkv"], result["ratios"]
    gib = float(1 << 30)
    print(f"\n{result['model']} at {result['memory_bytes'] / gib:.1f} GiB")
    print(
        f"  {'':16} {'hit rate':>9} {'preempt':>8} {'steps':>7} {'peak GiB':>9} {'mgr us/step':>12}"
    )
    for label, s in (("vLLM 0.33", v), (f"hybridkv/{h['strategy']}", h)):
        print(
            f"  {label:16} {s['token_hit_rate']:9.1%} {s['preemptions']:8d} {s['steps']:7d} "
            f"{s['peak_used_bytes'] / gib:9.2f} {s['manager_us_per_step']:12.1f}"
        )
    hr = "n/a" if r["hit_rate"] is None else f"{r['hit_rate']:.2f}x"
    mt = "n/a" if r["manager_time"] is None else f"{r['manager_time']:.2f}x"
    print(f"  hybridkv / vLLM: hit rate {hr}, manager time {mt}")
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
        )
        res["wall_s"] = time.perf_counter() - t0
        _print(res)
        results.append(res)
    payload = {"args": vars(args), "compiled": compiled(), "results": results}
    out.write_text(json.dumps(payload, indent=1))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
