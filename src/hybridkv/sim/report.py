"""Simulation reports: a summary table, JSON, PNG plots and one HTML page.

Plots (matplotlib, Agg backend, imported only when a report directory is asked for):

* ``hit_rate.png``: cumulative token hit rate over simulated time, one line per strategy;
* ``memory.png``: memory held by referenced blocks vs the exact physical need of the running
  requests, over simulated time, one panel per strategy, with the budget as a line;
* ``group_usage.png``: blocks each group holds over time, one panel per strategy.
"""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

from hybridkv.sim.simulator import SimResult
from hybridkv.units import format_bytes

__all__ = ["format_summary_table", "write_report"]


def _row(r: SimResult) -> dict[str, str]:
    s = r.summary()
    groups = ", ".join(f"{k} {v:.1%}" for k, v in s["group_hit_rates"].items())
    return {
        "strategy": r.strategy,
        "hit rate": f"{s['token_hit_rate']:.1%}",
        "per group (alone)": groups,
        "peak used": format_bytes(s["peak_used_bytes"]),
        "peak need": format_bytes(s["peak_need_bytes"]),
        "preempt": str(s["preemptions"]),
        "peak conc": str(s["peak_running"]),
        "tok/s": f"{s['output_tokens_per_s']:.0f}",
        "TTFT p50/p99": f"{s['ttft_p50_s']:.2f}/{s['ttft_p99_s']:.2f}s",
        "TPOT": f"{s['tpot_mean_s'] * 1000:.1f}ms",
        "done": f"{s['finished']}/{s['requests']}",
    }


def format_summary_table(results: list[SimResult]) -> str:
    """An aligned text table, one row per strategy."""
    rows = [_row(r) for r in results]
    cols = list(rows[0])
    widths = {c: max(len(c), *(len(row[c]) for row in rows)) for c in cols}
    lines = ["  ".join(c.ljust(widths[c]) for c in cols)]
    lines.append("  ".join("-" * widths[c] for c in cols))
    lines += ["  ".join(row[c].ljust(widths[c]) for c in cols) for row in rows]
    return "\n".join(lines)


def _result_json(r: SimResult) -> dict[str, Any]:
    return {
        "summary": r.summary(),
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


def _plots(results: list[SimResult], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names: list[str] = []
    fig, ax = plt.subplots(figsize=(7, 4))
    for r in results:
        ax.plot(
            [p.time_s for p in r.timeline], [100 * p.hit_rate for p in r.timeline], label=r.strategy
        )
    ax.set_xlabel("simulated time (s)")
    ax.set_ylabel("cumulative token hit rate (%)")
    ax.set_title("Prefix-cache token hit rate")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "hit_rate.png", dpi=110)
    plt.close(fig)
    names.append("hit_rate.png")

    n = len(results)
    fig, axes = plt.subplots(n, 1, figsize=(7, 2.8 * n), squeeze=False)
    gib = float(1 << 30)
    for ax, r in zip(axes[:, 0], results, strict=True):
        t = [p.time_s for p in r.timeline]
        ax.plot(t, [p.used_bytes / gib for p in r.timeline], label="held by running requests")
        ax.plot(t, [p.need_bytes / gib for p in r.timeline], label="physical need, nothing shared")
        ax.axhline(r.plan.memory_bytes / gib, color="grey", linestyle="--", label="budget")
        ax.set_ylabel("GiB")
        ax.set_title(f"{r.strategy}: memory held vs needed")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[-1, 0].set_xlabel("simulated time (s)")
    fig.tight_layout()
    fig.savefig(out / "memory.png", dpi=110)
    plt.close(fig)
    names.append("memory.png")

    fig, axes = plt.subplots(n, 1, figsize=(7, 2.8 * n), squeeze=False)
    for ax, r in zip(axes[:, 0], results, strict=True):
        t = [p.time_s for p in r.timeline]
        groups = r.plan.layout.groups
        for g, label in enumerate(r.group_labels):
            block_bytes = groups[g].block_bytes
            ax.plot(t, [p.group_blocks[g] * block_bytes / gib for p in r.timeline], label=label)
        ax.set_ylabel("GiB held")
        ax.set_title(f"{r.strategy}: memory per group")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[-1, 0].set_xlabel("simulated time (s)")
    fig.tight_layout()
    fig.savefig(out / "group_usage.png", dpi=110)
    plt.close(fig)
    names.append("group_usage.png")
    return names


def write_report(results: list[SimResult], out_dir: str | Path, *, title: str) -> Path:
    """Write ``report.json``, the PNG plots and ``index.html`` into ``out_dir``; returns it."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(
        json.dumps({"title": title, "results": [_result_json(r) for r in results]}, indent=1)
    )
    images = _plots(results, out)
    rows = [_row(r) for r in results]
    cols = list(rows[0])
    head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(row[c])}</td>" for c in cols) + "</tr>" for row in rows
    )
    imgs = "".join(f'<p><img src="{name}" alt="{name}"></p>' for name in images)
    page = (
        "<!doctype html><html><head><meta charset='utf-8'>"
        f"<title>{html.escape(title)}</title>"
        "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:4px 8px;text-align:right}</style></head><body>"
        f"<h1>{html.escape(title)}</h1><table><tr>{head}</tr>{body}</table>{imgs}"
        "<p>Raw data: <a href='report.json'>report.json</a></p></body></html>"
    )
    (out / "index.html").write_text(page)
    return out
