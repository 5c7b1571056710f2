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
from pathlib import Path
from typing import Any

from hybridkv.cache import Request, make_hasher

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

    def append() -> None:
        req = Request("r", tokens, hash_block_size=BLOCK, hasher=hasher)
        for t in range(256):
            req.append_token_ids([t])

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
        "append_256_ms": _best_ms(append, repeat) - request_ms,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="1000,8000,64000,200000", help="prompt tokens")
    parser.add_argument("--hashers", default="xxh3,sha256,builtin")
    parser.add_argument("--repeat", type=int, default=7, help="runs per figure (best kept)")
    parser.add_argument("--out", default="results/bench_hashing.json")
    args = parser.parse_args()
    rng = random.Random(SEED)
    rows = []
    for length in (int(x) for x in args.lengths.split(",")):
        tokens = [rng.randrange(200_000) for _ in range(length)]
        for name in args.hashers.split(","):
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
    print(f"summary: a {longest}-token request builds in {summary}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"seed": SEED, "block": BLOCK, "python": platform.python_version()}
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
