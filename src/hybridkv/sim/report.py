"""Simulation reports: a summary table, a one-line reading of it, JSON, PNG plots, one HTML page.

Plots (matplotlib, Agg backend, imported only when a report directory is asked for), each
titled with the model, workload, budget and accelerator, with shared axes across strategies
and legends outside the data:

* ``hit_rate.png``: cumulative token hit rate over simulated time, one line per strategy;
* ``memory.png``: memory held by referenced blocks vs the exact physical need of the running
  requests, over simulated time, one panel per strategy, with the budget as a line;
* ``group_usage.png``: memory each group holds over time (stacked), one panel per strategy.
"""

from __future__ import annotations

import html
import json
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridkv.sim.simulator import SimResult
from hybridkv.units import format_bytes

__all__ = [
    "COLUMNS",
    "StrategyFailure",
    "format_summary_table",
    "interpretation",
    "write_report",
]


@dataclass(frozen=True, slots=True)
class StrategyFailure:
    """A strategy that could not run the simulation (its plan or a request does not fit)."""

    strategy: str
    reason: str


#: Summary-table column -> what it means (shown in the HTML report).
COLUMNS: dict[str, str] = {
    "strategy": "memory layout: arena (one pool carved by whichever group needs it), uniform "
    "(vLLM's rules: one page size, padded), pools (a fixed split per group)",
    "hit rate": "prompt tokens served from the prefix cache, of all prompt tokens of the "
    "workload (rejected requests count as misses)",
    "per group (alone)": "share of queried tokens each cache group alone could have served "
    "(a hit needs every group at once); counted per cache query, and a request waiting for "
    "memory is queried again every step, so this is not on the hit rate's scale",
    "peak used": "most memory held at once by blocks in use",
    "peak need": "most memory the running requests physically needed at once, nothing shared",
    "preempt": "requests evicted to free memory, to be recomputed later",
    "peak conc": "most requests running at once",
    "tok/s": "output tokens per simulated second (the accelerator's cost model)",
    "TTFT p50/p99": "time to first token, median and 99th percentile, simulated seconds",
    "TPOT": "mean time per output token after the first",
    "done": "requests finished, of the workload",
    "rejected": "requests never admitted: prompt of max_model_len tokens or more",
}


def compact_groups(rates: dict[str, float]) -> str:
    """``{"g0:state, 9 layers": 0.521, "g1:state, 9 layers": 0.521, ...}`` as one cell:
    consecutive groups of the same kind and size with the same rate share an entry
    (``g0-g3:state, 4x9 layers 52.1%``), as a state split's parts always do."""
    runs: list[tuple[int, int, str, int, str]] = []  # first, last, kind, layers, rate
    for label, rate in rates.items():
        gid, _, rest = label.partition(":")
        kind, _, layers = rest.rpartition(", ")
        try:
            g, n = int(gid.removeprefix("g")), int(layers.split()[0])
        except (ValueError, IndexError):  # not a group label of ours: shown as it is
            runs.append((-1, -1, label, 0, f"{rate:.1%}"))
            continue
        text = f"{rate:.1%}"
        if runs and runs[-1][1] == g - 1 and runs[-1][2:] == (kind, n, text):
            runs[-1] = (runs[-1][0], g, kind, n, text)
        else:
            runs.append((g, g, kind, n, text))
    cells = []
    for first, last, kind, n, text in runs:
        if first < 0:
            cells.append(f"{kind} {text}")
        elif first == last:
            cells.append(f"g{first}:{kind}, {n} layer{'s' if n != 1 else ''} {text}")
        else:
            cells.append(f"g{first}-g{last}:{kind}, {last - first + 1}x{n} layers {text}")
    return ", ".join(cells)


def _num(value: float | None, fmt: str, scale: float = 1.0) -> str:
    """``fmt`` of ``value * scale``, or ``n/a`` where nothing was measured (None)."""
    if value is None:
        return "n/a"
    return fmt.format(value if scale == 1.0 else value * scale)


