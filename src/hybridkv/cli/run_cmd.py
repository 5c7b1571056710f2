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

from hybridkv.cli.common import add_block_options
from hybridkv.errors import HybridKVError

if TYPE_CHECKING:
    from hybridkv.engine import Completion, EngineStats, LLMEngine, VerifyResult

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
#: What the engine extra brings; ``hybridkv run`` needs both.
_ENGINE_MODULES = ("torch", "transformers")


class RunInputError(HybridKVError, ValueError):
    """A bad ``hybridkv run`` option or prompt file."""


def _tiny_model_lines() -> list[str]:
    from hybridkv.models.tiny import TINY_MODELS

    width = max(len(name) for name in TINY_MODELS)
    return [f"{name.ljust(width)}  {m.description}" for name, m in TINY_MODELS.items()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from hybridkv.models.tiny import DEFAULT_TINY_MODEL, TINY_MODELS

    parser.add_argument(
        "--model",
        default=DEFAULT_TINY_MODEL,
        metavar="NAME|DIR",
        help="a built-in tiny model with random weights ("
        + ", ".join(TINY_MODELS)
        + "; --list-models describes them) or a checkpoint directory (config.json + "
        "safetensors)",
    )
    parser.add_argument(
        "--list-models",
        action="store_true",
        help="list the built-in tiny models and what their layers cache, then exit",
    )
    parser.add_argument(
        "--prompts",
        metavar="FILE",
        help="one prompt per line, plain text or gzip: text when the model directory has a "
        "tokenizer, else whitespace-separated token ids (default: generated prompts sharing "
        "--shared-prefix tokens)",
    )
    parser.add_argument(
        "--num-requests",
        type=int,
        default=None,
        metavar="N",
        help="requests to run (default: 8 generated prompts, or every line of --prompts, "
        "cycled when fewer)",
    )
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens per request")
    parser.add_argument(
        "--waves", type=int, default=2, help="admit the requests in this many waves"
    )
    parser.add_argument(
        "--shared-prefix",
        type=int,
        default=32,
        metavar="TOKENS",
        help="shared tokens of the generated prompts",
    )
    parser.add_argument(
        "--verify",
        action="store_true",
        help="re-run every request with transformers' generate and exit 1 on any difference",
    )
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument(
        "--memory",
        default=None,
        metavar="SIZE",
        help="KV-cache budget, e.g. 16MiB (default: 64MiB)",
    )
    budget.add_argument(
        "--num-blocks",
        type=int,
        default=None,
        metavar="N",
        help="instead of --memory: room for N blocks of every group (default: from --memory)",
    )
    parser.add_argument(
        "--strategy",
        default="arena",
        choices=("arena", "uniform", "pools"),
        help="memory layout",
    )
    add_block_options(parser, kernel=True, state_default=16)
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        metavar="TOKENS",
        help="longest request, prompt + output (default: the model's own limit, at most 2048)",
    )
    parser.add_argument(
        "--token-budget", type=int, default=256, metavar="TOKENS", help="tokens per step"
    )
    parser.add_argument(
        "--max-num-seqs", type=int, default=64, metavar="N", help="running requests at most"
    )
    parser.add_argument("--seed", type=int, default=0, help="tiny-model weights and prompts")
    parser.add_argument("--device", default="cpu", help="torch device: cpu, cuda or cuda:N")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads for torch (default: 1 for a tiny model, whose matrices are too "
        "small to gain from more; torch's default otherwise)",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")


def _check_engine_extra() -> None:
    import importlib

    missing = []
    for name in _ENGINE_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise RunInputError(
            f"needs the engine extra ({', '.join(missing)} not installed): "
            "pip install 'hybridkv[engine]'"
        )


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


def _prompt_lines(path: str) -> list[str]:
    """The lines of a UTF-8 text file, gzip-compressed or not; one-line errors otherwise."""
    import gzip

    file = Path(path)
    try:
        data = file.read_bytes()
    except IsADirectoryError:
        raise RunInputError(
            f"--prompts: {path!r} is a directory; give a text file, one prompt per line"
        ) from None
    except OSError as exc:
        raise RunInputError(f"--prompts: cannot read {path!r}: {exc.strerror}") from None
    if data[:2] == b"\x1f\x8b":
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError) as exc:
            raise RunInputError(f"--prompts: {path!r} is a broken gzip file: {exc}") from None
    try:
        return data.decode("utf-8").splitlines()
    except UnicodeDecodeError as exc:
        raise RunInputError(
            f"--prompts: {path!r} is not UTF-8 text (byte {exc.start}); give a text file, "
            "one prompt per line (gzip allowed)"
        ) from None


def read_prompts(path: str, tokenizer: Any) -> list[list[int]]:
    """Prompts of ``path`` (UTF-8 text, optionally gzip-compressed), one per non-blank line:
    encoded text with ``tokenizer``, else whitespace-separated token ids.  Raises
    :class:`RunInputError` naming the file (and line) for a missing, unreadable, binary or
    empty file or a line that is not token ids."""
    lines = _prompt_lines(path)
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


def _list_models() -> int:
    from hybridkv.models.tiny import DEFAULT_TINY_MODEL

    print("built-in tiny models (random weights, a few layers; hybridkv run --model NAME):")
    for line in _tiny_model_lines():
        print(f"  {line}")
    print(f"default: {DEFAULT_TINY_MODEL}; or give a checkpoint directory")
    return 0


def run(args: argparse.Namespace) -> int:
    if args.list_models:
        return _list_models()
    _positive(args)
    if args.memory is not None:
        from hybridkv.units import parse_bytes

        parse_bytes(args.memory, field="--memory")
    _check_engine_extra()

    from hybridkv.cli.progress import Progress
    from hybridkv.engine import verify_completions
    from hybridkv.engine.demo import run_in_waves, shared_prefix_prompts
    from hybridkv.engine.device import resolve_device
    from hybridkv.engine.models import TINY_MODELS, load_model

    resolve_device(args.device)
    if args.model not in TINY_MODELS and not Path(args.model).is_dir():
        raise RunInputError(
            f"--model: {args.model!r} is neither a built-in tiny model ("
            + ", ".join(TINY_MODELS)
            + "; see --list-models) nor a checkpoint directory"
        )
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
