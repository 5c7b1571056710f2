"""Capacity of every catalog model under every strategy, against the naive estimate.

For each model in :func:`hybridkv.models.catalog_names`, plans ``--memory`` bytes for requests
of ``--max-model-len`` tokens with the ``arena``, ``uniform`` and ``pools`` strategies and the
naive "every layer is full attention" estimate; prints a markdown table and a one-line summary,
and writes every figure (plus each plan) as JSON to ``--out``.

    python benchmarks/plan_catalog.py --memory 40GiB --max-model-len 131072

Planning is deterministic; the seed is fixed only to honour the benchmark convention.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from typing import Any

from hybridkv.errors import PlanError
from hybridkv.models import catalog_names, resolve_model
from hybridkv.plan import Strategy, StrategyComparison, compare_strategies
from hybridkv.units import SizeError, parse_bytes

from bench_cli import out_path

SEED = 0
STRATEGIES = [s.value for s in Strategy]


def _row(name: str, comparison: StrategyComparison | None, error: str | None) -> dict[str, Any]:
    """The figures of one model; capacity 0 where a strategy holds no request."""
    if comparison is None:
        return {
            "model": name,
            "groups": None,
            "capacity": dict.fromkeys(STRATEGIES, 0),
            "waste_fraction": dict.fromkeys(STRATEGIES, None),
            "utilisation": dict.fromkeys(STRATEGIES, None),
            "naive_capacity": 0,
            "error": error,
        }
    plans = {p.strategy.value: p for p in comparison.plans}
    arena = plans.get("arena")
    return {
        "model": name,
        "groups": None if arena is None else len(arena.layout.groups),
        "capacity": {
            s: plans[s].capacity.max_concurrent_requests if s in plans else 0 for s in STRATEGIES
        },
        "waste_fraction": {s: plans[s].waste_fraction if s in plans else None for s in STRATEGIES},
        "utilisation": {s: plans[s].utilisation if s in plans else None for s in STRATEGIES},
        "naive_capacity": comparison.naive.max_concurrent_requests,
        "failures": {f.strategy.value: f.reason for f in comparison.failures},
        "plans": {s: p.to_dict() for s, p in plans.items()},
        "error": None,
    }


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.2f}%"


def _ratio(row: dict[str, Any]) -> str:
    arena, uniform = row["capacity"]["arena"], row["capacity"]["uniform"]
    return "n/a" if uniform == 0 else f"{arena / uniform:.2f}x"


def markdown(rows: list[dict[str, Any]]) -> str:
    header = (
        "| model | groups | arena | uniform | pools | arena waste | uniform waste "
        "| arena/uniform | naive |"
    )
    lines = [header, "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        cap = r["capacity"]
        lines.append(
            f"| {r['model']} | {r['groups'] if r['groups'] is not None else 'n/a'} "
            f"| {cap['arena']} | {cap['uniform']} | {cap['pools']} "
            f"| {_pct(r['waste_fraction']['arena'])} | {_pct(r['waste_fraction']['uniform'])} "
            f"| {_ratio(r)} | {r['naive_capacity']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--memory", default="40GiB", help="KV-cache budget (default: 40GiB)")
    parser.add_argument("--max-model-len", type=int, default=131072, help="tokens per request")
    parser.add_argument("--out", default="results/plan_catalog.json", help="JSON result path")
    args = parser.parse_args(argv)
    random.seed(SEED)
    try:
        memory = parse_bytes(args.memory, field="--memory")
    except SizeError as exc:
        parser.error(str(exc))
    if memory < 1 or args.max_model_len < 1:
        parser.error(
            f"--memory and --max-model-len must be positive, got {args.memory!r}, "
            f"{args.max_model_len}"
        )
    out = out_path(parser, args.out)

    rows: list[dict[str, Any]] = []
    start = time.perf_counter()
    for name in catalog_names():
        model = resolve_model(name)
        try:
            comparison = compare_strategies(
                model, memory_bytes=memory, max_model_len=args.max_model_len
            )
        except PlanError as exc:
            rows.append(_row(name, None, str(exc)))
            continue
        rows.append(_row(name, comparison, None))
    elapsed = time.perf_counter() - start

    print(f"memory {args.memory} ({memory} B), max_model_len {args.max_model_len}\n")
    print(markdown(rows))
    for r in rows:
        if r["error"]:
            print(f"\n{r['model']}: {r['error']}")
    planned = [r for r in rows if r["error"] is None]
    wins = sum(r["capacity"]["arena"] > r["capacity"]["uniform"] for r in planned)
    ties = sum(r["capacity"]["arena"] == r["capacity"]["uniform"] for r in planned)
    worst = max((r["waste_fraction"]["arena"] for r in planned), default=0.0)
    print(
        f"\nsummary: {len(rows)} models, {len(planned)} planned; arena > uniform on {wins}, "
        f"= on {ties}, < on {len(planned) - wins - ties}; worst arena waste {100 * worst:.2f}%; "
        f"{elapsed:.2f} s"
    )

    result = {
        "benchmark": "plan_catalog",
        "seed": SEED,
        "memory_bytes": memory,
        "max_model_len": args.max_model_len,
        "elapsed_s": elapsed,
        "models": rows,
    }
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
