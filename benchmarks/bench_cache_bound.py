"""How many prefix hits a cache of a given size can reach on a trace, under LRU and under
Belady's rule: the head-room an eviction order has, and what only prediction could add.

For each model and each cache size, the trace is replayed request after request (no request
running concurrently) through a cache of ``size / (block_size * bytes per token)`` blocks,
where the bytes per token are those of the model's prefix-closed layers (full attention,
MLA): the bytes every cached prefix token needs whatever a manager does.  Sliding windows
(only tails are kept) and recurrent-state checkpoints are left out, so the figures are
optimistic for the models that have them.  Printed per row: the LRU and Belady hit rates and
their ratio to the unbounded-cache ideal; a JSON result goes to ``--out``.

    python benchmarks/bench_cache_bound.py --models gpt-oss-20b,Qwen3-Next-80B-A3B \
        --sizes 16GiB,144GiB,272GiB,528GiB

The sizes to compare with ``hybridkv simulate --memory 16GiB --host-memory 128GiB`` are the
device and host together (144 GiB).  Without the shared trace it prints one line and exits 0.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from hybridkv.errors import HybridKVError
from hybridkv.models import resolve_model
from hybridkv.specs import ModelSpec
from hybridkv.units import format_bytes, parse_bytes
from hybridkv.workloads import ideal_hit_tokens, load_mooncake_trace, replay_hit_tokens

from bench_cli import out_path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TRACE = ROOT.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"


def prefix_bytes_per_token(model: ModelSpec) -> int:
    """Bytes per cached token of the layers whose cache every prefix token needs."""
    return sum(c.bytes_per_token for layer in model.layers for c in layer.caches if c.prefix_closed)


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="gpt-oss-20b,Qwen3-Next-80B-A3B")
    p.add_argument("--trace", default=None, help="Mooncake trace (default: the shared one)")
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--sizes", default="16GiB,144GiB,272GiB,528GiB")
    p.add_argument("--block-size", type=int, default=16, help="tokens per cache block")
    p.add_argument("--out", default="results/bench_cache_bound.json")
    args = p.parse_args(argv)
    trace = Path(args.trace or DEFAULT_TRACE)
    if not trace.exists():
        if args.trace is not None:  # a path the user gave must exist
            p.error(f"--trace: {trace} does not exist")
        print(f"bench_cache_bound: no trace at {trace}; nothing to measure")
        return None
    if args.requests < 1 or args.block_size < 1:
        p.error("--requests and --block-size must be at least 1")
    try:
        models = {name: resolve_model(name) for name in args.models.split(",")}
        sizes = [parse_bytes(s, field="--sizes") for s in args.sizes.split(",")]
    except HybridKVError as exc:
        p.error(str(exc))
    out = out_path(p, args.out)
    t0 = time.perf_counter()
    workload = load_mooncake_trace(trace, limit=args.requests)
    reqs = list(workload.requests)
    prompt_tokens = sum(len(r.prompt_token_ids) for r in reqs)
    ideal = ideal_hit_tokens(reqs, args.block_size) / prompt_tokens
    rows = []
    tty = sys.stderr.isatty()
    print(
        f"{trace.name}: {len(reqs)} requests, {prompt_tokens} prompt tokens; unbounded-cache "
        f"ideal {ideal:.2%} at {args.block_size}-token blocks"
    )
    print(
        f"{'model':22} {'size':>9} {'blocks':>9} {'LRU':>7} {'Belady':>7} {'LRU/ideal':>9} "
        f"{'Belady/ideal':>12}"
    )
    for name, model in models.items():
        if tty:  # the replays take about a minute per model on the full trace
            print(
                f"replaying {name}: LRU and Belady at {len(sizes)} sizes ...",
                end="\r",
                file=sys.stderr,
            )
        per_token = prefix_bytes_per_token(model)
        caps = [max(1, s // (per_token * args.block_size)) for s in sizes]
        lru = replay_hit_tokens(reqs, args.block_size, caps, "lru")
        belady = replay_hit_tokens(reqs, args.block_size, caps, "belady")
        if tty:
            print("\r\x1b[K", end="", file=sys.stderr, flush=True)
        for size, cap, lr, bl in zip(sizes, caps, lru, belady, strict=True):
            row = {
                "model": name,
                "size_bytes": size,
                "prefix_bytes_per_token": per_token,
                "blocks": cap,
                "lru_hit_rate": lr / prompt_tokens,
                "belady_hit_rate": bl / prompt_tokens,
            }
            rows.append(row)
            print(
                f"{name:22} {format_bytes(size):>9} {cap:9d} {row['lru_hit_rate']:7.2%} "
                f"{row['belady_hit_rate']:7.2%} {row['lru_hit_rate'] / ideal:9.2f} "
                f"{row['belady_hit_rate'] / ideal:12.2f}",
                flush=True,
            )
    result = {
        "config": vars(args),
        "prompt_tokens": prompt_tokens,
        "ideal_hit_rate": ideal,
        "rows": rows,
        "wall_s": time.perf_counter() - t0,
    }
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out} ({result['wall_s']:.0f} s)")
    return result


if __name__ == "__main__":
    main()