def _row(r: SimResult) -> dict[str, str]:
    s = r.summary()
    ttft = "n/a" if s["ttft_p50_s"] is None else f"{s['ttft_p50_s']:.2f}/{s['ttft_p99_s']:.2f}s"
    groups = compact_groups(s["group_hit_rates"])
    return {
        "strategy": r.strategy,
        "hit rate": f"{s['token_hit_rate']:.1%}",
        "per group (alone)": groups,
        "peak used": format_bytes(s["peak_used_bytes"]),
        "peak need": format_bytes(s["peak_need_bytes"]),
        "preempt": str(s["preemptions"]),
        "peak conc": str(s["peak_running"]),
        "tok/s": _num(s["output_tokens_per_s"], "{:.0f}"),
        "TTFT p50/p99": ttft,
        "TPOT": _num(s["tpot_mean_s"], "{:.1f}ms", 1000),
        "done": f"{s['finished']}/{s['requests']}",
        "rejected": str(s["rejected"]),
    }


def _failure_row(f: StrategyFailure) -> dict[str, str]:
    return {c: (f.strategy if c == "strategy" else "n/a") for c in COLUMNS}


def format_summary_table(
    results: list[SimResult], failures: list[StrategyFailure] | None = None
) -> str:
    """An aligned text table, one row per strategy (``n/a`` rows for ``failures``)."""
    rows = [_row(r) for r in results] + [_failure_row(f) for f in failures or []]
    cols = list(COLUMNS)
    widths = {c: max(len(c), *(len(row[c]) for row in rows)) for c in cols}
    lines = ["  ".join(c.ljust(widths[c]) for c in cols).rstrip()]
    lines.append("  ".join("-" * widths[c] for c in cols))
    lines += ["  ".join(row[c].ljust(widths[c]) for c in cols).rstrip() for row in rows]
    return "\n".join(lines)


def _others(
    ranked: list[SimResult], key: str, fmt: str, *, first: bool = False, scale: float = 1.0
) -> str:
    """``strategy value`` of each run after the first (every run with ``first``); the value
    is ``summary()[key] * scale``."""
    rows = ranked if first else ranked[1:]
    return ", ".join(f"{r.strategy} {_num(r.summary()[key], fmt, scale)}" for r in rows)


def _pool_bound(r: SimResult) -> str:
    """Why a run with per-group pools used under half its budget, where its timeline shows
    the reason: a group whose pool ran full ("" when none did, or the run used more)."""
    plan, pools = r.plan, r.plan.capacity.pool_blocks
    if len(pools) != len(plan.layout.groups) or not r.timeline:
        return ""
    if 2 * r.peak_used_bytes >= plan.memory_bytes:
        return ""
    full = []
    for g, n in enumerate(pools):
        peak = max(p.group_blocks[g] for p in r.timeline)
        if peak and peak >= n - 1:
            kind = plan.layout.groups[g].spec.kind.value
            full.append(f"g{g} ({kind}) pool has {n} blocks, up to {peak} of them in use")
    if not full:
        return ""
    return (
        f"; {r.strategy} ran at most {r.peak_running} requests at once and used at most "
        f"{format_bytes(r.peak_used_bytes)} of the budget: its {' and '.join(full)} (the plan "
        f"sizes each pool for {plan.capacity.max_concurrent_requests} requests of "
        f"max_model_len {plan.max_model_len} tokens)"
    )


