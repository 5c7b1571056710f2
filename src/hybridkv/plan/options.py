"""Planner options: block sizes, pool ratios and chunk alignment, validated once.

Defaults and why:

* ``block_size`` 16 tokens for attention and MLA groups: the page size every common
  paged-attention kernel accepts, and fine enough that prefix hits lose at most 15 tokens.
* ``state_block_size`` 256 tokens for state groups (Mamba, gated DeltaNet, short conv).  A
  state block is one state slot and its size is the *checkpoint interval*: a prefix hit on a
  state group exists only where a state was saved, i.e. at multiples of it.  Each checkpoint
  costs a whole state (often megabytes), so a fine interval multiplies cache pressure, while a
  coarse one coarsens every hit (the scheduler aligns hits to the lcm of the block sizes).  256
  is a power-of-two multiple of every power-of-two attention block up to 256, so the lcm stays
  256 tokens and hashes stay at the attention block; a 128k-token request saves at most 512
  checkpoints; and it is finer than the 544-1056 tokens vLLM scales attention blocks to for
  Mamba hybrids.  The ``uniform`` strategy (vLLM's rules) instead defaults to vLLM's align
  mode, a checkpoint interval equal to the unified attention block size.
* ``kernel_block_size``: see :func:`kernel_block_size_for`.
* ``state_split`` ``"auto"`` (:data:`AUTO_STATE_SPLIT`): the planner picks 1 or 4
  (:func:`hybridkv.plan.planner.auto_state_split`).  ``k`` >= 1 splits each recurrent-state
  group into ``k`` groups of consecutive layers (as equal as possible, at most one per
  layer; ``arena`` and ``pools``, ``uniform`` groups layers by vLLM's rule): slots ``k``
  times smaller, and an ``arena`` whose chunk follows the largest block gets chunks up to
  ``k`` times smaller and several slots per chunk, so a state slot no longer needs a whole
  chunk of attention blocks to drain; each step then plans ``k`` state groups instead of one,
  and a checkpoint is ``k`` parts that leave the cache together
  (:mod:`hybridkv.cache.coupling`).  But a chunk of several slots is evicted whole, so it
  takes several checkpoints with it: splitting pays only where whole-chunk slots strand
  much of the budget.  Measured in ``docs/architecture.md`` (section 5).
* ``one_slot_chunks`` True: among arena plans of equal capacity, prefer a chunk of exactly
  one slot of every state group, padding state pages by at most 5%
  (:mod:`hybridkv.plan.arena`).  Chunks then drain for state slots only where the cache
  drops what no hit can read (dead tails): callers whose cache keeps them (lower tiers, or
  ``dead_tails="keep"``) pass False, and the slots share a chunk as the common multiple gives.
* ``chunk_alignment`` 64 KiB: arena chunks are the smallest common multiple of every group's
  block bytes and this.  Small chunks keep eviction close to one global LRU (a reclaimed chunk
  loses all its cached blocks at once): on the simulator's chat workload, gpt-oss-20b at 1 GiB,
  16-block chunks (2 MiB alignment) hit 58.7% of prompt tokens, 1-block chunks 66.5%, equal to
  the uniform pool.  The on-demand arena maps physical memory in 2 MiB pages (the CUDA VMM
  granularity) and shares the pages of neighbouring chunks; pass ``chunk_alignment=2 MiB`` for
  chunks that map and unmap on their own.  The price of 1-block chunks is manager time (a chunk
  transition per block): on 2,000 Mooncake requests, gpt-oss-20b at 64 GiB, 2 MiB chunks spent
  0.78x vLLM's manager time per step and 64 KiB chunks 1.00x (hit rates 4.8% and 4.5%).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from math import gcd
from typing import Any

from hybridkv.errors import PlanError, brief_repr
from hybridkv.specs import MAX_TOKENS, CacheKind, CacheSpec

__all__ = [
    "AUTO_STATE_SPLIT",
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_CHUNK_ALIGNMENT",
    "DEFAULT_STATE_BLOCK_SIZE",
    "KERNEL_BLOCK_LIMIT",
    "MAX_STATE_SPLIT",
    "PlanOptions",
    "check_positive",
    "kernel_block_size_for",
    "ratios_arg",
]

DEFAULT_BLOCK_SIZE = 16
DEFAULT_STATE_BLOCK_SIZE = 256
DEFAULT_CHUNK_ALIGNMENT = 64 * 1024  # see the module docstring
#: Most groups one state group may be split into (``PlanOptions.state_split``).
MAX_STATE_SPLIT = 64
#: ``PlanOptions.state_split`` value that lets the planner choose (the default).
AUTO_STATE_SPLIT = "auto"
#: Largest kernel block the default rule picks (tokens).
KERNEL_BLOCK_LIMIT = 16


def check_positive(name: str, value: object, *, upper: int | None = None, hint: str = "") -> int:
    """Return ``value`` if it is a positive int (not a bool) no larger than ``upper``.

    Raises :class:`PlanError` naming ``name``, the value and the valid range.
    """
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise PlanError(f"{name}: must be a positive integer, got {value!r}{hint}")
    if upper is not None and value > upper:
        raise PlanError(f"{name}: {value} is larger than the maximum {upper}{hint}")
    return value


@dataclass(frozen=True, kw_only=True)
class PlanOptions:
    """How a plan sizes blocks and pools (see the module docstring for the defaults).

    ``state_block_size`` None means the strategy's default (256 tokens, or vLLM's align mode
    for ``uniform``).  ``pool_ratios`` (``pools`` only) are one positive weight per group,
    normalised by the planner.  Construction validates every field and raises
    :class:`PlanError`.
    """

    block_size: int = DEFAULT_BLOCK_SIZE
    kernel_block_size: int | None = None
    state_block_size: int | None = None
    pool_ratios: tuple[float, ...] | None = None
    chunk_alignment: int = DEFAULT_CHUNK_ALIGNMENT
    state_split: int | str = AUTO_STATE_SPLIT
    one_slot_chunks: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.one_slot_chunks, bool):
            raise PlanError(f"one_slot_chunks: must be True or False, got {self.one_slot_chunks!r}")
        check_positive("block_size", self.block_size, upper=MAX_TOKENS)
        if self.kernel_block_size is not None:
            check_positive("kernel_block_size", self.kernel_block_size, upper=MAX_TOKENS)
            if self.block_size % self.kernel_block_size:
                raise PlanError(
                    f"kernel_block_size: {self.kernel_block_size} does not divide block_size "
                    f"{self.block_size}; choose a divisor of the block size"
                )
        if self.state_block_size is not None:
            check_positive("state_block_size", self.state_block_size, upper=MAX_TOKENS)
        check_positive("chunk_alignment", self.chunk_alignment)
        if self.state_split != AUTO_STATE_SPLIT:
            check_positive(
                "state_split",
                self.state_split,
                upper=MAX_STATE_SPLIT,
                hint=f" (or {AUTO_STATE_SPLIT!r}: the planner chooses)",
            )
        if self.pool_ratios is not None:
            object.__setattr__(self, "pool_ratios", _check_ratios(self.pool_ratios))

    def to_dict(self) -> dict[str, Any]:
        return {
            "block_size": self.block_size,
            "kernel_block_size": self.kernel_block_size,
            "state_block_size": self.state_block_size,
            "pool_ratios": None if self.pool_ratios is None else list(self.pool_ratios),
            "chunk_alignment": self.chunk_alignment,
            "state_split": self.state_split,
            "one_slot_chunks": self.one_slot_chunks,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PlanOptions:
        ratios = data.get("pool_ratios")
        return cls(
            block_size=int(data["block_size"]),
            kernel_block_size=data.get("kernel_block_size"),
            state_block_size=data.get("state_block_size"),
            pool_ratios=None if ratios is None else tuple(float(r) for r in ratios),
            chunk_alignment=int(data.get("chunk_alignment", DEFAULT_CHUNK_ALIGNMENT)),
            state_split=_split_value(data.get("state_split", 1)),
            one_slot_chunks=bool(data.get("one_slot_chunks", True)),
        )


def _split_value(value: Any) -> int | str:
    """A stored ``state_split``: ``"auto"`` or an integer (checked by PlanOptions)."""
    return AUTO_STATE_SPLIT if value == AUTO_STATE_SPLIT else int(value)


def ratios_arg(value: object) -> tuple[float, ...] | None:
    """A ``pool_ratios`` argument as given to :func:`~hybridkv.plan.make_plan`, as a tuple
    (None stays None; the numbers are checked by :class:`PlanOptions`).  Raises
    :class:`PlanError` for a string or anything that is not a sequence."""
    if value is None:
        return None
    if isinstance(value, str | bytes) or not isinstance(value, Iterable):
        raise PlanError(
            f"pool_ratios: expected a sequence of positive numbers, one per group (or None), "
            f"got {brief_repr(value)}"
        )
    return tuple(value)


def _check_ratios(ratios: Sequence[float]) -> tuple[float, ...]:
    if isinstance(ratios, str | bytes):
        raise PlanError(f"pool_ratios: expected a sequence of numbers, got {ratios!r}")
    out: list[float] = []
    for r in ratios:
        if isinstance(r, bool) or not isinstance(r, int | float):
            raise PlanError(f"pool_ratios: {r!r} is not a number; give positive numbers")
        if not math.isfinite(r) or r <= 0:
            raise PlanError(
                f"pool_ratios: every ratio must be a positive finite number, got {r!r} "
                f"in {list(ratios)}"
            )
        out.append(float(r))
    if not out:
        raise PlanError("pool_ratios: empty; give one positive ratio per group")
    return tuple(out)


def kernel_block_size_for(spec: CacheSpec, block_size: int, requested: int | None) -> int:
    """Kernel block size (tokens) of a group with ``spec`` and manager block ``block_size``.

    * State groups: ``block_size`` (a state block is one slot; kernels address slots by id).
    * Per-token groups with ``requested`` given: ``requested``, which must divide the block
      size (else :class:`PlanError` naming both).
    * Otherwise the block size itself up to 16 tokens, and for larger blocks the largest power
      of two up to 16 that divides them (``gcd(block_size, 16)``): 16-token pages are what
      every common paged-attention kernel accepts, so a 64-token manager block becomes four
      kernel blocks, and a 24-token one three kernel blocks of 8.
    """
    if spec.kind is CacheKind.STATE:
        return block_size
    if requested is not None:
        if block_size % requested:
            raise PlanError(
                f"kernel_block_size: {requested} does not divide block_size {block_size}; "
                "choose a divisor of the block size"
            )
        return requested
    if block_size <= KERNEL_BLOCK_LIMIT:
        return block_size
    return gcd(block_size, KERNEL_BLOCK_LIMIT)
