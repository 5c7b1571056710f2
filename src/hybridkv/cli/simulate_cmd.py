"""``hybridkv simulate``: replay a workload through the scheduler and cache manager.

With no options it runs the demo: the default model (a gated-DeltaNet + full-attention hybrid)
serving the seeded agent workload in a KV budget small enough that the memory layouts
differ, once per strategy, and says what the difference means.

Every input is checked before the first strategy runs (model, sizes, trace, report
directory); a strategy whose plan cannot hold one request is shown as ``n/a`` with its reason
while the others run.  Requests the simulator cannot admit (a prompt of ``--max-model-len``
tokens or more) are counted in the table, warned about, and count as misses in the hit rate.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from hybridkv.cache.pool_base import MAX_CHANCES
from hybridkv.cache.tier_sessions import DEFAULT_PROTECT_SHARE
from hybridkv.cli.common import (
    MAX_REQUESTS,
    MAX_SEED,
    CliInputError,
    check_at_most,
    check_compaction,
    check_needs,
    check_positive,
    check_state_options,
    check_state_split,
    check_window_options,
    chunk_alignment_arg,
    is_zero_size,
    max_model_len_for,
    model_name,
    with_flag_names,
)
from hybridkv.cli.simulate_args import (
    DEFAULT_TRACE,
    DEFAULT_WINDOW_RETENTION,
    add_arguments,
)
from hybridkv.cli.simulate_disagg import run_disaggregated
from hybridkv.models.catalog import DEFAULT_MODEL

if TYPE_CHECKING:
    from hybridkv.sim import SimResult
    from hybridkv.sim.report import StrategyFailure

__all__ = ["DEFAULT_TRACE", "add_arguments", "run"]


def _check_report_dir(path: str) -> Path:
    """Create the report directory now, so a bad path fails before the simulation runs."""
    if not path.strip():
        raise CliInputError("--report: give a directory to write the report to, got ''")
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise CliInputError(f"--report: {path!r} exists and is not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CliInputError(f"--report: cannot create directory {path!r}: {exc.strerror}") from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise CliInputError(f"--report: directory {path!r} is not writable")
    return out


def _warnings(results: list[SimResult]) -> list[str]:
    """One warning per distinct set of rejected requests, and one per distinct count of
    outputs cut at ``max_model_len`` (usually the same for every run)."""
    seen: dict[tuple[str, ...], list[str]] = {}
    for r in results:
        if r.rejected:
            seen.setdefault(tuple(x.request_id for x in r.rejected), []).append(r.strategy)
    lines = []
    for ids, strategies in seen.items():
        r = next(r for r in results if r.strategy == strategies[0])
        longest = max(x.prompt_len for x in r.rejected)
        who = "" if len(strategies) == len(results) else f" ({', '.join(strategies)})"
        lines.append(
            f"warning{who}: {len(ids)} of {r.num_requests} requests rejected: prompt of "
            f"max_model_len {r.plan.max_model_len} tokens or more (longest {longest}); they "
            "count as misses in the hit rate; raise --max-model-len to admit them"
        )
    cut: dict[int, list[str]] = {}
    for r in results:
        if r.truncated:
            cut.setdefault(r.truncated, []).append(r.strategy)
    for n, strategies in cut.items():
        r = next(r for r in results if r.strategy == strategies[0])
        who = "" if len(strategies) == len(results) else f" ({', '.join(strategies)})"
        lines.append(
            f"warning{who}: {n} of {r.num_requests} requests had their outputs cut at "
            f"max_model_len {r.plan.max_model_len} tokens (prompt plus output); they finish "
            "early and count as finished; raise --max-model-len to run them in full"
        )
    return lines


def run(args: argparse.Namespace) -> int:
    from hybridkv.cache.pools import check_eviction
    from hybridkv.cache.tiers import TierStack
    from hybridkv.cli.plan_cmd import parse_ratios
    from hybridkv.cli.progress import Progress
    from hybridkv.errors import BudgetTooSmallError, PlanError, PoolRatiosError
    from hybridkv.models import resolve_model
    from hybridkv.plan import Strategy
    from hybridkv.scheduler import SchedulerError
    from hybridkv.sim import (
        ModelProfile,
        SimConfig,
        SimulationError,
        load_model_config,
        plan_for,
        simulate,
    )
    from hybridkv.sim.report import (
        StrategyFailure,
        format_summary_table,
        interpretation,
        tier_lines,
        write_report,
    )
    from hybridkv.units import format_bytes, format_bytes_exact, parse_bytes
    from hybridkv.workloads import load_workload

    if args.strategy is None:  # --disaggregate simulates one layout: the default one
        args.strategy = "arena" if args.disaggregate else "all"
    check_positive(
        args,
        (
            "requests",
            "max_model_len",
            "block_size",
            "kernel_block_size",
            "state_block_size",
            "state_split",
            "token_budget",
            "max_num_seqs",
            "tp",
        ),
    )
    check_at_most(args, [("requests", MAX_REQUESTS, "requests one run generates or reads")])
    if not 0 <= args.seed <= MAX_SEED:
        raise CliInputError(f"--seed: must be an integer in [0, {MAX_SEED}], got {args.seed}")
    for flag, value in (
        ("--second-chance", args.second_chance),
        ("--window-chances", args.window_chances),
    ):
        if value is not None and not 0 <= value <= MAX_CHANCES:
            raise CliInputError(f"{flag}: must be an integer in [0, {MAX_CHANCES}], got {value}")
    if args.seed != 0 and not str(args.trace).startswith("synthetic:"):
        raise CliInputError(
            f"--seed {args.seed}: only applies to a synthetic workload (--trace synthetic:NAME); "
            f"the requests of --trace {args.trace} are fixed"
        )
    # A tier in some run: --host-memory 0 alone means none.
    hosted = any(p != "0" for p in _sizes(args.host_memory))
    tiered = args.disk_memory is not None or hosted
    check_needs(
        args,
        [
            ("prefill_memory", "--disaggregate", args.disaggregate),
            ("link_bandwidth", "--disaggregate", args.disaggregate),
            # it picks what skips the host tier: a disk tier alone takes everything
            ("tier_admission", "--host-memory SIZE (not 0)", hosted),
            ("protect", "--host-memory SIZE (not 0) or --disk-memory", tiered),
            ("protect_share", "--protect oracle", args.protect == "oracle"),
        ],
    )
    through = args.write_through
    if through is not None:
        size = args.host_memory if through == "host" else args.disk_memory
        if size is None or "0" in _sizes(size):
            flag = "--host-memory" if through == "host" else "--disk-memory"
            zero = ", not 0" if through == "host" else ""  # --disk-memory takes no 0 anyway
            raise CliInputError(
                f"--write-through {through}: needs a {through} tier in every run ({flag} SIZE"
                f"{zero}); got {'none' if size is None else f'{flag} {size}'}"
            )
        if args.disaggregate:
            raise CliInputError(f"--write-through {through}: not with --disaggregate")
    share = args.protect_share
    if share is not None and not 0 < share <= 1:
        raise CliInputError(
            f"--protect-share {repr(share).removesuffix('.0')}: the share of a tier protected "
            "sessions may fill must be "
            "a number in (0, 1]"
        )
    if args.protect is not None and args.disaggregate:
        raise CliInputError(f"--protect {args.protect}: not with --disaggregate")
    if args.report is not None and args.disaggregate:
        raise CliInputError(
            f"--report {args.report}: not with --disaggregate (it prints one summary)"
        )
    memory = parse_bytes(args.memory, field="--memory")
    hosts: list[int | None] = [None]
    if args.host_memory is not None:
        hosts = [
            None if part == "0" else parse_bytes(part, field="--host-memory")
            for part in _sizes(args.host_memory)
        ]
        if len(set(hosts)) < len(hosts):
            raise CliInputError(
                f"--host-memory {args.host_memory}: a sweep runs each size once; a size is repeated"
            )
    disk = (
        None if args.disk_memory is None else parse_bytes(args.disk_memory, field="--disk-memory")
    )
    alignment = chunk_alignment_arg(args, memory)
    check_state_split(args)
    ratios = parse_ratios(args.pool_ratios)
    name = model_name(args, DEFAULT_MODEL)
    model = resolve_model(name, tp_size=args.tp, kv_cache_dtype=args.kv_cache_dtype, mtp=args.mtp)
    profile = ModelProfile.from_config(load_model_config(name))
    check_state_options(
        args,
        model,
        [
            "state_split",
            "state_block_size",
            "checkpoint_admission",
            "checkpoint_when_full",
            "checkpoint_life",
        ],
    )
    check_window_options(
        args,
        model,
        ["window_retention", "window_chances"],
        {"window_retention": DEFAULT_WINDOW_RETENTION},
    )
    check_compaction(args)
    max_len = max_model_len_for(model, args.max_model_len, "simulate", warn=not args.quiet)
    workload = load_workload(args.trace, num_requests=args.requests, seed=args.seed)
    if args.requests is not None and len(workload.requests) < args.requests and not args.quiet:
        print(
            f"note: --requests {args.requests}: the trace holds {len(workload.requests)}; "
            "simulating all of them",
            file=sys.stderr,
        )
    strategies = list(Strategy) if args.strategy == "all" else [Strategy(args.strategy)]
    if ratios is not None and Strategy.POOLS not in strategies:
        raise CliInputError(
            f"--pool-ratios {args.pool_ratios}: only the pools strategy takes ratios "
            f"(--strategy pools or all), not --strategy {args.strategy}"
        )
    if len(hosts) > 1 and len(strategies) > 1:
        raise CliInputError(
            f"--host-memory {args.host_memory}: a sweep of host sizes runs one strategy; "
            "add --strategy arena (or uniform, pools)"
        )
    sweep = len(hosts) > 1
    configs = [
        SimConfig(
            memory_bytes=memory,
            max_model_len=max_len,
            strategy=strategy,
            block_size=args.block_size,
            kernel_block_size=args.kernel_block_size,
            state_block_size=args.state_block_size,
            pool_ratios=ratios if strategy is Strategy.POOLS else None,
            chunk_alignment=alignment,
            state_split=args.state_split,
            token_budget=args.token_budget,
            max_num_seqs=args.max_num_seqs,
            accelerator=args.accelerator,
            use_arrivals=not args.no_arrivals,
            window_retention=args.window_retention,
            publish=args.publish,
            checkpoint_admission=args.checkpoint_admission or "yield",
            admission=args.admission,
            compaction=args.compaction == "on",
            checkpoint_when_full=args.checkpoint_when_full,
            tier_admission=args.tier_admission or "yield",
            second_chance=args.second_chance,
            eviction=args.eviction,
            dead_tails=args.dead_tails,
            checkpoint_life=args.checkpoint_life or "auto",
            window_chances=args.window_chances,
            host_memory_bytes=host,
            disk_memory_bytes=disk,
            write_through=through,
            protect=args.protect or "none",
            protect_share=(
                DEFAULT_PROTECT_SHARE if args.protect_share is None else args.protect_share
            ),
            label=f"{strategy} host {format_bytes(host) if host else 'none'}" if sweep else None,
        )
        for strategy in strategies
        for host in hosts
    ]
    if args.disaggregate:
        if any(c.host_memory_bytes or c.disk_memory_bytes for c in configs):
            raise CliInputError("--disaggregate: not with --host-memory / --disk-memory")
        if len(configs) != 1:
            raise CliInputError(
                "--disaggregate: one strategy at a time, not --strategy all (leave it out for "
                "arena)"
            )
        return run_disaggregated(args, model, profile, workload, configs[0], title_of=name)
    # Plans are cheap: make them all before simulating, so a plan that cannot exist is
    # reported at once (exit 2 for one strategy, n/a among several).
    # A host-size sweep plans the same device layout at every size: one strategy's plan
    # error is the command's error, said once.
    failures: list[StrategyFailure] = []
    least: dict[str, int] = {}  # strategy -> a budget holding one request, where too small
    runnable = []
    for config in configs:
        try:
            plan = plan_for(model, config)
            check_eviction(plan.layout, config.eviction)
        except PlanError as exc:
            if len(strategies) == 1 or isinstance(exc, PoolRatiosError):
                raise  # one strategy, or the user's --pool-ratios: the command's error
            failures.append(StrategyFailure(str(config.strategy), with_flag_names(str(exc))))
            if isinstance(exc, BudgetTooSmallError) and exc.least_bytes:
                least[str(config.strategy)] = exc.least_bytes
        else:
            if config.tiers():  # a tier too small for any block: refused here, not mid-run
                TierStack(config.tiers(), [g.block_bytes for g in plan.layout.groups])
            runnable.append(config)
    if not runnable:
        if len(least) == len(failures):  # every strategy: the budget is too small, said once
            needs = ", ".join(f"{s} {format_bytes_exact(b)}" for s, b in least.items())
            raise SimulationError(
                f"--memory {format_bytes(memory)}: no strategy holds a request of "
                f"--max-model-len {configs[0].max_model_len} in it; one request needs {needs}; "
                "give at least that much --memory or a shorter --max-model-len"
            )
        reasons = "; ".join(f"{f.strategy}: {f.reason}" for f in failures)
        raise SimulationError(f"no strategy can plan this model in this budget: {reasons}")
    report_dir = None if args.report is None else _check_report_dir(args.report)
    title = (
        f"{model.name} | {workload.summary()} | KV budget {format_bytes(memory)} | "
        f"max_model_len {max_len} | {args.accelerator.upper()} cost model"
    )
    if not args.quiet:
        what = (
            f"{strategies[0]} at {len(runnable)} host sizes"
            if sweep
            else f"{len(runnable)} {'strategy' if len(runnable) == 1 else 'strategies'}"
        )
        print(f"simulating {what}: {title}", file=sys.stderr)
    results: list[SimResult] = []
    for config in runnable:
        bar = Progress(config.label or str(config.strategy), enabled=not args.quiet)
        try:
            results.append(simulate(model, profile, workload, config, progress=bar))
        except (SimulationError, SchedulerError) as exc:
            if len(strategies) == 1:
                raise
            failures.append(StrategyFailure(str(config.strategy), with_flag_names(str(exc))))
        finally:
            bar.close()
    if not results:
        reasons = "; ".join(f"{f.strategy}: {f.reason}" for f in failures)
        raise SimulationError(f"no strategy can run this simulation: {reasons}")
    if not args.quiet:
        for line in _warnings(results):
            print(line, file=sys.stderr)
    if args.json:
        data = [r.summary() for r in results]
        data += [{"strategy": f.strategy, "error": f.reason} for f in failures]
        print(json.dumps(data, indent=1))
    else:
        print(title)
        print(format_summary_table(results, failures))
        for r in results:
            for line in tier_lines(r, args.write_through, args.protect == "oracle"):
                print(line)
        for f in failures:
            print(f"{f.strategy}: n/a: {f.reason}")
        print(interpretation(results, failures))
    if report_dir is not None:
        out = write_report(
            results,
            report_dir,
            title=title,
            failures=failures,
            through=args.write_through,
            oracle=args.protect == "oracle",
        )
        if not args.quiet:
            print(f"report written to {out / 'index.html'}", file=sys.stderr)
    return 0


def _sizes(text: str | None) -> list[str]:
    """The comma-separated sizes of a sweep option (``--host-memory 0,64GiB``), stripped,
    a zero in any unit (``0GiB``, ``0.0 TB``) as ``0``; none when it was not given."""
    if text is None:
        return []
    parts = [part.strip() for part in str(text).split(",")]
    return ["0" if is_zero_size(part) else part for part in parts]
