"""Drive vLLM 0.33's own ``KVCacheManager`` on CPU: the reference hybridkv is compared against.

Run it with the separate vLLM virtualenv described in ``docs/vllm.md`` (never hybridkv's venv)::

    /tmp/vllmenv/bin/python benchmarks/vllm_driver.py --out results/vllm_driver.json
    /tmp/vllmenv/bin/python benchmarks/vllm_driver.py --workload branching --cross-check
    /tmp/vllmenv/bin/python benchmarks/vllm_driver.py --trace PATH --requests 300

Per configuration (full+swa, full+mamba, full+swa+mamba at equal memory) it prints the token
hit rate, preemptions, peak blocks/bytes and per-call manager times, and writes everything to
JSON.  ``--cross-check`` replays the same workload through vLLM's real ``Scheduler`` and
reports whether hits, steps and preemptions are identical to :func:`run_minimal_scheduler`.

Importing this module never imports vLLM; :func:`build_vllm_manager` does and raises
:class:`VllmUnavailable` when it cannot, so other benchmark scripts can skip cleanly.  The
workloads come from :mod:`hybridkv.workloads` (standard library only, imported from this
checkout's ``src/``: vLLM's interpreter needs no hybridkv install), and
:func:`run_minimal_scheduler` is plain Python: a hybridkv adapter with the
:class:`ManagerAdapter` methods is driven by the very same loop.

This module is the command line and the benchmark configurations; it re-exports the names
other scripts use as ``vllm_driver.X`` from :mod:`vllm_setup` (building the manager),
:mod:`vllm_adapter` (the adapter and the real-``Scheduler`` cross-check) and
:mod:`vllm_sched` (the minimal scheduler loop).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, os.environ.get("HYBRIDKV_SRC", str(Path(__file__).resolve().parents[1] / "src")))

from hybridkv.workloads import (
    BranchingConfig,
    ConversationConfig,
    StepRequest,
    WorkloadError,
    arrival_order,
    branching_workload,
    conversation_workload,
    ideal_hit_tokens,
    load_mooncake_trace,
    step_requests,
)

# Re-exported: other benchmark scripts use these as ``vllm_driver.X``.
from bench_cli import out_path
from vllm_adapter import VllmManagerAdapter, run_real_scheduler
from vllm_sched import (
    OPS,
    ManagerAdapter,
    SimRequest,
    op_stats,
    run_minimal_scheduler,
)
from vllm_setup import (
    DEFAULT_RETENTION,
    GroupDesc,
    VllmSetup,
    VllmUnavailable,
    _import_vllm,
    build_vllm_manager,
    check_retention_interval,
    vllm_available,
)

__all__ = [
    "DEFAULT_RETENTION",
    "OPS",
    "GroupDesc",
    "ManagerAdapter",
    "SimRequest",
    "VllmManagerAdapter",
    "VllmSetup",
    "VllmUnavailable",
    "build_vllm_manager",
    "check_retention_interval",
    "op_stats",
    "run_minimal_scheduler",
    "run_real_scheduler",
    "vllm_available",
]


# ------------------------------------------------------------------------------------ main
ATTN = {"num_kv_heads": 8, "head_dim": 128, "dtype_bytes": 2}  # 4 KiB per token per layer
MAMBA_STATES = {  # per layer: (state shapes, dtype bytes)
    "small": (((3, 1024), (8, 64, 16)), (2, 4)),  # 38,912 B: fits a 16-token attention page
    "realistic": (((3, 10240), (128, 64, 128)), (2, 4)),  # Mamba2 of a ~8B hybrid: 4.26 MB
}


def config_groups(name: str, block_size: int, mamba_state: str, layers: int = 4) -> list[GroupDesc]:
    """The benchmark model of one configuration ("full+swa", ...): ``layers`` layers per kind,
    so vLLM makes exactly one KV cache group per kind."""
    shapes, nbytes = MAMBA_STATES[mamba_state]
    common = {"num_layers": layers, "block_size": block_size}
    kinds = {
        "full": GroupDesc(kind="full", **common, **ATTN),
        "swa": GroupDesc(kind="sliding", window=128, **common, **ATTN),
        "mamba": GroupDesc(kind="mamba", mamba_shapes=shapes, mamba_dtype_bytes=nbytes, **common),
    }
    return [kinds[k] for k in name.split("+")]


def _run_config(name: str, args: argparse.Namespace, workload: list[StepRequest]) -> dict:
    """Run one configuration ``args.repeats`` times on fresh managers: metrics of the first
    run, timings as the median over runs of each statistic plus the best (lowest) mean, since
    the machine is shared and other processes inflate single runs."""
    runs, stats = [], []
    for rep in range(args.repeats):
        setup = build_vllm_manager(
            config_groups(name, args.block_size, args.mamba_state),
            memory_bytes=args.memory_bytes,
            num_blocks=None if args.memory_bytes else args.num_blocks,
            max_model_len=args.max_model_len,
            token_budget=args.token_budget,
            max_num_seqs=args.max_num_seqs,
            hash_algo=args.hash_algo,
            prefix_match_unit=args.prefix_match_unit,
        )
        adapter = VllmManagerAdapter(setup, junction_split=not args.no_junction_split)
        tag = f"[{name} #{rep}]"
        gc.collect()
        if not args.keep_gc:  # as benchmarks/bench_manager.py: no collector pauses in timings
            gc.disable()
        try:
            runs.append(
                run_minimal_scheduler(
                    adapter,
                    workload,
                    args.token_budget,
                    max_num_seqs=args.max_num_seqs,
                    max_model_len=args.max_model_len,
                    progress=lambda p, tag=tag: print(" ", tag, p, file=sys.stderr, flush=True),
                    progress_every=args.progress_every,
                )
            )
        finally:
            gc.enable()
        stats.append(op_stats(adapter.timings, adapter.cpu_ns))
    m = runs[0]
    grain = setup.hash_block_size if setup.partial_hash_hits else setup.scheduler_block_size
    if any((r["hit_tokens"], r["steps"]) != (m["hit_tokens"], m["steps"]) for r in runs):
        raise RuntimeError(f"{name}: repeated runs disagree, the driver is not deterministic")
    m["ops"] = {
        op: {k: statistics.median(s[op][k] for s in stats) for k in stats[0][op]}
        | {"best_mean_us": min(s[op]["mean_us"] for s in stats)}
        for op in OPS
    }
    m["wall_s"] = statistics.median(r["wall_s"] for r in runs)
    m.update(
        groups=setup.groups,
        scheduler_block_size=setup.scheduler_block_size,
        hash_block_size=setup.hash_block_size,
        bytes_per_block=setup.bytes_per_block,
        num_blocks=setup.num_blocks,
        partial_hash_hits=setup.partial_hash_hits,
        ideal_hit_rate=ideal_hit_tokens(arrival_order(workload), grain)
        / max(1, sum(len(r.prompt_token_ids) for r in workload)),
    )
    if args.cross_check:
        real = run_real_scheduler(setup, workload, max_model_len=args.max_model_len)
        keys = ("hit_tokens", "steps", "preemptions")
        m["real_scheduler"] = real | {"match": all(real[k] == m[k] for k in keys)}
    return m


def _summary_line(name: str, m: Mapping[str, Any]) -> str:
    op = m["ops"]
    us = {
        k: "{mean_us:.1f} (best {best_mean_us:.1f}, cpu {cpu_mean_us:.1f})".format(**op[k])
        for k in OPS
    }
    real = m.get("real_scheduler")
    return (
        f"{name:15s} hit {m['token_hit_rate']:6.1%} (ideal {m['ideal_hit_rate']:5.1%}) "
        f"preempt {m['preemptions']:3d} steps {m['steps']:5d} peak {m['peak_used_blocks']:5d} "
        f"blk {m['peak_used_bytes'] / 2**30:5.2f} GiB | block {m['scheduler_block_size']}/"
        f"{m['hash_block_size']} | us/call: allocate_slots {us['allocate_slots']} "
        f"p99 {op['allocate_slots']['p99_us']:.1f}, get_computed_blocks "
        f"{us['get_computed_blocks']}, free {us['free']} | wall {m['wall_s']:.1f} s"
        + (
            f" | real Scheduler: hit {real['token_hit_rate']:.1%} match={real['match']}"
            if real
            else ""
        )
    )


def _make_workload(args: argparse.Namespace) -> tuple[list[StepRequest], dict[str, Any]]:
    """The requests ``args`` ask for, from :mod:`hybridkv.workloads`: the Mooncake trace
    (``--trace``: prompts up to ``max_model_len - 1`` tokens, ``--requests`` of them) or a
    synthetic multi-turn mix (``--workload``)."""
    if args.trace is not None:
        trace = load_mooncake_trace(
            args.trace, limit=args.requests, max_prompt_tokens=args.max_model_len - 1
        )
        desc = {"trace": str(args.trace), "ms_per_step": args.ms_per_step, "skipped": trace.skipped}
        return step_requests(trace, ms_per_step=args.ms_per_step), desc
    if args.workload == "conversations":
        conv = ConversationConfig(
            num_requests=args.requests,
            seed=args.seed,
            followup_prob=args.followup_prob,
            arrival_gap_steps=4.0 if args.arrival_gap is None else args.arrival_gap,
        )
        return conversation_workload(conv), {"conversations": asdict(conv)}
    branch = BranchingConfig(
        num_requests=args.requests,
        seed=args.seed,
        followup_prob=args.followup_prob,
        arrival_gap_steps=1.0 if args.arrival_gap is None else args.arrival_gap,
    )
    return branching_workload(branch), {"branching": asdict(branch)}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    arg = ap.add_argument
    arg("--out", type=Path, default=Path("results/vllm_driver.json"))
    arg("--configs", default="full+swa,full+mamba,full+swa+mamba")
    arg("--seed", type=int, default=0)
    arg("--requests", type=int, default=200)
    arg("--num-blocks", type=int, default=6000, help="pool size, null block included")
    arg("--memory-bytes", type=int, default=None, help="size the pool in bytes instead")
    arg("--block-size", type=int, default=16)
    arg("--token-budget", type=int, default=8192)
    arg("--max-num-seqs", type=int, default=256)
    arg("--max-model-len", type=int, default=16_384)
    arg("--hash-algo", default="sha256", choices=["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"])
    arg("--mamba-state", default="small", choices=sorted(MAMBA_STATES))
    arg("--prefix-match-unit", type=int, default=None, help="vLLM's finer hash block (tokens)")
    arg(
        "--workload",
        default="conversations",
        choices=["conversations", "branching"],
        help="synthetic mix from hybridkv.workloads.multiturn (conversations: as bench_manager)",
    )
    arg(
        "--arrival-gap",
        type=float,
        default=None,
        help="synthetic: mean steps between arrivals (default 4 conversations, 1 branching)",
    )
    arg("--followup-prob", type=float, default=0.3, help="synthetic: share of multi-turn re-sends")
    arg("--trace", type=Path, default=None, help="Mooncake trace instead of the synthetic load")
    arg("--ms-per-step", type=float, default=50.0, help="trace: timestamp ms per step")
    arg("--repeats", type=int, default=3, help="timing runs per configuration")
    arg("--no-junction-split", action="store_true", help="ablation: no Mamba junction splits")
    arg("--keep-gc", action="store_true", help="leave Python's cyclic GC on while timing")
    arg("--cross-check", action="store_true", help="also run vLLM's real Scheduler")
    arg("--progress-every", type=int, default=0, help="print progress every N steps")
    args = ap.parse_args(argv)
    args.out = out_path(ap, args.out)
    if not vllm_available():
        print("vLLM is not importable in this interpreter; see docs/vllm.md", file=sys.stderr)
        return 2
    try:
        workload, wl = _make_workload(args)
    except WorkloadError as exc:
        print(f"vllm_driver: {exc}", file=sys.stderr)
        return 2
    wl.update(
        requests=len(workload),
        prompt_tokens=sum(len(r.prompt_token_ids) for r in workload),
        followups=sum(r.parent_id is not None for r in workload),
    )
    print(
        f"workload: {wl['requests']} requests, {wl['prompt_tokens']} prompt tokens, "
        f"{wl['followups']} follow-ups; {args.hash_algo}, {args.repeats} repeats",
        flush=True,
    )
    results = {}
    for name in args.configs.split(","):
        m = results[name] = _run_config(name, args, workload)
        print(_summary_line(name, m), flush=True)
    doc = {
        "vllm_version": _import_vllm().version,
        "args": {k: str(a) for k, a in vars(args).items()},
        "workload": wl,
        "loadavg": os.getloadavg(),
        "results": results,
    }
    args.out.write_text(json.dumps(doc, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