def interpretation(results: list[SimResult], failures: list[StrategyFailure] | None = None) -> str:
    """One line that says what the table means, computed from it (nothing canned)."""
    budget = format_bytes(results[0].plan.memory_bytes)
    failed = "".join(f"; {f.strategy} cannot run at all (see above)" for f in failures or [])
    failed += "".join(_pool_bound(r) for r in results)
    failed += "".join(
        f"; {r.strategy} preempted {r.preemptions} times for {r.num_requests} requests: the "
        "budget is too small for this workload (try a larger --memory)"
        for r in results
        if r.num_requests and r.preemptions >= r.num_requests
    )
    if len(results) == 1:
        r = results[0]
        return (
            f"meaning: with {r.strategy}, {r.hit_rate:.1%} of all prompt tokens came from the "
            f"prefix cache and {r.preemptions} requests were preempted for lack of memory in "
            f"the {budget} budget{failed}"
        )
    ranked = sorted(results, key=lambda r: (-r.hit_rate, r.preemptions))
    best = ranked[0]
    s = best.summary()
    tie = [r.strategy for r in ranked[1:] if abs(r.hit_rate - best.hit_rate) < 0.0005]
    lead = f"{best.strategy}" + (f" (tied with {', '.join(tie)})" if tie else "")
    what = "host tier sizes" if len({_host_bytes(r) for r in results}) > 1 else "layouts"
    if len(tie) == len(results) - 1:
        return (
            f"meaning: same model, workload and {budget} budget: every one of the {what} "
            f"served {best.hit_rate:.1%} of prompt tokens from the prefix cache, with "
            f"{_others(ranked, 'preemptions', '{}', first=True)} preemptions, TTFT p99 "
            f"{_others(ranked, 'ttft_p99_s', '{:.2f}s', first=True)} and mean TPOT "
            f"{_others(ranked, 'tpot_mean_s', '{:.1f}ms', first=True, scale=1e3)}{failed}"
        )
    return (
        f"meaning: same model, workload and {budget} budget, so the differences are the "
        f"{what}: {lead} served the most prompt tokens from the prefix cache, "
        f"{best.hit_rate:.1%} (vs {_others(ranked, 'token_hit_rate', '{:.1%}')}), with "
        f"{best.preemptions} preemptions (vs {_others(ranked, 'preemptions', '{}')}), TTFT "
        f"p99 {_num(s['ttft_p99_s'], '{:.2f}s')} (vs {_others(ranked, 'ttft_p99_s', '{:.2f}s')}) "
        f"and mean TPOT {_num(s['tpot_mean_s'], '{:.1f}ms', 1e3)} (vs "
        f"{_others(ranked, 'tpot_mean_s', '{:.1f}ms', scale=1e3)}){failed}"
    )


def _result_json(r: SimResult) -> dict[str, Any]:
    return {
        "summary": r.summary(),
        "rejected": [
            {"request_id": x.request_id, "prompt_len": x.prompt_len, "reason": x.reason}
            for x in r.rejected
        ],
        "plan": r.plan.to_dict(),
        "timeline": [
            {
                "time_s": p.time_s,
                "step": p.step,
                "running": p.running,
                "waiting": p.waiting,
                "used_bytes": p.used_bytes,
                "need_bytes": p.need_bytes,
                "group_blocks": list(p.group_blocks),
                "hit_rate": p.hit_rate,
            }
            for p in r.timeline
        ],
    }


