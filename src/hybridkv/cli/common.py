"""Options shared by the subcommands, so a flag means the same thing everywhere.

Every subcommand that takes a model, a budget or block sizes registers them here: the same
names (``--memory``, ``--max-model-len``, ``--kv-cache-dtype``, ...), the same defaults and the
same help text.  Nothing here imports torch or the planner; :func:`max_model_len_for` needs
only a spec.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from hybridkv.errors import HybridKVError
from hybridkv.specs import MAX_TOKENS

if TYPE_CHECKING:
    from hybridkv.specs import ModelSpec

__all__ = [
    "DEFAULT_MEMORY",
    "MAX_MODEL_LEN_CAP",
    "MAX_REQUESTS",
    "MAX_SEED",
    "CliInputError",
    "HelpFormatter",
    "add_block_options",
    "add_kv_cache_dtype",
    "add_max_model_len",
    "add_memory",
    "add_model",
    "add_pool_options",
    "add_tp",
    "check_at_most",
    "check_compaction",
    "check_positive",
    "check_state_options",
    "check_window_options",
    "is_zero_size",
    "max_model_len_for",
    "model_name",
    "with_flag_names",
]

#: KV-cache budget of ``plan`` and ``simulate`` when ``--memory`` is not given.  Small enough
#: that the default ``simulate`` runs under memory pressure (the point of the demo).
DEFAULT_MEMORY = "8GiB"
#: ``--max-model-len`` default: the model's own limit, capped here (tokens).
MAX_MODEL_LEN_CAP = 131072
#: The most requests one ``run`` or ``simulate`` generates (a typo of 10^11 would otherwise
#: fill the host's memory before anything is printed).
MAX_REQUESTS = 1_000_000
#: The largest ``--seed`` (torch seeds are 64-bit signed integers).
MAX_SEED = (1 << 63) - 1


class CliInputError(HybridKVError, ValueError):
    """A command-line value is invalid (names the flag, the value and what is valid)."""


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends ``(default: X)`` to an option's help unless the help already says its default
    or there is nothing to show (``None`` defaults explain themselves, flags are off)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if "default" in text or default is None or default is False or default == argparse.SUPPRESS:
            return text
        return super()._get_help_string(action)


def add_model(parser: argparse.ArgumentParser, *, default_help: str) -> None:
    """``MODEL`` (positional, optional) or ``--model``: a catalog name, id or config path."""
    text = f"catalog name, Hugging Face id or path to a config.json (default: {default_help})"
    parser.add_argument("model_pos", nargs="?", default=None, metavar="MODEL", help=text)
    parser.add_argument(
        "--model", default=None, metavar="MODEL", help="the same as MODEL (default: as MODEL)"
    )


def model_name(args: argparse.Namespace, default: str) -> str:
    """The model named by ``MODEL`` or ``--model`` (one of them), else ``default``."""
    pos, opt = args.model_pos, args.model
    if pos is not None and opt is not None and pos != opt:
        raise CliInputError(f"--model: got MODEL {pos!r} and --model {opt!r}; name the model once")
    name = pos if pos is not None else opt
    if name is not None and not str(name).strip():
        raise CliInputError(
            "--model: got an empty name; give a catalog name (hybridkv models), a path to a "
            "config.json or a Hugging Face model id"
        )
    return default if name is None else str(name)


def add_memory(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--memory",
        default=DEFAULT_MEMORY,
        metavar="SIZE",
        help="KV-cache budget, e.g. 16GiB or 500MB",
    )


def add_max_model_len(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        metavar="TOKENS",
        help=f"longest request, prompt + output (default: the model's own limit, at most "
        f"{MAX_MODEL_LEN_CAP})",
    )


def add_tp(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (one rank shown)")


def add_mtp(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--mtp",
        action="store_true",
        help="add the checkpoint's multi-token-prediction (MTP) layers to the cache, grouped "
        "with the target layers of the same spec (DeepSeek-V3, Qwen3-Next, GLM-4.5, ...)",
    )


def add_kv_cache_dtype(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--kv-cache-dtype",
        default=None,
        metavar="DTYPE",
        help="attention/MLA cache dtype: auto, bf16, fp16, fp32, fp8, fp8_e4m3, fp8_e5m2 "
        "(default: the model's dtype)",
    )


def add_block_options(
    parser: argparse.ArgumentParser,
    *,
    kernel: bool = False,
    state_default: int | None = None,
    state_why: str = "",
) -> None:
    """``--block-size``, ``--state-block-size`` and (``kernel``) ``--kernel-block-size``.

    ``state_default``: a fixed checkpoint interval (the engine's tiny models use 16), else the
    planner's default per strategy; ``state_why`` says why it differs.
    """
    state_help = (
        f"recurrent-state checkpoint interval (default: {state_default}{state_why})"
        if state_default is not None
        else "recurrent-state checkpoint interval (default: 256 for arena and pools, the "
        "unified attention block for uniform, as vLLM's align mode)"
    )
    parser.add_argument(
        "--block-size", type=int, default=16, metavar="TOKENS", help="attention block size"
    )
    if kernel:
        parser.add_argument(
            "--kernel-block-size",
            type=int,
            default=None,
            metavar="TOKENS",
            help="kernel block size, divides --block-size (default: the block size up to 16 "
            "tokens, else gcd(block size, 16): 64 gives 16, 24 gives 8, an odd size 1)",
        )
    parser.add_argument(
        "--state-block-size",
        type=int,
        default=state_default,
        metavar="TOKENS",
        help=state_help,
    )


def add_pool_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--pool-ratios",
        default=None,
        metavar="W0,W1,...",
        help="pools strategy only: one weight per group, e.g. 0.3,0.7 (default: each group's "
        "need per max-length request)",
    )
    parser.add_argument(
        "--chunk-alignment",
        default=None,
        metavar="SIZE",
        help="arena strategy only: chunks are a multiple of this size (default: 64KiB)",
    )
    parser.add_argument(
        "--state-split",
        type=_state_split,
        default="auto",
        metavar="K|auto",
        help="arena and pools: split each recurrent-state group into K groups of layers, so "
        "a state slot (and an arena chunk) is up to K times smaller; auto: 4 for an arena "
        "where fewer than 16 requests of max-model-len fit, where none fits unsplit, or where "
        "state slots of 32 MiB or more take whole chunks in fewer than 512 chunks, kept only "
        "if the cut plans as many requests and wastes at most 1%%; else 1 (default: auto; "
        "plan prints which rule applied)",
    )


def add_admission(parser: argparse.ArgumentParser) -> None:
    """``--admission`` and ``--compaction``: the scheduler's admission policy and whether it
    compacts the cache before preempting (``hybridkv.scheduler``)."""
    from hybridkv.scheduler import ADMISSION_POLICIES

    parser.add_argument(
        "--admission",
        default="reserve",
        choices=list(ADMISSION_POLICIES),
        help="the scheduler admits a waiting request once full attention can hold its whole "
        "prompt (reserve), or once its first chunk fits (greedy, as vLLM)",
    )
    parser.add_argument(
        "--compaction",
        default="on",
        choices=["on", "off"],
        help="arena: before preempting for a running request's step, move referenced blocks "
        "out of sparse chunks to free whole chunks (a device copy per block; default: on)",
    )


def _state_split(text: str) -> int | str:
    """``--state-split``: ``auto`` or an integer (range-checked by the planner)."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer or 'auto'") from None


