"""How :class:`~hybridkv.engine.llm_engine.LLMEngine` plans its cache: :class:`CacheConfig`
(budget, strategy, block sizes, tiers) and the plan it gives, also checked from a model's
config before any weight is loaded."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hybridkv.cache import PUBLISH_MODES
from hybridkv.cache.policies import drops_dead_tails
from hybridkv.cache.tier_sessions import DEFAULT_PROTECT_SHARE
from hybridkv.cache.tiers import check_protect_share
from hybridkv.errors import BudgetTooSmallError, HybridKVError, PlanError
from hybridkv.plan import MemoryLayout, Plan, Strategy, make_plan
from hybridkv.plan.options import AUTO_STATE_SPLIT
from hybridkv.plan.search import first_true
from hybridkv.specs import ModelSpec
from hybridkv.units import MAX_BYTES, format_bytes

__all__ = [
    "DEFAULT_MAX_MODEL_LEN",
    "DEFAULT_MEMORY_BYTES",
    "CacheConfig",
    "plan_cache",
    "preflight_plan",
]

#: Cache budget when neither ``memory_bytes`` nor ``num_blocks`` is given: 64 MiB.
DEFAULT_MEMORY_BYTES = 64 << 20
#: ``max_model_len`` when none is given: the model's own limit, at most this many tokens.
DEFAULT_MAX_MODEL_LEN = 2048


def _positive(name: str, value: object) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise PlanError(f"CacheConfig.{name}: must be a positive integer or None, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class CacheConfig:
    """How the engine plans its cache (see :func:`hybridkv.plan.make_plan` for the fields it
    passes on: ``strategy``, ``block_size``, ``kernel_block_size``, ``state_block_size``,
    ``chunk_alignment``, ``state_split``).

    The budget is ``memory_bytes``, or ``num_blocks``: room for that many blocks of every group
    at once (arena: whole chunks of each group plus the null chunk; pools: one pool of
    ``num_blocks + 1`` blocks per group; uniform: ``num_blocks + 1`` blocks per group in the
    shared pool), or
    :data:`DEFAULT_MEMORY_BYTES`.
    ``max_model_len`` (tokens) defaults to the model's ``max_position_embeddings``, at most
    2048.  ``publish``: when the manager publishes attention blocks (``scheduled``: at the
    allocation of the step that fills them, so requests admitted in the same step hit them;
    the runner orders its passes so that they are written before they are read; or
    ``computed``).  ``attention_sinks``: StreamingLLM sink tokens, the first tokens of a
    request that every sliding-window layer reads besides its window (their blocks are never
    recycled); this changes the model's attention on purpose (long generations past the
    window keep the sinks), so outputs match the model with that mask, not the model as
    trained.  ``host_memory_bytes``: a host-memory tier below the device cache: blocks the
    device evicts are copied there and hits read them back (:mod:`hybridkv.cache.tiers`,
    :mod:`hybridkv.engine.tier_store`).  ``disk_cache_dir`` with ``disk_memory_bytes``: a
    disk tier below (checksummed slots in a preallocated file in that directory, reused by
    the next engine of the same model and layout: a prefix cache that outlives the process;
    :mod:`hybridkv.storage.disk_slots`).  ``write_through``: ``"host"`` or ``"disk"``: that
    tier also takes every block the device publishes, once the step computing it ran, not
    only what the device evicts (a disk tier then keeps a process's prefixes even if it
    ends without :meth:`~hybridkv.engine.llm_engine.LLMEngine.close`).  ``protect_share``:
    the share of each lower tier the sessions clients protect may fill (``add_request(
    protect_as=)``; past it the least recently protected session ends; see
    :mod:`hybridkv.cache.tier_sessions`).  Raises
    :class:`~hybridkv.errors.PlanError` when both budgets are given, a count is not positive
    (negative where 0 is allowed), ``publish`` is unknown, only one of the two disk fields
    is given, ``write_through`` names a tier the config does not have, or
    ``protect_share`` is not in (0, 1].
    """

    strategy: str = "arena"
    memory_bytes: int | None = None
    num_blocks: int | None = None
    block_size: int = 16
    kernel_block_size: int | None = None
    state_block_size: int | None = None
    max_model_len: int | None = None
    chunk_alignment: int = 4096
    state_split: int | str = AUTO_STATE_SPLIT
    publish: str = "scheduled"
    attention_sinks: int = 0
    host_memory_bytes: int | None = None
    disk_cache_dir: str | Path | None = None
    disk_memory_bytes: int | None = None
    write_through: str | None = None
    protect_share: float = DEFAULT_PROTECT_SHARE

    def __post_init__(self) -> None:
        for name in (
            "memory_bytes",
            "num_blocks",
            "max_model_len",
            "host_memory_bytes",
            "disk_memory_bytes",
        ):
            _positive(name, getattr(self, name))
        if (self.disk_cache_dir is None) != (self.disk_memory_bytes is None):
            raise PlanError(
                "CacheConfig: a disk tier needs both disk_cache_dir (got "
                f"{self.disk_cache_dir!r}) and disk_memory_bytes (got {self.disk_memory_bytes!r})"
            )
        if self.disk_cache_dir == "":  # Path("") is the working directory: not meant
            raise PlanError(
                "CacheConfig.disk_cache_dir: got an empty path; give a directory for the disk tier"
            )
        if self.disk_cache_dir is not None and not isinstance(self.disk_cache_dir, str | Path):
            raise PlanError(
                f"CacheConfig.disk_cache_dir: expected a path, got {self.disk_cache_dir!r}"
            )
        sinks = self.attention_sinks
        if not isinstance(sinks, int) or isinstance(sinks, bool) or sinks < 0:
            raise PlanError(
                f"CacheConfig.attention_sinks: must be an integer >= 0 (0: none), got {sinks!r}"
            )
        if self.publish not in PUBLISH_MODES:
            raise PlanError(
                f"CacheConfig.publish: unknown mode {self.publish!r}; valid: "
                f"{', '.join(PUBLISH_MODES)}"
            )
        if self.write_through is not None:
            have = {"host": self.host_memory_bytes, "disk": self.disk_memory_bytes}
            if have.get(self.write_through) is None:
                tiers = ", ".join(n for n, size in have.items() if size is not None) or "none"
                raise PlanError(
                    f"CacheConfig.write_through: {self.write_through!r} is not a tier of this "
                    f"cache (its tiers: {tiers}); valid: 'host' with host_memory_bytes, 'disk' "
                    "with disk_cache_dir and disk_memory_bytes"
                )
        check_protect_share(self.protect_share, "CacheConfig.protect_share")
        if self.memory_bytes is not None and self.num_blocks is not None:
            raise PlanError(
                f"CacheConfig: give memory_bytes ({self.memory_bytes}) or num_blocks "
                f"({self.num_blocks}), not both"
            )


def plan_cache(spec: ModelSpec, max_model_len: int, cache: CacheConfig) -> Plan:
    """The plan of ``spec``'s cache as ``cache`` asks for it (see :class:`CacheConfig`)."""
    options: dict[str, Any] = {
        "max_model_len": max_model_len,
        "strategy": cache.strategy,
        "block_size": cache.block_size,
        "kernel_block_size": cache.kernel_block_size,
        "state_block_size": cache.state_block_size,
        "chunk_alignment": cache.chunk_alignment,
        "state_split": cache.state_split,
        # the engine's manager keeps dead tails exactly when it has lower tiers
        "one_slot_chunks": drops_dead_tails(
            "auto", cache.host_memory_bytes is not None or cache.disk_memory_bytes is not None
        ),
    }
    if cache.num_blocks is None:
        memory = cache.memory_bytes or DEFAULT_MEMORY_BYTES
        return make_plan(spec, memory_bytes=memory, **options)
    # The arena planner may pad state pages differently for another budget (other chunk
    # sizes): size the budget from a plan until the plan it gives agrees.
    big = make_plan(spec, memory_bytes=1 << 40, **options)
    if big.layout.strategy is Strategy.POOLS:
        # Weights proportional to block bytes give every pool the same number of blocks.
        options["pool_ratios"] = [g.block_bytes for g in big.layout.groups]

    def for_blocks(num_blocks: int) -> Plan:
        plan = big
        for _ in range(4):
            memory = _budget_for_blocks(plan.layout, num_blocks)
            if memory > MAX_BYTES:
                raise PlanError(
                    f"CacheConfig.num_blocks: {num_blocks} blocks of every group need "
                    f"{format_bytes(memory)}, more than any machine addresses (2^64 B); give "
                    "fewer"
                )
            if memory == plan.memory_bytes:
                break
            plan = make_plan(spec, memory_bytes=memory, **options)
        return plan

    try:
        return for_blocks(cache.num_blocks)
    except BudgetTooSmallError as exc:
        least = _least_blocks(for_blocks, cache.num_blocks)
        text = str(exc)
        reason = text.partition("; ")[0].partition(" holds ")[2]
        short = re.search(
            r" starves a pool(?: of the [^:]* budget)?: (.*?)(?:; this|, so no)", text
        )
        if big.layout.strategy is Strategy.POOLS and short is not None:
            # The split is this count's, not ratios the user gave: name what runs short.
            reason = (
                f"no request of max_model_len {big.max_model_len} with the pools strategy "
                f"(each group's pool gets {cache.num_blocks + 1} blocks, one its null block): "
                f"{short.group(1)}"
            )
        raise BudgetTooSmallError(
            f"CacheConfig.num_blocks: {cache.num_blocks} blocks of every group hold {reason}; "
            + (f"give at least {least}" if least else "no block count up to 2^20 does")
        ) from None


