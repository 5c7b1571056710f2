"""Block hashing of long prompts: milliseconds to build a :class:`hybridkv.cache.Request`.

Building a request validates its tokens and computes the chained hash of every whole block
(:mod:`hybridkv.cache.hashing`).  For each hasher and prompt length this times, best of
``--repeat`` runs:

* ``request``: ``Request(...)`` as a scheduler builds it (validation + the batch hash path);
* ``per_block``: the same hashes one ``hash_block`` call per block (the path before batching,
  and still the path for requests with extra keys: LoRA, salt, multimodal items);
* ``append``: decoding 256 tokens one at a time onto the prompt (incremental hashing).

    python benchmarks/bench_hashing.py --lengths 1000,8000,64000,200000

Prints a table and a one-line summary, and writes JSON to ``--out``.  Token ids come from a
fixed-seed generator.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time
from collections.abc import Callable
from typing import Any

from hybridkv.cache import Request, compiled, make_hasher
from hybridkv.errors import HybridKVError

from bench_cli import out_path

SEED = 0
BLOCK = 16


def _best_ms(fn: Callable[[], object], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def _measure(name: str, tokens: list[int], repeat: int) -> dict[str, Any]:
    hasher = make_hasher(name)
    n = len(tokens)

    def per_block() -> None:
        parent = None
        for i in range(n // BLOCK):
            parent = hasher.hash_block(parent, tokens[i * BLOCK : (i + 1) * BLOCK], ())

    built = Request("r", tokens, hash_block_size=BLOCK, hasher=hasher)
    assert built.block_hashes == hasher.hash_blocks(None, tokens, BLOCK)
    request_ms = _best_ms(
        lambda: Request("r", tokens, hash_block_size=BLOCK, hasher=hasher), repeat
    )
    return {
        "hasher": name,
        "tokens": n,
        "request_ms": request_ms,
        "per_block_ms": _best_ms(per_block, repeat),
        "append_256_ms": _append_ms(tokens, hasher, repeat),
    }


def _append_ms(tokens: list[int], hasher: Any, repeat: int) -> float:
    """Best ms of 256 decode appends to a built request (its build untimed)."""
    best = float("inf")
    for _ in range(repeat):
        req = Request("r", tokens, hash_block_size=BLOCK, hasher=hasher)
        t0 = time.perf_counter()
        for t in range(256):
            req.append_token_ids([t])
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="1000,8000,64000,200000", help="prompt tokens")
    parser.add_argument("--hashers", default="xxh3,sha256,builtin")
    parser.add_argument("--repeat", type=int, default=7, help="runs per figure (best kept)")
    parser.add_argument("--out", default="results/bench_hashing.json")
    args = parser.parse_args()
    try:
        lengths = [int(x) for x in args.lengths.split(",")]
    except ValueError:
        parser.error(f"--lengths: expected comma-separated integers, got {args.lengths!r}")
    if min(lengths) < BLOCK or args.repeat < 1:
        parser.error(f"--lengths must be at least {BLOCK} tokens and --repeat at least 1")
    hashers = args.hashers.split(",")
    for name in hashers:
        try:
            make_hasher(name)
        except HybridKVError as exc:
            parser.error(f"--hashers: {exc}")
    out = out_path(parser, args.out)
    rng = random.Random(SEED)
    rows = []
    for length in lengths:
        tokens = [rng.randrange(200_000) for _ in range(length)]
        for name in hashers:
            rows.append(_measure(name, tokens, args.repeat))
    print(f"{'hasher':8} {'tokens':>8} {'request ms':>11} {'per-block ms':>13} {'+256 dec ms':>12}")
    for r in rows:
        print(
            f"{r['hasher']:8} {r['tokens']:8d} {r['request_ms']:11.2f} {r['per_block_ms']:13.2f} "
            f"{r['append_256_ms']:12.2f}"
        )
    longest = max(r["tokens"] for r in rows)
    top = {r["hasher"]: r for r in rows if r["tokens"] == longest}
    summary = ", ".join(
        f"{h} {r['request_ms']:.1f} ms (per-block hashing alone {r['per_block_ms']:.1f} ms)"
        for h, r in top.items()
    )
    build = "compiled" if compiled() else "pure"
    print(f"summary ({build} build): a {longest}-token request builds in {summary}")
    if "xxh3" in top and "sha256" in top:
        x, h = top["xxh3"], top["sha256"]
        print(
            f"xxh3 vs sha256 at {longest} tokens: request {h['request_ms'] / x['request_ms']:.2f}x"
            f" faster, per-block hashing alone {h['per_block_ms'] / x['per_block_ms']:.2f}x"
        )
    meta = {"seed": SEED, "block": BLOCK, "python": platform.python_version(), "build": build}
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