def chunk_alignment_arg(args: argparse.Namespace, memory: int) -> int:
    """``--chunk-alignment`` in bytes (the planner's default when not given); refused with a
    strategy that has no chunks, or above the ``memory`` budget (one chunk would not fit)."""
    from hybridkv.plan.options import DEFAULT_CHUNK_ALIGNMENT
    from hybridkv.units import format_bytes, parse_bytes

    if args.chunk_alignment is None:
        return DEFAULT_CHUNK_ALIGNMENT
    arena = args.strategy in ("arena", "all")
    check_needs(args, [("chunk_alignment", "--strategy arena (or all)", arena)])
    alignment = parse_bytes(args.chunk_alignment, field="--chunk-alignment")
    if alignment > memory:
        raise CliInputError(
            f"--chunk-alignment {args.chunk_alignment}: chunks of {format_bytes(alignment)} are "
            f"larger than the whole --memory budget of {format_bytes(memory)}; give at most "
            f"that (default: {format_bytes(DEFAULT_CHUNK_ALIGNMENT)})"
        )
    return alignment


def check_state_split(args: argparse.Namespace) -> None:
    """Refuse an explicit ``--state-split`` K other than 1 with the ``uniform`` strategy,
    which never splits state groups, instead of ignoring it."""
    split = args.state_split
    if split not in ("auto", 1) and args.strategy == "uniform":
        raise CliInputError(
            f"--state-split {split}: only applies with --strategy arena, pools or all"
        )


def check_state_options(args: argparse.Namespace, model: ModelSpec, names: Iterable[str]) -> None:
    """Refuse the first option of ``names`` given (not None, not ``"auto"``) for a model with
    no recurrent-state layers, which it would not change, instead of ignoring it."""
    from hybridkv.specs import CacheKind

    _check_kind_options(
        args, model, names, frozenset({CacheKind.STATE}), "models with recurrent-state layers"
    )


def check_window_options(
    args: argparse.Namespace, model: ModelSpec, names: Iterable[str], defaults: Mapping[str, Any]
) -> None:
    """Refuse the first option of ``names`` given (not None and not its default in
    ``defaults``) for a model with no sliding-window or chunked-local layers, which it would
    not change, instead of ignoring it."""
    from hybridkv.specs.kinds import WINDOW_KINDS

    what = "models with sliding-window or chunked-local layers"
    _check_kind_options(args, model, names, WINDOW_KINDS, what, defaults)