def _plots(results: list[SimResult], out: Path, title: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    title = textwrap.fill(title, 110)
    gib = float(1 << 30)
    t_end = max((p.time_s for r in results for p in r.timeline), default=1.0) or 1.0
    names: list[str] = []

    fig, ax = plt.subplots(figsize=(9, 4.2))
    styles = ("-", "--", ":", "-.")
    for i, r in enumerate(results):
        ax.plot(  # a line style each, so runs that tie stay visible over one another
            [p.time_s for p in r.timeline],
            [100 * p.hit_rate for p in r.timeline],
            linestyle=styles[i % len(styles)],
            linewidth=2.2 if i == 0 else 1.5,
            label=f"{r.strategy} ({r.hit_rate:.1%} at the end)",
        )
    ax.set_xlim(0, t_end)
    ax.set_xlabel("simulated time (s)")
    ax.set_ylabel("cumulative token hit rate (%)")
    ax.set_title("Prefix-cache token hit rate", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "hit_rate.png", dpi=110)
    plt.close(fig)
    names.append("hit_rate.png")

    n = len(results)
    fig, axes = plt.subplots(n, 1, figsize=(9, 2.6 * n + 0.6), squeeze=False, sharex=True)
    top = max(
        [r.plan.memory_bytes / gib for r in results]
        + [p.need_bytes / gib for r in results for p in r.timeline]
    )
    for ax, r in zip(axes[:, 0], results, strict=True):
        t = [p.time_s for p in r.timeline]
        ax.plot(t, [p.used_bytes / gib for p in r.timeline], label="held by blocks in use")
        ax.plot(t, [p.need_bytes / gib for p in r.timeline], label="physical need, nothing shared")
        ax.axhline(r.plan.memory_bytes / gib, color="grey", linestyle="--", label="budget")
        ax.set_ylim(0, top * 1.05)
        ax.set_ylabel("GiB")
        ax.set_title(f"{r.strategy}: memory held vs needed", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7)
    axes[-1, 0].set_xlim(0, t_end)
    axes[-1, 0].set_xlabel("simulated time (s)")
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "memory.png", dpi=110)
    plt.close(fig)
    names.append("memory.png")

    fig, axes = plt.subplots(n, 1, figsize=(9, 2.6 * n + 0.6), squeeze=False, sharex=True)
    top = max(r.plan.memory_bytes / gib for r in results)
    for ax, r in zip(axes[:, 0], results, strict=True):
        t = [p.time_s for p in r.timeline]
        groups = r.plan.layout.groups
        # Stacked, so groups with equal usage (uniform's identical state groups) stay visible.
        series = [
            [p.group_blocks[g] * groups[g].block_bytes / gib for p in r.timeline]
            for g in range(len(groups))
        ]
        ax.stackplot(t, series, labels=list(r.group_labels), alpha=0.85)
        ax.axhline(r.plan.memory_bytes / gib, color="grey", linestyle="--", label="budget")
        ax.set_ylim(0, top * 1.05)
        ax.set_ylabel("GiB held (stacked)")
        ax.set_title(f"{r.strategy}: memory per group", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7)
    axes[-1, 0].set_xlim(0, t_end)
    axes[-1, 0].set_xlabel("simulated time (s)")
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "group_usage.png", dpi=110)
    plt.close(fig)
    names.append("group_usage.png")
    if len({_host_bytes(r) for r in results}) > 1:
        names.append(_tier_plot(results, out, title))
    return names


def _host_bytes(r: SimResult) -> int:
    return r.tiers.get("host", {}).get("capacity_bytes", 0)


