"""``hybridkv run``: generate with a model through the paged hybrid cache, and check it.

By default: the built-in tiny hybrid model (short conv + sliding + full attention, random
weights), eight prompts sharing a 32-token prefix, admitted in two waves so the second finds
the prefix cached.  ``--prompts FILE`` reads one prompt per line (text when the model
directory has a tokenizer, else whitespace-separated token ids).  ``--verify`` re-runs every
request through transformers' own ``generate`` and exits 1 on any token mismatch.

Outputs go to stdout, progress to stderr.  Bad input (unknown model, config-less directory,
unmapped architecture, empty prompt file, prompt too long) is a one-line error and exit 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hybridkv.errors import HybridKVError

if TYPE_CHECKING:
    from hybridkv.engine import Completion, EngineStats, LLMEngine, VerifyResult

DEFAULT_MODEL = "lfm3"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


class RunInputError(HybridKVError, ValueError):
    """A bad ``hybridkv run`` option or prompt file."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        metavar="NAME|PATH",
        help="a built-in tiny model or a checkpoint directory (default: lfm3, a tiny "
        "conv + sliding + full attention hybrid with random weights)",
    )
    parser.add_argument("--prompts", metavar="FILE", help="one prompt per line")
    parser.add_argument(
        "--num-requests",
        type=int,
        default=None,
        help="requests to run (default: 8 generated prompts, or every line of --prompts, "
        "cycled when fewer)",
    )
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens per request (16)")
    parser.add_argument(
        "--waves", type=int, default=2, help="admit requests in this many waves (default 2)"
    )
    parser.add_argument(
        "--shared-prefix", type=int, default=32, help="shared tokens of the generated prompts"
    )
    parser.add_argument("--verify", action="store_true", help="compare with transformers")
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument("--memory", default=None, help="cache budget, e.g. 64MiB (default)")
    budget.add_argument("--num-blocks", type=int, default=None, help="blocks per group")
    parser.add_argument("--strategy", default="arena", choices=("arena", "pools", "uniform"))
    parser.add_argument("--block-size", type=int, default=16, help="attention block (tokens)")
    parser.add_argument("--kernel-block-size", type=int, default=None)
    parser.add_argument(
        "--state-block-size", type=int, default=16, help="state checkpoint interval (16)"
    )
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--token-budget", type=int, default=256, help="tokens per step (256)")
    parser.add_argument("--max-num-seqs", type=int, default=64, help="running requests (64)")
    parser.add_argument("--seed", type=int, default=0, help="tiny-model weights and prompts")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads for torch (default: 1 for a tiny model, whose matrices are too "
        "small to gain from more; torch's default otherwise)",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")


def _positive(args: argparse.Namespace) -> None:
    for name in (
        "num_requests",
        "max_tokens",
        "waves",
        "num_blocks",
        "block_size",
        "kernel_block_size",
        "state_block_size",
        "max_model_len",
        "token_budget",
        "max_num_seqs",
        "threads",
    ):
        value = getattr(args, name)
        if value is not None and value < 1:
            flag = "--" + name.replace("_", "-")
            raise RunInputError(f"{flag}: must be a positive integer, got {value}")
    if args.shared_prefix < 0:
        raise RunInputError(f"--shared-prefix: must be >= 0, got {args.shared_prefix}")


def _tokenizer(model: str) -> Any:
    path = Path(model)
    if not any((path / name).is_file() for name in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def read_prompts(path: str, tokenizer: Any) -> list[list[int]]:
    """Prompts of ``path``, one per non-blank line: encoded text with ``tokenizer``, else
    whitespace-separated token ids.  Raises :class:`RunInputError` naming the file (and line)
    for a missing or empty file or a line that is not token ids."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise RunInputError(f"--prompts: cannot read {path!r}: {exc.strerror}") from None
    prompts: list[list[int]] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        if tokenizer is not None:
            prompts.append(list(tokenizer(line)["input_ids"]))
            continue
        try:
            prompts.append([int(t) for t in line.split()])
        except ValueError:
            bad = next(t for t in line.split() if not t.lstrip("-").isdigit())
            raise RunInputError(
                f"--prompts: {path}:{number}: {bad!r} is not a token id; the model has no "
                "tokenizer, so each line must hold whitespace-separated integer token ids"
            ) from None
    if not prompts:
        raise RunInputError(f"--prompts: {path!r} holds no prompt (one prompt per line)")
    return prompts


def _eos_ids(model: Any) -> list[int]:
    config = getattr(model, "generation_config", None) or model.config
    eos = getattr(config, "eos_token_id", None)
    if eos is None:
        return []
    return [int(e) for e in eos] if isinstance(eos, list | tuple) else [int(eos)]


def _build(args: argparse.Namespace) -> LLMEngine:
    from hybridkv.engine import CacheConfig, LLMEngine
    from hybridkv.scheduler import SchedulerConfig
    from hybridkv.units import parse_bytes

    memory = None if args.memory is None else parse_bytes(args.memory, field="--memory")
    cache = CacheConfig(
        strategy=args.strategy,
        memory_bytes=memory,
        num_blocks=args.num_blocks,
        block_size=args.block_size,
        kernel_block_size=args.kernel_block_size,
        state_block_size=args.state_block_size,
        max_model_len=args.max_model_len,
    )
    scheduler = SchedulerConfig(token_budget=args.token_budget, max_num_seqs=args.max_num_seqs)
    return LLMEngine(
        args.model,
        cache=cache,
        scheduler=scheduler,
        device=args.device,
        seed=args.seed,
        keep_logits=args.verify,
    )


def _describe(engine: LLMEngine) -> list[str]:
    from hybridkv.units import format_bytes

    layout = engine.layout
    lines = [
        f"model {engine.name} ({engine.spec.model_type}): {layout.strategy.value} layout, "
        f"{format_bytes(engine.plan.memory_bytes)} budget, max_model_len "
        f"{engine.max_model_len}, schedule alignment {layout.schedule_alignment} tokens"
    ]
    for g in layout.groups:
        layers = ",".join(str(layer) for layer in g.layers)
        lines.append(
            f"  group {g.group_id} {g.spec.kind.value}: layers {layers}, block {g.block_size} "
            f"tokens (kernel {g.kernel_block_size}), {format_bytes(g.block_bytes)} per block"
        )
    return lines


def _output_line(c: Completion, tokenizer: Any) -> str:
    text = (
        repr(tokenizer.decode(list(c.token_ids), skip_special_tokens=True))
        if tokenizer is not None
        else " ".join(str(t) for t in c.token_ids)
    )
    notes = [f"{len(c.prompt_token_ids)} prompt tokens", f"{c.num_cached_tokens} cached"]
    if c.num_preemptions:
        notes.append(f"preempted {c.num_preemptions}x")
    notes.append(c.finish_reason.value)
    return f"{c.request_id} ({', '.join(notes)}): {text}"


def _per_group(labels: tuple[str, ...], values: tuple[Any, ...], fmt: str = "{}") -> str:
    return ", ".join(f"{label} {fmt.format(v)}" for label, v in zip(labels, values, strict=True))


def _summary(stats: EngineStats, num_requests: int) -> list[str]:
    from hybridkv.cli.format import percent

    windowed = [
        (label, n)
        for label, n in zip(stats.groups, stats.window_blocks_released, strict=True)
        if label.split(":")[1] in ("sliding_window", "chunked_local")
    ]
    lines = [
        f"{num_requests} requests: {stats.generated_tokens} tokens generated in "
        f"{stats.seconds:.2f} s ({stats.tokens_per_second:.1f} tokens/s), {stats.steps} steps, "
        f"{stats.forward_passes} forward passes, up to {stats.max_batch_requests} requests "
        "per step",
        f"prefix cache: {stats.prefix_hit_tokens} of {stats.admitted_tokens} admitted prompt "
        f"tokens served from the cache ({percent(stats.hit_rate, 1)})",
        "  hit rate per group (what each group alone could serve, of "
        f"{stats.query_tokens} queried tokens): "
        + ", ".join(
            f"{label} {percent(rate, 1)}"
            for label, rate in zip(stats.groups, stats.group_hit_rates, strict=True)
        ),
        f"peak blocks per group: {_per_group(stats.groups, stats.peak_blocks)}",
    ]
    if windowed:
        lines.append(
            "window blocks released: " + ", ".join(f"{label} {n}" for label, n in windowed)
        )
    lines.append(f"preemptions: {stats.preemptions}")
    return lines


def _verify_lines(result: VerifyResult) -> list[str]:
    diff = (
        "" if result.max_logit_diff is None else f" (max |logit diff| {result.max_logit_diff:.1e})"
    )
    if result.ok:
        return [
            f"verify: all {result.num_requests} requests ({result.num_tokens} tokens) identical "
            f"to transformers' generate{diff}"
        ]
    lines = [
        f"verify: {len(result.mismatches)} of {result.num_requests} requests DIFFER from "
        f"transformers' generate{diff}"
    ]
    for m in result.mismatches:
        lines.append(
            f"  {m.request_id}: first difference at output token {m.position}: engine "
            f"{m.got}, transformers {m.want}"
        )
    return lines


def run(args: argparse.Namespace) -> int:
    from hybridkv.cli.progress import Progress
    from hybridkv.engine import verify_completions
    from hybridkv.engine.demo import run_in_waves, shared_prefix_prompts
    from hybridkv.engine.models import TINY_MODELS, load_model

    _positive(args)
    threads = args.threads or (1 if args.model in TINY_MODELS else None)
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    tokenizer = None if args.model in TINY_MODELS else _tokenizer(args.model)
    file_prompts = None if args.prompts is None else read_prompts(args.prompts, tokenizer)
    if not args.quiet:
        print(f"loading {args.model} ...", file=sys.stderr)
    engine = _build(args)
    if file_prompts is None:
        prompts = shared_prefix_prompts(
            args.num_requests or 8,
            vocab_size=engine.vocab_size,
            shared_prefix=args.shared_prefix,
            seed=args.seed,
        )
    else:
        n = args.num_requests or len(file_prompts)
        prompts = [file_prompts[i % len(file_prompts)] for i in range(n)]
    eos = _eos_ids(engine.model)
    for line in _describe(engine):
        print(line)
    bar = Progress("run", enabled=not args.quiet)
    try:
        done = run_in_waves(
            engine,
            prompts,
            max_tokens=args.max_tokens,
            waves=args.waves,
            eos_token_ids=eos,
            progress=bar,
        )
    finally:
        bar.close()
    for c in done:
        print(_output_line(c, tokenizer))
    for line in _summary(engine.stats(), len(done)):
        print(line)
    if not args.verify:
        return 0
    if not args.quiet:
        print("verifying with transformers' generate ...", file=sys.stderr)
    reference = load_model(args.model, seed=args.seed).to(args.device)
    result = verify_completions(reference, done, eos)
    for line in _verify_lines(result):
        print(line)
    return 0 if result.ok else 1
