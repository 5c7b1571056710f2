"""All strategies side by side, plus the naive "every layer is full attention" estimate.

The naive estimate is what a planner that ignores layer kinds reports: every caching entry
keeps every token (:meth:`ModelSpec.full_attention_equivalent_bytes_per_token`), state layers
keep their state, no blocks, no padding.  Its *waste* is what it sets aside for tokens no query
will read again (sliding-window and chunk tokens outside the span): ``N * (naive - exact)``
bytes per ``N`` requests.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from hybridkv.errors import PlanError, PoolRatiosError
from hybridkv.plan.grouping import check_model, group_entries
from hybridkv.plan.layout import Strategy
from hybridkv.plan.options import (
    AUTO_STATE_SPLIT,
    DEFAULT_CHUNK_ALIGNMENT,
    PlanOptions,
    check_positive,
    ratios_arg,
)
from hybridkv.plan.planner import make_plan
from hybridkv.plan.result import Plan
from hybridkv.specs import MAX_TOKENS, ModelSpec

__all__ = ["NaiveEstimate", "StrategyComparison", "StrategyFailure", "compare_strategies"]


@dataclass(frozen=True, kw_only=True)
class NaiveEstimate:
    """Capacity if every caching layer kept every token (bytes, requests)."""

    memory_bytes: int
    max_model_len: int
    bytes_per_request: int
    exact_bytes_per_request: int

    @property
    def max_concurrent_requests(self) -> int:
        return self.memory_bytes // self.bytes_per_request

    @property
    def waste_bytes(self) -> int:
        """Bytes set aside for tokens no query reads, at the estimate's capacity."""
        return self.max_concurrent_requests * (
            self.bytes_per_request - self.exact_bytes_per_request
        )

    @property
    def physical_need(self) -> int:
        return self.max_concurrent_requests * self.exact_bytes_per_request

    @property
    def utilisation(self) -> float:
        return self.physical_need / self.memory_bytes

    @property
    def waste_fraction(self) -> float:
        return self.waste_bytes / self.memory_bytes

    @classmethod
    def of(cls, model: ModelSpec, *, memory_bytes: int, max_model_len: int) -> NaiveEstimate:
        state = sum(spec.state_bytes for _, _, spec in model.entries())
        return cls(
            memory_bytes=memory_bytes,
            max_model_len=max_model_len,
            bytes_per_request=model.full_attention_equivalent_bytes_per_token() * max_model_len
            + state,
            exact_bytes_per_request=model.resident_bytes(max_model_len),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "memory_bytes": self.memory_bytes,
            "max_model_len": self.max_model_len,
            "bytes_per_request": self.bytes_per_request,
            "exact_bytes_per_request": self.exact_bytes_per_request,
            "max_concurrent_requests": self.max_concurrent_requests,
            "waste_bytes": self.waste_bytes,
            "physical_need": self.physical_need,
            "utilisation": self.utilisation,
        }


class StrategyFailure(NamedTuple):
    """A strategy that could not plan this budget, and why (the PlanError message)."""

    strategy: Strategy
    reason: str


@dataclass(frozen=True, kw_only=True)
class StrategyComparison:
    """One plan per strategy that succeeded, the failures, and the naive estimate."""

    plans: tuple[Plan, ...]
    failures: tuple[StrategyFailure, ...]
    naive: NaiveEstimate

    def plan(self, strategy: Strategy | str) -> Plan:
        """The plan of ``strategy``; raises :class:`PlanError` if it failed or is unknown."""
        for p in self.plans:
            if p.strategy == strategy:
                return p
        for f in self.failures:
            if f.strategy == strategy:
                raise PlanError(f"strategy: {f.strategy.value} failed: {f.reason}")
        raise PlanError(f"strategy: no plan for {strategy!r}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "plans": {p.strategy.value: p.to_dict() for p in self.plans},
            "failures": {f.strategy.value: f.reason for f in self.failures},
            "naive": self.naive.to_dict(),
        }


def compare_strategies(
    model: ModelSpec,
    *,
    memory_bytes: int,
    max_model_len: int,
    block_size: int = 16,
    kernel_block_size: int | None = None,
    state_block_size: int | None = None,
    pool_ratios: Sequence[float] | None = None,
    chunk_alignment: int = DEFAULT_CHUNK_ALIGNMENT,
    state_split: int | str = AUTO_STATE_SPLIT,
    one_slot_chunks: bool = True,
) -> StrategyComparison:
    """Plan ``model`` with every :class:`Strategy` (in enum order) and the naive estimate.

    Arguments as for :func:`make_plan`; ``pool_ratios`` only reach the ``pools`` strategy.  A
    strategy that raises :class:`PlanError` is recorded in ``failures``; if every strategy
    fails, the first error is raised.  Pure.
    """
    check_model(model)
    check_positive("memory_bytes", memory_bytes)
    check_positive("max_model_len", max_model_len, upper=MAX_TOKENS)
    # Input errors shared by every strategy raise here instead of failing each strategy.
    ratios = ratios_arg(pool_ratios)  # once: an iterator would be spent by the first plan
    PlanOptions(
        block_size=block_size,
        kernel_block_size=kernel_block_size,
        state_block_size=state_block_size,
        pool_ratios=ratios,
        chunk_alignment=chunk_alignment,
        state_split=state_split,
        one_slot_chunks=one_slot_chunks,
    )
    group_entries(model)
    plans: list[Plan] = []
    failures: list[StrategyFailure] = []
    first_error: PlanError | None = None
    for strategy in Strategy:
        try:
            plans.append(
                make_plan(
                    model,
                    memory_bytes=memory_bytes,
                    max_model_len=max_model_len,
                    strategy=strategy,
                    block_size=block_size,
                    kernel_block_size=kernel_block_size,
                    state_block_size=state_block_size,
                    pool_ratios=ratios if strategy is Strategy.POOLS else None,
                    chunk_alignment=chunk_alignment,
                    state_split=state_split,
                    one_slot_chunks=one_slot_chunks,
                )
            )
        except PoolRatiosError:
            raise  # the caller's ratios, not what this strategy can plan
        except PlanError as exc:
            first_error = first_error or exc
            failures.append(StrategyFailure(strategy, str(exc)))
    if not plans:
        assert first_error is not None  # every strategy failed, so one error was kept
        raise first_error
    naive = NaiveEstimate.of(model, memory_bytes=memory_bytes, max_model_len=max_model_len)
    return StrategyComparison(plans=tuple(plans), failures=tuple(failures), naive=naive)
