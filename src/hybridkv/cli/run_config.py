"""``hybridkv run``'s cache and scheduler settings from its flags, checked before the model
loads: one-line :class:`~hybridkv.cli.run_prompts.RunInputError` naming the flag."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from hybridkv.cli.common import (
    MAX_REQUESTS,
    MAX_SEED,
    check_at_most,
    check_compaction,
    check_needs,
    is_zero_size,
)
from hybridkv.cli.run_prompts import RunInputError
from hybridkv.errors import HybridKVError

if TYPE_CHECKING:
    from hybridkv.engine import CacheConfig
    from hybridkv.scheduler import SchedulerConfig

__all__ = ["check_device", "check_model_limits", "check_numbers", "configs", "flagged"]

#: Default ``--memory`` of ``run`` (the engine's own default budget).
DEFAULT_MEMORY = "64MiB"

#: The most CPU threads ``--threads`` may ask torch for.
MAX_THREADS = 1024

#: Plan/cache fields in error messages -> the ``run`` flag that sets them.
_FIELD_FLAGS = {
    "memory_bytes": "--memory",
    "max_model_len": "--max-model-len",
    "block_size": "--block-size",
    "kernel_block_size": "--kernel-block-size",
    "state_block_size": "--state-block-size",
    "strategy": "--strategy",
    "host_memory_bytes": "--host-memory",
    "disk_memory_bytes": "--disk-memory",
    "write_through": "--write-through",
}


def check_numbers(args: argparse.Namespace) -> None:
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
        "prefill_tp",
        "decode_tp",
    ):
        value = getattr(args, name)
        if value is not None and value < 1:
            flag = "--" + name.replace("_", "-")
            raise RunInputError(f"{flag}: must be a positive integer, got {value}")
    if args.shared_prefix < 0:
        raise RunInputError(f"--shared-prefix: must be >= 0, got {args.shared_prefix}")
    from hybridkv.engine.demo import DEFAULT_SHARED_PREFIX

    if args.prompts is not None and args.shared_prefix != DEFAULT_SHARED_PREFIX:
        raise RunInputError(
            f"--shared-prefix {args.shared_prefix}: only applies to the generated prompts, "
            f"not with --prompts {args.prompts}"
        )
    from hybridkv.specs import MAX_TOKENS

    if not 0 <= args.attention_sinks <= MAX_TOKENS:
        raise RunInputError(
            f"--attention-sinks: must be an integer in [0, {MAX_TOKENS}], got "
            f"{args.attention_sinks}"
        )
    if not 0 <= args.seed <= MAX_SEED:
        raise RunInputError(f"--seed: must be an integer in [0, {MAX_SEED}], got {args.seed}")
    check_at_most(
        args,
        [
            ("num_requests", MAX_REQUESTS, "requests one run generates"),
            ("threads", MAX_THREADS, "torch's CPU threads"),
        ],
    )
    from hybridkv.engine.speculative import MAX_DRAFT_TOKENS

    if args.speculate is not None and not 0 <= args.speculate <= MAX_DRAFT_TOKENS:
        raise RunInputError(
            f"--speculate: must be an integer in [0, {MAX_DRAFT_TOKENS}] (0: off), got "
            f"{args.speculate}"
        )
    check_needs(
        args,
        [(name, "--disaggregate", args.disaggregate) for name in ("prefill_tp", "decode_tp")],
    )
    check_compaction(args, with_all=False)


def check_model_limits(args: argparse.Namespace, config: Any) -> None:
    """Checks against the model's transformers ``config``, before its weights load: a
    ``--max-model-len`` beyond its positions, ``--attention-sinks`` on a model whose config
    names no sliding-window layer."""
    from hybridkv.engine.model_source import default_max_model_len, position_limit

    text = config.get_text_config(decoder=True)
    limit = position_limit(config)
    if args.max_model_len is not None and limit is not None and args.max_model_len > limit:
        raise RunInputError(
            f"--max-model-len {args.max_model_len}: above {args.model}'s own limit of {limit} "
            "positions (max_position_embeddings); give at most that"
        )

    max_len = args.max_model_len or default_max_model_len(config)
    if args.attention_sinks >= max_len:
        raise RunInputError(
            f"--attention-sinks {args.attention_sinks}: {args.attention_sinks} sink tokens cover "
            f"every position of max_model_len {max_len}, so no sliding-window block could ever "
            f"leave the window; give fewer than {max_len}"
        )
    types = getattr(text, "layer_types", None) or ()
    sliding = "sliding_attention" in types or getattr(text, "sliding_window", None) is not None
    if args.attention_sinks and not sliding:  # the engine's probe decides the other cases
        kinds = "layer types " + ", ".join(sorted(set(types))) if types else "no sliding_window"
        raise RunInputError(
            f"--attention-sinks {args.attention_sinks}: sink tokens need sliding-window layers; "
            f"{args.model} has {kinds}"
        )


def flagged(exc: HybridKVError, args: argparse.Namespace) -> RunInputError:
    """``exc`` with its leading field name (``memory_bytes: ...``,
    ``SchedulerConfig.token_budget: ...``) replaced by the ``run`` flag that sets it."""
    text = str(exc)
    field, sep, rest = text.partition(": ")
    config_field = field.removeprefix("CacheConfig.").removeprefix("SchedulerConfig.")
    if not sep:
        return RunInputError(text)
    if config_field == "memory_bytes" and args.num_blocks is not None:
        return RunInputError(f"--num-blocks {args.num_blocks}: a budget of {rest}")
    flag = _FIELD_FLAGS.get(config_field)
    if flag is None and config_field != field and config_field.isidentifier():
        flag = "--" + config_field.replace("_", "-")
    return RunInputError(f"{flag}: {rest}" if flag is not None else text)


def configs(args: argparse.Namespace) -> tuple[CacheConfig, SchedulerConfig]:
    from hybridkv.engine import CacheConfig
    from hybridkv.scheduler import SchedulerConfig
    from hybridkv.units import parse_bytes

    memory = None if args.memory is None else parse_bytes(args.memory, field="--memory")
    host = None
    if args.host_memory is not None and not is_zero_size(args.host_memory):  # 0: none
        host = parse_bytes(args.host_memory, field="--host-memory")
    disk = None
    if args.disk_memory is not None:
        disk = parse_bytes(args.disk_memory, field="--disk-memory")
    if (args.disk_cache is None) != (disk is None):
        given, missing = (
            ("--disk-cache", "--disk-memory SIZE")
            if disk is None
            else ("--disk-memory", "--disk-cache DIR")
        )
        raise RunInputError(f"{given}: a disk tier also needs {missing}")
    if args.write_through == "host" and host is None:
        raise RunInputError("--write-through host: needs a host tier (--host-memory SIZE)")
    if args.write_through == "disk" and disk is None:
        raise RunInputError(
            "--write-through disk: needs a disk tier (--disk-cache DIR --disk-memory SIZE)"
        )
    if args.disk_cache is not None:
        _check_disk_dir(args.disk_cache)
    if memory is None and args.num_blocks is None:
        memory = parse_bytes(DEFAULT_MEMORY, field="--memory")
    try:
        cache = CacheConfig(
            strategy=args.strategy,
            memory_bytes=memory,
            num_blocks=args.num_blocks,
            block_size=args.block_size,
            kernel_block_size=args.kernel_block_size,
            state_block_size=args.state_block_size,
            max_model_len=args.max_model_len,
            attention_sinks=args.attention_sinks,
            host_memory_bytes=host,
            disk_cache_dir=args.disk_cache,
            disk_memory_bytes=disk,
            write_through=args.write_through,
        )
        scheduler = SchedulerConfig(
            token_budget=args.token_budget,
            max_num_seqs=args.max_num_seqs,
            admission=args.admission,
            compaction=args.compaction == "on",
        )
    except HybridKVError as exc:
        raise flagged(exc, args) from None
    return cache, scheduler


def _check_disk_dir(path: str) -> None:
    """What can be said of ``--disk-cache`` before the model loads (the directory's manifest
    is checked against the model's layout once it is known)."""
    import os
    from pathlib import Path

    if not path.strip():
        raise RunInputError("--disk-cache: got an empty path; give a directory for the cache")
    d = Path(path)
    if d.exists() and not d.is_dir():
        raise RunInputError(f"--disk-cache {path}: is a file, not a directory")
    probe = d if d.exists() else next((p for p in d.parents if p.exists()), Path("."))
    if not probe.is_dir():
        raise RunInputError(f"--disk-cache {path}: {probe} is a file, not a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise RunInputError(f"--disk-cache {path}: {probe} is not writable")


def check_device(device: str) -> None:
    from hybridkv.engine.device import resolve_device
    from hybridkv.engine.errors import DeviceError

    try:
        resolve_device(device)
    except DeviceError as exc:
        raise RunInputError(f"--device: {str(exc).removeprefix('device: ')}") from None
