"""``hybridkv simulate``: replay a workload through the scheduler and cache manager."""

from __future__ import annotations

import argparse
import json
import sys

from hybridkv.errors import HybridKVError

DEFAULT_TRACE = "synthetic:chat"


class CliError(HybridKVError):
    """A bad command-line value."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default=None, help="catalog name or config path (default: gpt-oss-20b)"
    )
    parser.add_argument(
        "--trace",
        default=DEFAULT_TRACE,
        help="Mooncake-format trace file, or synthetic:chat|agent|docs|mixed "
        f"(default: {DEFAULT_TRACE})",
    )
    parser.add_argument("--memory", default="4GiB", help="KV-cache budget (default: 4GiB)")
    parser.add_argument(
        "--strategy",
        default="all",
        choices=["arena", "uniform", "pools", "all"],
        help="pool strategy, or all side by side (default: all)",
    )
    parser.add_argument("--requests", type=int, default=None, help="use the first N requests")
    parser.add_argument("--max-model-len", type=int, default=32768)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--state-block-size", type=int, default=None)
    parser.add_argument("--token-budget", type=int, default=8192, help="tokens per step")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--kv-dtype", default=None)
    parser.add_argument("--accelerator", default="h100", help="h100, h200 or a100")
    parser.add_argument(
        "--no-arrivals", action="store_true", help="ignore timestamps: all requests at once"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of synthetic workloads")
    parser.add_argument("--report", default=None, metavar="DIR", help="write JSON, PNG and HTML")
    parser.add_argument("--json", action="store_true", help="print the summaries as JSON")
    parser.add_argument("--quiet", action="store_true", help="no progress output")


def run(args: argparse.Namespace) -> int:
    from hybridkv.cli.progress import Progress
    from hybridkv.models import DEFAULT_MODEL, resolve_model
    from hybridkv.plan import Strategy
    from hybridkv.sim import ModelProfile, SimConfig, load_model_config, simulate
    from hybridkv.sim.report import format_summary_table, write_report
    from hybridkv.units import format_bytes, parse_bytes
    from hybridkv.workloads import load_workload

    model_name = args.model or DEFAULT_MODEL
    for name in ("requests", "max_model_len", "block_size", "token_budget", "max_num_seqs"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise CliError(f"--{name.replace('_', '-')}: must be positive, got {value}")
    memory = parse_bytes(args.memory, field="--memory")
    model = resolve_model(model_name, tp_size=args.tp, kv_cache_dtype=args.kv_dtype)
    profile = ModelProfile.from_config(load_model_config(model_name))
    workload = load_workload(args.trace, num_requests=args.requests, seed=args.seed)
    strategies = list(Strategy) if args.strategy == "all" else [Strategy(args.strategy)]
    if not args.quiet:
        print(
            f"simulating {model.name} on {workload.summary()}; budget {format_bytes(memory)}, "
            f"{args.accelerator}",
            file=sys.stderr,
        )
    results = []
    for strategy in strategies:
        config = SimConfig(
            memory_bytes=memory,
            max_model_len=args.max_model_len,
            strategy=strategy,
            block_size=args.block_size,
            state_block_size=args.state_block_size,
            token_budget=args.token_budget,
            max_num_seqs=args.max_num_seqs,
            accelerator=args.accelerator,
            use_arrivals=not args.no_arrivals,
        )
        bar = Progress(str(strategy), enabled=not args.quiet)
        try:
            results.append(simulate(model, profile, workload, config, progress=bar))
        finally:
            bar.close()
    if args.json:
        print(json.dumps([r.summary() for r in results], indent=1))
    else:
        print(f"{model.name} | {workload.summary()} | budget {format_bytes(memory)}")
        print(format_summary_table(results))
    if args.report:
        out = write_report(results, args.report, title=f"hybridkv simulate: {model.name}")
        print(f"report written to {out}/index.html", file=sys.stderr)
    return 0
