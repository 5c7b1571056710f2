"""``hybridkv simulate --disaggregate``: a prefill and a decode instance joined by a link
(:func:`hybridkv.sim.disagg.simulate_pd`), and its summary."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from hybridkv.cli.common import CliInputError
from hybridkv.cli.format import duration

__all__ = ["DEFAULT_LINK_BANDWIDTH", "run_disaggregated"]

#: ``--link-bandwidth`` when not given: a 400 Gb/s RDMA link.
DEFAULT_LINK_BANDWIDTH = "50GB"


def run_disaggregated(
    args: argparse.Namespace,
    model: Any,
    profile: Any,
    workload: Any,
    config: Any,
    *,
    title_of: str,
) -> int:
    """``--disaggregate``: :func:`hybridkv.sim.disagg.simulate_pd` with ``config`` for the
    decode instance and, with ``--prefill-memory``, another budget for the prefill one."""
    from dataclasses import replace

    from hybridkv.errors import PlanError
    from hybridkv.sim.disagg import simulate_pd
    from hybridkv.sim.simulator import plan_for
    from hybridkv.units import format_bytes, parse_bytes, parse_rate

    if config.host_memory_bytes or config.disk_memory_bytes:
        raise CliInputError("--disaggregate: not with --host-memory / --disk-memory")
    prefill = config
    if args.prefill_memory is not None:
        prefill = replace(
            config, memory_bytes=parse_bytes(args.prefill_memory, field="--prefill-memory")
        )
        try:  # the prefill budget is --prefill-memory's, not --memory's
            plan_for(model, prefill)
        except PlanError as exc:
            text = str(exc).removeprefix("memory_bytes: ")
            raise CliInputError(f"--prefill-memory: {text}") from None
    link = parse_rate(args.link_bandwidth or DEFAULT_LINK_BANDWIDTH, field="--link-bandwidth")
    result = simulate_pd(model, profile, workload, prefill, config, link_bandwidth=float(link))
    summary = result.summary()
    if result.rejected and not args.quiet:
        print(
            f"warning: {result.rejected} of {summary['requests']} requests rejected: prompt of "
            f"max_model_len {config.max_model_len} tokens or more (longest "
            f"{result.longest_rejected}); they count as misses in the hit rates; raise "
            "--max-model-len to admit them",
            file=sys.stderr,
        )
    if result.truncated and not args.quiet:
        print(
            f"warning: {result.truncated} of {summary['requests']} requests had their outputs "
            f"cut at max_model_len {config.max_model_len} tokens (prompt plus output); they "
            "finish early and count as finished; raise --max-model-len to run them in full",
            file=sys.stderr,
        )
    if args.json:
        print(json.dumps(summary, indent=1))
        return 0
    print(
        f"{title_of} | {workload.summary()} | prefill {format_bytes(prefill.memory_bytes)}, "
        f"decode {format_bytes(config.memory_bytes)}, link {format_bytes(link)}/s | "
        f"{config.strategy}"
    )
    print(
        f"requests {summary['requests']}, finished {summary['finished']}, rejected "
        f"{summary['rejected']}; prompt tokens hit: "
        f"prefill {summary['prefill_hit_rate']:.1%}, decode {summary['decode_hit_rate']:.1%} "
        "(the decode side pulls only what it lacks)"
    )
    print(
        f"moved {format_bytes(summary['transferred_bytes'])} over the link, "
        f"{_time(summary['transfer_mean_s'])} per request (p99 "
        f"{_time(summary['transfer_p99_s'])}); {summary['link_waits']} waits for decode "
        "memory"
    )
    print(
        f"TTFT mean {_time(summary['ttft_mean_s'])} (p99 {_time(summary['ttft_p99_s'])}"
        f"), TPOT mean {_time(summary['tpot_mean_s'])}; simulated "
        f"{duration(summary['sim_time_s'])} in {summary['wall_time_s']:.1f} s"
    )
    return 0


def _time(seconds: float | None) -> str:
    """:func:`duration`, or ``n/a`` where nothing was measured."""
    return "n/a" if seconds is None else duration(seconds)