def _tier_plot(results: list[SimResult], out: Path, title: str) -> str:
    """Hit rate (per tier, stacked) and TTFT against the host tier's size."""
    import matplotlib.pyplot as plt

    ordered = sorted(results, key=_host_bytes)
    gib = float(1 << 30)
    x = [_host_bytes(r) / gib for r in ordered]
    host = [100 * r.tier_hit_tokens.get("host", 0) / r.prompt_tokens for r in ordered]
    disk = [100 * r.tier_hit_tokens.get("disk", 0) / r.prompt_tokens for r in ordered]
    total = [100 * r.hit_rate for r in ordered]
    device = [t - h - d for t, h, d in zip(total, host, disk, strict=True)]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.2))
    ax.stackplot(x, device, host, disk, labels=["device", "host tier", "disk tier"], alpha=0.85)
    ax.plot(x, total, color="black", marker="o", label="total")
    ax.set_xlabel("host tier (GiB)")
    ax.set_ylabel("prompt tokens served from cache (%)")
    ax.set_title("Hit rate by where the hit came from", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    for q, label in ((0.5, "p50"), (0.99, "p99")):
        bx.plot(x, [_pct(r.ttft_s, q) for r in ordered], marker="o", label=f"TTFT {label}")
    bx.set_xlabel("host tier (GiB)")
    bx.set_ylabel("seconds")
    bx.set_title("Time to first token", fontsize=10)
    bx.grid(alpha=0.3)
    bx.legend(fontsize=8)
    fig.suptitle(textwrap.fill(title, 110), fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "tiers.png", dpi=110)
    plt.close(fig)
    return "tiers.png"


def _pct(values: list[float], q: float) -> float:
    """The ``q`` quantile of ``values``; NaN (a gap in the plot) when there are none."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def tier_lines(result: SimResult, through: str | None = None, oracle: bool = False) -> list[str]:
    """One line per lower tier: hit tokens read back from it, bytes written and read (and
    whether it is the write-through tier ``through``, and whether an oracle client protected
    conversations in it)."""
    lines = []
    for name, st in result.tiers.items():
        tokens = result.tier_hit_tokens.get(name, 0)
        share = tokens / result.prompt_tokens if result.prompt_tokens else 0.0
        lines.append(
            f"{result.strategy} {name} tier"
            f"{' (write-through)' if name == through else ''}"
            f"{' (oracle-protected sessions)' if oracle else ''}: "
            f"{format_bytes(st['capacity_bytes'])}, "
            f"{tokens} prompt tokens read back ({share:.1%} of all), "
            f"{format_bytes(st['stored_bytes'])} written "
            f"({format_bytes(st['from_device_bytes'])} from the device), "
            f"{format_bytes(st['loaded_bytes'])} "
            f"read, {st['dropped']} blocks dropped"
            + (f", {result.sessions_expired} sessions expired" if oracle else "")
        )
    return lines


def write_report(
    results: list[SimResult],
    out_dir: str | Path,
    *,
    title: str,
    failures: list[StrategyFailure] | None = None,
    through: str | None = None,
    oracle: bool = False,
) -> Path:
    """Write ``report.json``, the PNG plots and ``index.html`` into ``out_dir``; returns it.

    ``title`` names what was simulated (model, workload, budget, accelerator); every plot
    and the page carry it; the page lists each run's lower tiers as the terminal does
    (:func:`tier_lines`, with ``through`` and ``oracle``).  Raises ``OSError`` when
    ``out_dir`` cannot be written.
    """
    failures = failures or []
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(
        json.dumps(
            {
                "title": title,
                "results": [_result_json(r) for r in results],
                "failures": [{"strategy": f.strategy, "reason": f.reason} for f in failures],
            },
            indent=1,
        )
    )
    images = _plots(results, out, title)
    rows = [_row(r) for r in results] + [_failure_row(f) for f in failures]
    cols = list(COLUMNS)
    head = "".join(
        f"<th title='{html.escape(COLUMNS[c], quote=True)}'>{html.escape(c)}</th>" for c in cols
    )
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(row[c])}</td>" for c in cols) + "</tr>" for row in rows
    )
    legend = "".join(
        f"<dt>{html.escape(c)}</dt><dd>{html.escape(text)}</dd>" for c, text in COLUMNS.items()
    )
    failed = "".join(
        f"<p><b>{html.escape(f.strategy)}: n/a</b>: {html.escape(f.reason)}</p>" for f in failures
    )
    imgs = "".join(f'<p><img src="{name}" alt="{name}"></p>' for name in images)
    tiers = "".join(
        f"<li>{html.escape(line)}</li>" for r in results for line in tier_lines(r, through, oracle)
    )
    tiers = f"<h2>Lower tiers</h2><ul>{tiers}</ul>" if tiers else ""
    page = (
        "<!doctype html><html><head><meta charset='utf-8'>"
        f"<title>{html.escape(title)}</title>"
        "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:4px 8px;text-align:right}"
        "dt{font-weight:bold;margin-top:.4em}</style></head><body>"
        f"<h1>hybridkv simulate</h1><p>{html.escape(title)}</p>"
        f"<table><tr>{head}</tr>{body}</table>{failed}"
        f"<p>{html.escape(interpretation(results, failures))}</p>{tiers}"
        f"<h2>Columns</h2><dl>{legend}</dl>{imgs}"
        "<p>Raw data: <a href='report.json'>report.json</a></p></body></html>"
    )
    (out / "index.html").write_text(page)
    return out
