"""Generation throughput: hybridkv's LLMEngine against transformers' ``generate``.

The same seeded requests (``--num-requests`` prompts sharing a ``--shared-prefix``-token
system prompt, then suffixes of mixed lengths; ``--max-tokens`` greedy tokens each, no EOS)
run three ways on one model:

* ``engine``: :class:`hybridkv.engine.LLMEngine`, every request queued at once; continuous
  batching, chunked prefill under ``--token-budget``, prefix caching over the paged cache;
* ``hf_sequential``: transformers' ``generate`` on each prompt alone (batch of one), the
  exactness reference: the engine's tokens are compared with it;
* ``hf_batched``: transformers' ``generate`` on all prompts as one left-padded batch (its
  fastest simple mode; padding changes its numerics, so its tokens are not compared).

Each mode runs once to warm up, then ``--repeats`` times; the fastest repeat is reported (a
shared machine adds noise, never speed).  The engine is built afresh (empty prefix cache)
before each run, outside the timed region.  Throughput is generated tokens per second of
wall time, and per second of process CPU time (less sensitive to other processes; with
``--threads 1`` the two agree on an idle machine).

The model is a built-in tiny one (random weights, float32) whose config ``--override``
``KEY=VALUE`` (JSON values) can enlarge, or a checkpoint directory.  On CUDA
(``--device cuda``) timings synchronise the device.

Usage::

    python benchmarks/bench_engine.py                                  # tiny lfm3 on CPU
    python benchmarks/bench_engine.py --override hidden_size=256 --override intermediate_size=512
    python benchmarks/bench_engine.py --device cuda --num-requests 64
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from hybridkv.engine import CacheConfig, LLMEngine
from hybridkv.engine.demo import shared_prefix_prompts
from hybridkv.engine.models import TINY_MODELS, load_model, tiny_config
from hybridkv.errors import HybridKVError
from hybridkv.scheduler import SchedulerConfig

from bench_cli import at_least, out_path


def _parse_override(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--override: expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def _model(args: argparse.Namespace) -> Any:
    """The benchmark model on ``args.device`` (tiny models built from their config plus the
    overrides, with seeded weights)."""
    if args.model not in TINY_MODELS:
        return load_model(args.model).to(args.device)
    from transformers import AutoModelForCausalLM

    config = tiny_config(args.model)
    for key, value in args.override:
        setattr(config, key, value)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(args.seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.eval().to(args.device)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


Outcome = tuple[list[list[int]], dict[str, Any]]


def _timed(
    fn: Callable[[Any], Outcome], setup: Callable[[], Any], device: str
) -> tuple[Outcome, float, float]:
    """``fn(setup())``, the wall seconds and process CPU seconds of ``fn`` alone."""
    state = setup()
    _sync(device)
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn(state)
    _sync(device)
    return out, time.perf_counter() - wall, time.process_time() - cpu


def new_engine(model: Any, args: argparse.Namespace) -> LLMEngine:
    """A fresh engine (empty prefix cache); built outside the timed region (transformers'
    side has no such setup)."""
    return LLMEngine(
        model,
        cache=CacheConfig(
            memory_bytes=args.memory_mib << 20,
            block_size=args.block_size,
            state_block_size=args.state_block_size,
            max_model_len=args.max_model_len,
        ),
        scheduler=SchedulerConfig(token_budget=args.token_budget, max_num_seqs=args.max_num_seqs),
    )


def run_engine(engine: LLMEngine, prompts: list[list[int]], args: argparse.Namespace) -> Outcome:
    """``engine`` generating every prompt; tokens and its stats."""
    done = engine.generate(prompts, max_tokens=args.max_tokens)
    stats = engine.stats()
    info = {
        "steps": stats.steps,
        "forward_passes": stats.forward_passes,
        "max_batch_requests": stats.max_batch_requests,
        "prefix_hit_tokens": stats.prefix_hit_tokens,
        "computed_tokens": stats.computed_tokens,
        "model_seconds": stats.model_seconds,
        "peak_blocks": list(stats.peak_blocks),
        "groups": list(stats.groups),
    }
    return [list(c.token_ids) for c in done], info


def _generate(model: Any, ids: torch.Tensor, mask: torch.Tensor, n: int) -> torch.Tensor:
    with torch.no_grad():
        out: torch.Tensor = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )
    return out


def run_hf_sequential(model: Any, prompts: list[list[int]], n: int, device: str) -> list[list[int]]:
    out = []
    for p in prompts:
        ids = torch.tensor([p], device=device)
        seq = _generate(model, ids, torch.ones_like(ids), n)
        out.append([int(t) for t in seq[0, len(p) :]])
    return out


def run_hf_batched(model: Any, prompts: list[list[int]], n: int, device: str) -> list[list[int]]:
    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long, device=device)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding
        ids[i, width - len(p) :] = torch.tensor(p, device=device)
        mask[i, width - len(p) :] = 1
    seq = _generate(model, ids, mask, n)
    return [[int(t) for t in row[width:]] for row in seq]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="lfm3", help="tiny model name or checkpoint dir")
    parser.add_argument("--override", type=_parse_override, action="append", default=[])
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--shared-prefix", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--state-block-size", type=int, default=16)
    parser.add_argument("--memory-mib", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=256)
    parser.add_argument("--token-budget", type=int, default=512)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (1)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="results/bench_engine.json")
    args = parser.parse_args(argv)
    for flag in (
        "num_requests",
        "max_tokens",
        "block_size",
        "state_block_size",
        "memory_mib",
        "max_model_len",
        "token_budget",
        "max_num_seqs",
        "repeats",
        "threads",
    ):
        at_least(parser, "--" + flag.replace("_", "-"), getattr(args, flag))
    at_least(parser, "--shared-prefix", args.shared_prefix, 0)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available")
    if args.override and args.model not in TINY_MODELS:
        parser.error(
            f"--override: applies to the built-in tiny models ({', '.join(sorted(TINY_MODELS))}) "
            f"only, not to {args.model!r}"
        )
    if args.override:
        fields = tiny_config(args.model).to_dict()
        for key, _ in args.override:
            if key not in fields:
                parser.error(f"--override {key}: {args.model}'s config has no field {key!r}")
    out_path(parser, args.out)
    torch.set_num_threads(args.threads)

    try:
        model = _model(args)
    except HybridKVError as exc:
        parser.error(str(exc))
    reference = copy.deepcopy(model)  # the engine switches `model` to paged attention
    vocab = int(model.config.get_text_config(decoder=True).vocab_size)
    prompts = shared_prefix_prompts(
        args.num_requests, vocab_size=vocab, shared_prefix=args.shared_prefix, seed=args.seed
    )
    n, dev = args.max_tokens, args.device

    def nothing() -> None:
        return None

    # each mode: its untimed setup, and the timed run given what the setup returned
    modes: dict[str, tuple[Callable[[], Any], Callable[[Any], Outcome]]] = {
        "engine": (lambda: new_engine(model, args), lambda e: run_engine(e, prompts, args)),
        "hf_sequential": (nothing, lambda _: (run_hf_sequential(reference, prompts, n, dev), {})),
        "hf_batched": (nothing, lambda _: (run_hf_batched(reference, prompts, n, dev), {})),
    }
    results: dict[str, Any] = {}
    tokens: dict[str, list[list[int]]] = {}
    generated = n * len(prompts)
    for name, (setup, fn) in modes.items():
        fn(setup())  # warm-up
        best: dict[str, Any] | None = None
        for _ in range(args.repeats):
            (out, info), wall, cpu = _timed(fn, setup, dev)
            if best is None or wall < best["wall_seconds"]:
                tokens[name] = out
                best = {"wall_seconds": wall, "cpu_seconds": cpu, **info}
        assert best is not None
        best["tokens_per_second"] = generated / best["wall_seconds"]
        best["tokens_per_cpu_second"] = generated / best["cpu_seconds"]
        results[name] = best
    matches = tokens["engine"] == tokens["hf_sequential"]
    summary = {
        "model": args.model,
        "overrides": dict(args.override),
        "device": dev,
        "threads": args.threads,
        "num_requests": len(prompts),
        "prompt_tokens": sum(len(p) for p in prompts),
        "generated_tokens": generated,
        "engine_matches_hf_sequential": matches,
        "speedup_vs_hf_sequential": results["engine"]["tokens_per_second"]
        / results["hf_sequential"]["tokens_per_second"],
        "speedup_vs_hf_batched": results["engine"]["tokens_per_second"]
        / results["hf_batched"]["tokens_per_second"],
        "modes": results,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "args": {k: v for k, v in vars(args).items() if k != "override"},
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=1), encoding="utf-8")
    for name, r in results.items():
        print(
            f"{name:>14}: {r['tokens_per_second']:8.1f} tok/s wall ({r['wall_seconds']:.3f} s), "
            f"{r['tokens_per_cpu_second']:8.1f} tok/s cpu"
        )
    e = results["engine"]
    print(
        f"{args.model} on {dev}, {len(prompts)} requests x {n} tokens: engine "
        f"{summary['speedup_vs_hf_sequential']:.2f}x hf_sequential, "
        f"{summary['speedup_vs_hf_batched']:.2f}x hf_batched; {e['steps']} steps, "
        f"{e['prefix_hit_tokens']} prefix-hit tokens; tokens identical to hf_sequential: "
        f"{matches}; wrote {out}"
    )
    return 0 if matches else 1


if __name__ == "__main__":
    raise SystemExit(main())
