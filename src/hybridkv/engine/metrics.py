"""What an :class:`~hybridkv.engine.llm_engine.LLMEngine` measures while it runs.

:class:`CacheTracker` watches every scheduler step (torch-free bookkeeping over block tables):

* **peak blocks per group**: after each step's allocation, the distinct non-null block ids in
  the block tables of every running request (a block shared by several requests through a
  prefix hit counts once; a state group counts running slots, not checkpoints);
* **window blocks released**: per sliding-window / chunked group, how many table entries that
  held a real block became the null block (the manager recycled a block the window left);
* **admitted prefix hits**: the tokens each admission (a first one, or a re-admission after
  preemption) took from the prefix cache, and the tokens of the requests admitted.

:class:`EngineStats` is the frozen summary, with the manager's own per-group statistics
(:attr:`hybridkv.cache.PrefixCacheStats.group_alone_hit_tokens`) and the scheduler's
preemption count.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from hybridkv.cache import KVCacheManager
from hybridkv.plan import NULL_BLOCK_ID, MemoryLayout
from hybridkv.scheduler import SchedulerOutput
from hybridkv.specs import WINDOW_KINDS

__all__ = ["WINDOW_KINDS", "CacheTracker", "EngineStats"]


@dataclass(frozen=True, kw_only=True)
class EngineStats:
    """Counters of an engine since it was built.

    ``max_batch_requests`` / ``max_step_tokens``: the most requests / new tokens one step ran.
    Tokens: ``prompt_tokens`` of the requests added; ``computed_tokens`` run through the model
    (prefill chunks, decode tokens and recomputation after preemption);
    ``generated_tokens`` sampled.  ``seconds`` is wall time inside ``step()``,
    ``model_seconds`` the part spent in the runner.  ``admitted_tokens`` /
    ``prefix_hit_tokens``: the tokens of each request's first admission and the part a
    prefix hit served (a request preempted and admitted again, which mostly hits its own
    blocks, is not counted twice; the simulator counts the same way).
    ``query_tokens`` / ``group_hit_tokens[g]``: the manager's statistics (every
    ``get_computed_blocks`` query, and the tokens group ``g`` alone could have served).
    ``peak_blocks[g]``, ``window_blocks_released[g]``: see :class:`CacheTracker`.
    ``peak_usage``: the largest fraction of the pool held by referenced blocks.
    Speculative decoding: ``draft_tokens`` verified, ``accepted_draft_tokens`` of them, and
    ``rollback_passes``: forward passes that ran accepted tokens again to roll a recurrent
    state back past rejected drafts (also counted in ``forward_passes``).
    ``host_hit_tokens`` / ``disk_hit_tokens``: the part of ``prefix_hit_tokens`` read back
    from the host / disk tier (first admissions too).  ``moved_blocks``: blocks the
    scheduler's compaction moved (one device copy each) instead of preempting.
    """

    groups: tuple[str, ...]
    steps: int
    forward_passes: int
    max_batch_requests: int
    max_step_tokens: int
    prompt_tokens: int
    computed_tokens: int
    generated_tokens: int
    seconds: float
    model_seconds: float
    admitted_tokens: int
    prefix_hit_tokens: int
    query_tokens: int
    group_hit_tokens: tuple[int, ...]
    peak_blocks: tuple[int, ...]
    window_blocks_released: tuple[int, ...]
    preemptions: int
    peak_usage: float
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    rollback_passes: int = 0
    host_hit_tokens: int = 0
    disk_hit_tokens: int = 0
    moved_blocks: int = 0

    @property
    def tokens_per_second(self) -> float:
        """Generated tokens per second of ``step()`` time (0.0 before any step)."""
        return self.generated_tokens / self.seconds if self.seconds else 0.0

    @property
    def draft_acceptance(self) -> float:
        """``accepted_draft_tokens / draft_tokens`` (0.0 without speculation)."""
        return self.accepted_draft_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def hit_rate(self) -> float:
        """``prefix_hit_tokens / admitted_tokens`` (0.0 before any admission)."""
        return self.prefix_hit_tokens / self.admitted_tokens if self.admitted_tokens else 0.0

    @property
    def group_hit_rates(self) -> tuple[float, ...]:
        """Per group, ``group_hit_tokens[g] / query_tokens`` (0.0 without queries)."""
        q = self.query_tokens
        return tuple(h / q if q else 0.0 for h in self.group_hit_tokens)

    def to_dict(self) -> dict[str, Any]:
        """Every field plus the derived rates, JSON-ready."""
        out = asdict(self)
        out["tokens_per_second"] = self.tokens_per_second
        out["hit_rate"] = self.hit_rate
        out["group_hit_rates"] = list(self.group_hit_rates)
        return out


def group_labels(layout: MemoryLayout) -> tuple[str, ...]:
    """``"<group id>:<kind>"`` per group, e.g. ``("0:state", "1:sliding_window")``."""
    return tuple(f"{g.group_id}:{g.spec.kind.value}" for g in layout.groups)


class CacheTracker:
    """Per-step cache measurements (see the module docstring).  Reads the manager; mutates
    only itself."""

    def __init__(self, layout: MemoryLayout) -> None:
        self.num_groups = len(layout.groups)
        self.window_groups = tuple(g.group_id for g in layout.groups if g.spec.kind in WINDOW_KINDS)
        self.peak_blocks = [0] * self.num_groups
        self.window_released = [0] * self.num_groups
        self.peak_usage = 0.0
        self.admitted_tokens = 0
        self.prefix_hit_tokens = 0
        #: Live requests whose first admission is counted.
        self.counted: set[str] = set()
        self._tables: dict[tuple[str, int], list[int]] = {}

    def record_step(
        self,
        output: SchedulerOutput,
        admitted: Iterable[str],
        num_tokens: dict[str, int],
    ) -> None:
        """Fold in one schedule: preempted requests lose their remembered tables; every
        scheduled request's tables (after allocation) are compared with the last ones seen;
        ``admitted`` ids (with their token counts in ``num_tokens``) count their hits at
        their first admission only."""
        for rid in output.preempted:
            for gid in self.window_groups:
                self._tables.pop((rid, gid), None)
        admitted = set(admitted) - self.counted
        self.counted |= admitted
        for item in output.scheduled:
            if item.request_id in admitted:
                self.admitted_tokens += num_tokens[item.request_id]
                self.prefix_hit_tokens += item.num_cached_tokens
            for gid in self.window_groups:
                table = list(item.block_ids[gid])
                old = self._tables.get((item.request_id, gid))
                if old is not None:
                    self.window_released[gid] += sum(
                        1
                        for before, now in zip(old, table, strict=False)
                        if before != NULL_BLOCK_ID and now == NULL_BLOCK_ID
                    )
                self._tables[(item.request_id, gid)] = table

    def record_import(self, request_id: str, num_tokens: int, hit_tokens: int) -> None:
        """Count a request another instance prefilled, admitted straight into the running
        set with ``num_tokens`` prompt tokens of which ``hit_tokens`` hit this cache (found
        by review: imports were left out, while the manager counted their lookups)."""
        if request_id not in self.counted:
            self.counted.add(request_id)
            self.admitted_tokens += num_tokens
            self.prefix_hit_tokens += hit_tokens

    def record_holdings(self, manager: KVCacheManager, running: Iterable[str]) -> None:
        """Update the peaks from the tables of the ``running`` requests."""
        held: list[set[int]] = [set() for _ in range(self.num_groups)]
        for rid in running:
            if not manager.has_blocks(rid):
                continue
            for gid, table in enumerate(manager.get_block_ids(rid)):
                held[gid].update(table)
        for gid, ids in enumerate(held):
            ids.discard(NULL_BLOCK_ID)
            self.peak_blocks[gid] = max(self.peak_blocks[gid], len(ids))
        self.peak_usage = max(self.peak_usage, manager.usage)

    def forget(self, request_id: str) -> None:
        """Drop the remembered tables (and the counted admission) of a finished request."""
        self.counted.discard(request_id)
        for gid in self.window_groups:
            self._tables.pop((request_id, gid), None)