def _least_blocks(for_blocks: Callable[[int], Plan], given: int) -> int:
    """The least block count above ``given`` whose plan holds a request (0: none up to
    2^20): doubling, then bisecting (every count returned was planned)."""

    def holds(n: int) -> bool:
        try:
            for_blocks(n)
        except BudgetTooSmallError:
            return False
        return True

    low, high = given, given * 2
    while not holds(high):
        if high >= 1 << 20:
            return 0
        low, high = high, high * 2
    return first_true(holds, low, high)


def preflight_plan(
    config: Any, dtype: torch.dtype, max_model_len: int, cache: CacheConfig
) -> ModelSpec | None:
    """Raise the :class:`PlanError` the engine's plan would raise, before any weight is loaded.

    The spec comes from ``config`` (:func:`hybridkv.models.spec_from_config`, every cache in
    the engine's ``dtype``), which equals what the probe measures on the loaded model for
    every architecture hybridkv maps (``tests/test_engine_binding.py``).  When the config
    cannot be derived here, nothing is checked: the plan from the probe decides.  Returns the
    derived spec (None when it could not be derived).
    """
    from hybridkv.models import spec_from_config

    dtype_name = str(dtype).removeprefix("torch.")
    data = config.to_dict()
    for part in (data, data.get("text_config")):
        if isinstance(part, dict):
            part["dtype"] = dtype_name
            part.pop("torch_dtype", None)
    try:
        spec = spec_from_config(data, kv_cache_dtype=dtype_name)
    except HybridKVError:
        return None
    plan_cache(spec, max_model_len, cache)
    return spec


def _budget_for_blocks(layout: MemoryLayout, num_blocks: int) -> int:
    """Bytes holding ``num_blocks`` blocks of every group of ``layout`` at once, null blocks
    included: whole chunks per group plus the null chunk (arena), or ``num_blocks + 1``
    blocks of every group (pools, uniform).  Block and chunk sizes do not depend on the
    budget, except where the arena planner pads state pages differently for it."""
    if layout.arena is not None:
        per_group = (-(-num_blocks // layout.blocks_per_chunk(g.group_id)) for g in layout.groups)
        return (1 + sum(per_group)) * layout.arena.chunk_bytes
    return (num_blocks + 1) * sum(g.block_bytes for g in layout.groups)
