"""Step-driven (closed-loop) requests, for benchmark loops that count scheduler steps.

A :class:`~hybridkv.workloads.types.WorkloadRequest` arrives at a wall-clock time.  The manager
benchmarks (``benchmarks/bench_manager.py``, the vLLM driver) instead advance a step counter
and release a multi-turn follow-up only once the turn it continues has *finished*: a
:class:`StepRequest` arrives at ``arrival_step`` and, when it has a ``parent_id``, no earlier
than ``think_steps`` steps after that parent ended.  Output tokens are fixed in advance, so a
follow-up re-sends exactly what its parent generated and every system replays the same tokens.

Standard library only: the vLLM driver imports this from an interpreter without hybridkv's
dependencies.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from hybridkv.workloads.types import Workload, WorkloadError

__all__ = ["StepRequest", "arrival_order", "step_requests", "step_summary"]


@dataclass(frozen=True, kw_only=True, slots=True)
class StepRequest:
    """One request of a step-driven workload.

    ``arrival_step``: the first scheduler step at which it may be admitted.  ``parent_id``: the
    request whose prompt and output this one's prompt starts with (a multi-turn re-send); it is
    released ``think_steps`` steps after that parent finished, and not before ``arrival_step``.
    Raises :class:`WorkloadError` for an empty prompt or output, or a negative step count.
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]
    arrival_step: int
    parent_id: str | None = None
    think_steps: int = 0

    def __post_init__(self) -> None:
        if not self.prompt_token_ids or not self.output_token_ids:
            raise WorkloadError(
                f"request {self.request_id!r}: prompt_token_ids and output_token_ids must be "
                f"non-empty, got {len(self.prompt_token_ids)} and "
                f"{len(self.output_token_ids)} tokens"
            )
        for name in ("arrival_step", "think_steps"):
            value = getattr(self, name)
            if value < 0:
                raise WorkloadError(
                    f"request {self.request_id!r}: {name} must be >= 0, got {value}"
                )

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_len(self) -> int:
        return len(self.output_token_ids)


def arrival_order(requests: Iterable[StepRequest]) -> list[StepRequest]:
    """``requests`` sorted by ``(arrival_step, request_id)``: the order the vLLM driver's
    scheduler releases them in (and the order :func:`~hybridkv.workloads.ideal.ideal_hit_tokens`
    should serve them in).  Raises :class:`WorkloadError` for a duplicate ``request_id`` or a
    ``parent_id`` that names no request of the workload."""
    reqs = list(requests)
    ids: set[str] = set()
    for r in reqs:
        if r.request_id in ids:
            raise WorkloadError(f"workload: request_id {r.request_id!r} appears twice")
        ids.add(r.request_id)
    for r in reqs:
        if r.parent_id is not None and r.parent_id not in ids:
            raise WorkloadError(
                f"request {r.request_id!r}: parent_id {r.parent_id!r} names no request of the "
                "workload"
            )
    return sorted(reqs, key=lambda r: (r.arrival_step, r.request_id))


def step_requests(workload: Workload, *, ms_per_step: float) -> list[StepRequest]:
    """``workload``'s requests (e.g. a Mooncake trace) as open-loop step requests: arrival step
    ``int(arrival_ms / ms_per_step)``, no parent.  Same ids, tokens and order.  Raises
    :class:`WorkloadError` when ``ms_per_step`` is not positive."""
    if not ms_per_step > 0:
        raise WorkloadError(f"ms_per_step must be a positive number of ms, got {ms_per_step!r}")
    return [
        StepRequest(
            request_id=r.request_id,
            prompt_token_ids=r.prompt_token_ids,
            output_token_ids=r.output_token_ids,
            arrival_step=int(r.arrival_ms / ms_per_step),
        )
        for r in workload
    ]


def step_summary(requests: Sequence[StepRequest]) -> dict[str, float]:
    """Counts and mean lengths, for a benchmark's report."""
    n = len(requests)
    prompt_tokens = sum(r.prompt_len for r in requests)
    return {
        "requests": n,
        "multi_turn": sum(1 for r in requests if r.parent_id is not None),
        "mean_prompt": prompt_tokens / max(n, 1),
        "mean_output": sum(r.output_len for r in requests) / max(n, 1),
        "prompt_tokens": prompt_tokens,
    }
