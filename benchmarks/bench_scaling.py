"""How the cache manager's calls scale: with the prompt length and with the live requests.

Two tables, one row per (strategy, size), CPU time (``time.process_time``, so other load on
the machine counts less), best of ``--repeat``:

* **prompt**: one request of 1k, 8k, 64k and 200k tokens in an empty cache of a budget that
  holds it: building the request (hashing), ``get_computed_blocks`` (a full hit on a copy
  already cached), ``allocate_slots`` for the whole prompt, and ``free``; with microseconds
  per 1k tokens, which stay flat when a call grows linearly;
* **live**: 100, 1k and 10k requests resident at once, then one decode step
  (``allocate_slots(req, 1)`` for every request) that crosses a block boundary of every group:
  each request's prompt ends one token short of the first multiple of the plan's largest
  block size at or past 512 tokens (511 tokens for 16-token attention blocks and 256-token
  state checkpoints; a ``uniform`` state-hybrid plan whose unified block is ~1,000 tokens gets
  prompts of that length, so its step opens blocks too); microseconds per request per step,
  flat when a step grows linearly.

    python benchmarks/bench_scaling.py --model gpt-oss-20b
    python benchmarks/bench_scaling.py --model Qwen3-Next-80B-A3B --state-split 4

Every plan here uses one ``--state-split`` (default 1), not the planner's ``"auto"``: auto
picks the split by the arena's chunk count, which grows with the budget each row sizes for
its prompt, so one table would mix layouts (Qwen3-Next-80B-A3B: 4 up to 64k tokens, 1 at
200k).  ``--state-split auto`` shows what the default does.

Before each timed call the cyclic garbage collector moves everything alive (the manager's
block lists and maps, built just before) to its oldest generation, where a serving process's
start-up structures are too (vLLM calls ``gc.freeze()`` after start-up): otherwise the
collections a call triggers scan the newly built multi-megabyte structures, which made a
200k-token allocation 3.5x slower on a fresh manager (23 ms vs 6.7 ms, measured) and looked
superlinear.  Collections the call itself triggers still count.

Prints both tables and a one-line summary, and writes JSON to ``--out``.  Token ids are
deterministic (fixed seed).
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import time
from typing import Any

from hybridkv.cache import KVCacheManager
from hybridkv.errors import HybridKVError
from hybridkv.models import resolve_model
from hybridkv.plan import Strategy, make_plan
from hybridkv.specs import ModelSpec

from bench_cli import out_path

SEED = 0
LIVE_TOKENS = 512  # the decode step reaches the first block boundary at or past this


def _prompt_once(mgr: KVCacheManager, tokens: list[int], name: str) -> dict[str, float] | None:
    """CPU ms of building, allocating and freeing one request, then of a lookup of the same
    prompt plus one token (its hit, ``hit_tokens``, is the whole prompt, or for a state model
    whose alignment the prompt is shorter than, 0);
    None when the whole prompt does not fit one allocation (pools: a sliding group's pool is
    sized for one prefill chunk, not a whole long prompt at once)."""
    n = len(tokens)
    clock = time.process_time
    t0 = clock()
    req = mgr.make_request(name, tokens)
    t1 = clock()
    hit = mgr.get_computed_blocks(req)
    t2 = clock()
    if mgr.allocate_slots(req, n, new_computed_blocks=hit) is None:
        return None
    t3 = clock()
    req.num_computed_tokens = n
    req.append_token_ids([1])
    t4 = clock()
    mgr.free(req.request_id)
    t5 = clock()
    # the same prompt plus one token: a hit can cover the whole prompt (state models keep a
    # checkpoint at its end, which the caller aligns to the schedule alignment)
    again = mgr.make_request(name + "+", [*tokens, 1])
    t6 = clock()
    found = mgr.get_computed_blocks(again)
    t7 = clock()
    return {
        "hit_tokens": float(found.num_computed_tokens),
        "hash": (t1 - t0) * 1e3,
        "allocate": (t3 - t2) * 1e3,
        "free": (t5 - t4) * 1e3,
        "lookup": (t7 - t6) * 1e3,
    }


def _prompt_row(
    model: ModelSpec, strategy: str, n: int, repeat: int, rng: random.Random, split: int | str
) -> dict[str, Any]:
    plan = make_plan(
        model,
        memory_bytes=_budget(model, 2 * n + 4096),
        max_model_len=n + 1024,
        strategy=strategy,
        state_split=split,
    )
    best: dict[str, float] = {}
    align = plan.layout.schedule_alignment
    timed = n - n % align or n  # a state model's prompt ends on its alignment
    for rep in range(repeat):
        tokens = [rng.randrange(1, 150_000) for _ in range(timed)]
        mgr = KVCacheManager(plan.layout)
        gc.collect()  # start-up structures to the oldest generation (see the module doc)
        timings = _prompt_once(mgr, tokens, f"a{rep}")
        if timings is None:
            return {"strategy": strategy, "tokens": n, "error": "does not fit one allocation"}
        hit = int(timings.pop("hit_tokens"))
        for key, value in timings.items():
            best[key] = min(best.get(key, value), value)
    # "tokens": the prompt timed (per-1k figures divide by it), "requested_tokens": --prompts'
    out = {"strategy": strategy, "tokens": timed, "requested_tokens": n}
    out.update({f"{k}_ms": v for k, v in best.items()})
    return {**out, "timed_hit_tokens": hit, "state_split": plan.options.state_split}


def _budget(model: ModelSpec, tokens: int) -> int:
    # resident bytes of `tokens` tokens, with room for rounding, state slots and checkpoints
    return 4 * model.resident_bytes(tokens) + (256 << 20)


def _live_prompt(model: ModelSpec, strategy: str, split: int | str) -> int:
    """Prompt tokens that leave the next token on a block boundary of every group."""
    plan = make_plan(
        model, memory_bytes=8 << 30, max_model_len=4096, strategy=strategy, state_split=split
    )
    step = max(g.block_size for g in plan.layout.groups)
    return -(-LIVE_TOKENS // step) * step - 1


def _live_row(
    model: ModelSpec, strategy: str, live: int, repeat: int, rng: random.Random, split: int | str
) -> dict[str, Any]:
    prompt = _live_prompt(model, strategy, split)
    plan = make_plan(
        model,
        # per request: its tokens and its own state slots (a shared-tokens budget would count
        # one request's state only)
        memory_bytes=3 * live * model.resident_bytes(prompt + 64) + (256 << 20),
        max_model_len=max(4096, 2 * prompt),
        strategy=strategy,
        state_split=split,
    )
    best = float("inf")
    for rep in range(repeat):
        mgr = KVCacheManager(plan.layout)
        reqs = []
        for i in range(live):
            req = mgr.make_request(
                f"r{rep}-{i}", [rng.randrange(1, 150_000) for _ in range(prompt)]
            )
            hit = mgr.get_computed_blocks(req)
            res = mgr.allocate_slots(req, prompt, new_computed_blocks=hit)
            assert res is not None, f"{strategy}: {live} live requests do not fit"
            req.num_computed_tokens = prompt
            req.append_token_ids([7])
            reqs.append(req)

        gc.collect()  # as for the prompt table
        t0 = time.process_time()
        for r in reqs:
            assert mgr.allocate_slots(r, 1) is not None
        best = min(best, (time.process_time() - t0) * 1e3)
    return {
        "strategy": strategy,
        "live": live,
        "prompt_tokens": prompt,
        "step_ms": best,
        "us_per_request": 1e3 * best / live,
        "state_split": plan.options.state_split,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-oss-20b", help="catalog model")
    parser.add_argument("--strategies", default="uniform,arena,pools")
    parser.add_argument("--prompts", default="1000,8000,64000,200000", help="prompt tokens")
    parser.add_argument("--live", default="100,1000,10000", help="live requests")
    parser.add_argument("--repeat", type=int, default=3, help="runs per figure (best kept)")
    parser.add_argument(
        "--state-split",
        default="1",
        help="state groups cut in K for every plan (arena and pools), or auto (default: 1)",
    )
    parser.add_argument("--out", default="results/bench_scaling.json")
    args = parser.parse_args()
    try:
        model = resolve_model(args.model)
        strategies = [Strategy(s).value for s in args.strategies.split(",")]
    except (HybridKVError, ValueError) as exc:
        parser.error(str(exc))
    counts = {}
    for flag, text in (("--prompts", args.prompts), ("--live", args.live)):
        try:
            counts[flag] = [int(n) for n in text.split(",")]
        except ValueError:
            parser.error(f"{flag}: expected comma-separated integers, got {text!r}")
        if min(counts[flag]) < 1:
            parser.error(f"{flag}: every count must be at least 1, got {text!r}")
    if args.repeat < 1:
        parser.error(f"--repeat: must be at least 1, got {args.repeat}")
    if args.state_split != "auto" and not (args.state_split.isdigit() and int(args.state_split)):
        parser.error(f"--state-split: a positive integer or auto, got {args.state_split!r}")
    out = out_path(parser, args.out)
    split: int | str = "auto" if args.state_split == "auto" else int(args.state_split)
    rng = random.Random(SEED)
    prompt_rows = [
        _prompt_row(model, s, int(n), args.repeat, rng, split)
        for s in strategies
        for n in args.prompts.split(",")
    ]
    live_rows = [
        _live_row(model, s, int(n), args.repeat, rng, split)
        for s in strategies
        for n in args.live.split(",")
    ]
    print(
        f"{model.name}: one request of N tokens (CPU ms, best of {args.repeat}; us per 1k tokens)"
    )
    print(
        f"{'strategy':9} {'tokens':>7} {'hash':>8} {'lookup':>8} {'allocate':>9} {'free':>8}  "
        f"{'alloc us/1k':>11} {'free us/1k':>10} {'hit':>8} {'split':>5}"
    )
    for r in prompt_rows:
        if "error" in r:
            print(f"{r['strategy']:9} {r['tokens']:7d}  n/a: {r['error']}")
            continue
        k = r["tokens"] / 1000
        print(
            f"{r['strategy']:9} {r['tokens']:7d} {r['hash_ms']:8.2f} {r['lookup_ms']:8.2f} "
            f"{r['allocate_ms']:9.2f} {r['free_ms']:8.2f}  {1e3 * r['allocate_ms'] / k:11.1f} "
            f"{1e3 * r['free_ms'] / k:10.1f} {r['timed_hit_tokens']:8d} {r['state_split']:>5}"
        )
    print(f"\n{model.name}: a decode step over N live requests opening a block (CPU ms)")
    print(
        f"{'strategy':9} {'live':>6} {'prompt':>7} {'step ms':>9} {'us/request':>11} {'split':>5}"
    )
    for r in live_rows:
        print(
            f"{r['strategy']:9} {r['live']:6d} {r['prompt_tokens']:7d} {r['step_ms']:9.2f} "
            f"{r['us_per_request']:11.2f} {r['state_split']:>5}"
        )
    longest = max(r["tokens"] for r in prompt_rows)
    top = {r["strategy"]: r for r in prompt_rows if r["tokens"] == longest and "error" not in r}
    summary = ", ".join(
        f"{s} allocate {r['allocate_ms']:.1f} ms / free {r['free_ms']:.1f} ms"
        for s, r in top.items()
    )
    print(f"\nsummary: {longest}-token prompt: {summary}")
    meta = {
        "model": model.name,
        "seed": SEED,
        "repeat": args.repeat,
        "state_split": split,
        "python": platform.python_version(),
    }
    out.write_text(json.dumps({"meta": meta, "prompt": prompt_rows, "live": live_rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