def _check_kind_options(
    args: argparse.Namespace,
    model: ModelSpec,
    names: Iterable[str],
    kinds: frozenset[Any],
    what: str,
    defaults: Mapping[str, Any] | None = None,
) -> None:
    if any(e.spec.kind in kinds for e in model.entries()):
        return
    for name in names:
        value = getattr(args, name)
        default = (defaults or {}).get(name)
        if value is not None and value != "auto" and value != default:
            flag = "--" + name.replace("_", "-")
            raise CliInputError(f"{flag} {value}: only applies to {what}; {model.name} has none")


def check_compaction(args: argparse.Namespace, *, with_all: bool = True) -> None:
    """Refuse ``--compaction off`` with a strategy that has no chunks to compact (``uniform``,
    ``pools``), where it would change nothing, instead of ignoring it (``with_all``: the
    command also takes ``--strategy all``)."""
    if args.compaction == "off" and args.strategy not in ("arena", "all"):
        arena = "arena (or all)" if with_all else "arena"
        raise CliInputError(
            f"--compaction off: only applies with --strategy {arena}, which compacts chunks; "
            f"--strategy {args.strategy} has none"
        )


def check_needs(args: argparse.Namespace, needs: Iterable[tuple[str, str, bool]]) -> None:
    """Raise :class:`CliInputError` for the first option ``name`` that was given (not None)
    while what it applies with (``what``, present when ``present``) is absent, instead of
    ignoring it."""
    for name, what, present in needs:
        value = getattr(args, name)
        if value is not None and not present:
            flag = "--" + name.replace("_", "-")
            raise CliInputError(f"{flag} {value}: only applies with {what}")


def check_positive(args: argparse.Namespace, names: Iterable[str]) -> None:
    """Raise :class:`CliInputError` for the first ``args.<name>`` that is set and < 1."""
    for name in names:
        value = getattr(args, name)
        if isinstance(value, int) and value < 1:
            flag = "--" + name.replace("_", "-")
            raise CliInputError(f"{flag}: must be a positive integer, got {value}")


def check_at_most(args: argparse.Namespace, caps: Iterable[tuple[str, int, str]]) -> None:
    """Raise :class:`CliInputError` for the first ``args.<name>`` that is set and above its
    cap; each item is ``(name, cap, why)``."""
    for name, cap, why in caps:
        value = getattr(args, name)
        if isinstance(value, int) and value > cap:
            flag = "--" + name.replace("_", "-")
            raise CliInputError(f"{flag}: must be at most {cap} ({why}), got {value}")


def max_model_len_for(
    spec: ModelSpec, requested: int | None, command: str = "", *, warn: bool = True
) -> int:
    """``requested``, or the model's own limit capped at :data:`MAX_MODEL_LEN_CAP`.  A
    ``requested`` length beyond the model's own limit is planned for, with a warning line on
    stderr unless ``warn`` is off (``command``: the subcommand it names): the model never runs
    here, but a plan for lengths it cannot serve is most likely a mistake."""
    limit = spec.max_position_embeddings
    if requested is not None:
        # Past MAX_TOKENS the plan refuses the length with its own error: no warning first.
        if warn and limit is not None and limit < requested <= MAX_TOKENS:
            prog = f"hybridkv {command}" if command else "hybridkv"
            print(
                f"{prog}: warning: --max-model-len {requested} is above {spec.name}'s own "
                f"limit of {limit} positions (max_position_embeddings)",
                file=sys.stderr,
            )
        return requested
    if limit is None:
        if warn:
            prog = f"hybridkv {command}" if command else "hybridkv"
            print(
                f"{prog}: note: {spec.name}'s config names no max_position_embeddings; "
                f"planning for {MAX_MODEL_LEN_CAP} tokens (give --max-model-len)",
                file=sys.stderr,
            )
        return MAX_MODEL_LEN_CAP
    return min(limit, MAX_MODEL_LEN_CAP)


#: Library field names (what typed errors name) -> the flag that sets them on the command line.
FIELD_FLAGS: dict[str, str] = {
    "memory_bytes": "--memory",
    "max_model_len": "--max-model-len",
    "block_size": "--block-size",
    "kernel_block_size": "--kernel-block-size",
    "state_block_size": "--state-block-size",
    "pool_ratios": "--pool-ratios",
    "chunk_alignment": "--chunk-alignment",
    "state_split": "--state-split",
    "kv_cache_dtype": "--kv-cache-dtype",
    "tp_size": "--tp",
    "host_memory_bytes": "--host-memory",
    "disk_memory_bytes": "--disk-memory",
    "eviction": "--eviction",
}


def is_zero_size(text: str) -> bool:
    """Whether the size ``text`` is zero in any unit (``0``, ``0GiB``, ``0.0 TB``: a tier
    option's "none"); False for text that is no size, which its option's parse then refuses."""
    from hybridkv.units import SizeError, parse_bytes

    try:
        return parse_bytes(text, allow_zero=True) == 0
    except SizeError:
        return False


def with_flag_names(message: str) -> str:
    """``message`` with a leading library field name (``memory_bytes: ...``) replaced by the
    command-line flag that sets it (``--memory: ...``); other messages are unchanged."""
    field, sep, rest = message.partition(": ")
    flag = FIELD_FLAGS.get(field) if sep else None
    return f"{flag}: {rest}" if flag is not None else message
