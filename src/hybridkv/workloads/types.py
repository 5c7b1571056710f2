"""The request stream a simulator or benchmark replays."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from hybridkv.errors import HybridKVError

__all__ = ["Workload", "WorkloadError", "WorkloadRequest"]


class WorkloadError(HybridKVError, ValueError):
    """A trace or workload description is malformed or unknown."""


@dataclass(frozen=True, slots=True)
class WorkloadRequest:
    """One request: when it arrives, its prompt tokens and the tokens it will generate.

    ``output_token_ids`` are fixed in advance so that replays are deterministic and a later
    turn of a conversation can re-send exactly what an earlier turn generated.
    """

    request_id: str
    arrival_ms: float
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]
    session_id: str | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_len(self) -> int:
        return len(self.output_token_ids)


@dataclass(frozen=True)
class Workload:
    """A named, ordered list of requests (by arrival time).

    ``skipped``: requests of the source a loader left out on purpose (e.g. prompts longer than
    :func:`~hybridkv.workloads.mooncake.load_mooncake_trace`'s ``max_prompt_tokens``).
    ``source_block``: the granularity, in tokens, at which the source tells which prompts share
    a prefix (a Mooncake trace's hash blocks: two prompts that go on alike past a block the
    trace cut short still differ there; 1 for a token-level source)."""

    name: str
    requests: tuple[WorkloadRequest, ...]
    skipped: int = 0
    source_block: int = 1

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self) -> Iterator[WorkloadRequest]:
        return iter(self.requests)

    def head(self, n: int) -> Workload:
        """The first ``n`` requests."""
        return Workload(self.name, self.requests[:n], self.skipped, self.source_block)

    @property
    def prompt_tokens(self) -> int:
        return sum(r.prompt_len for r in self.requests)

    @property
    def output_tokens(self) -> int:
        return sum(r.output_len for r in self.requests)

    def summary(self) -> str:
        n = len(self.requests)
        if n == 0:
            return f"{self.name}: no requests"
        return (
            f"{self.name}: {n} requests, mean prompt {self.prompt_tokens / n:.0f} tokens, "
            f"mean output {self.output_tokens / n:.0f} tokens"
        )


def sorted_by_arrival(requests: Sequence[WorkloadRequest]) -> tuple[WorkloadRequest, ...]:
    """Stable sort by arrival time (ties keep their order)."""
    return tuple(sorted(requests, key=lambda r: r.arrival_ms))
