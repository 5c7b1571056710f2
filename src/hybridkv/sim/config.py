"""The settings of one simulated run (:class:`SimConfig`) and the error of a run that cannot
start (:class:`SimulationError`)."""

from __future__ import annotations

from dataclasses import dataclass

from hybridkv.cache import TierSpec
from hybridkv.cache.pool_base import DEFAULT_CHANCES
from hybridkv.cache.tier_sessions import DEFAULT_PROTECT_SHARE
from hybridkv.cache.tiers import check_protect_share
from hybridkv.errors import HybridKVError, brief_repr
from hybridkv.plan import Strategy
from hybridkv.plan.options import AUTO_STATE_SPLIT, DEFAULT_CHUNK_ALIGNMENT
from hybridkv.sim.cost import ACCELERATORS

__all__ = ["PROTECT_MODES", "SimConfig", "SimulationError"]


#: ``SimConfig.protect`` values: no client hints, or an oracle client (see there).
PROTECT_MODES = ("none", "oracle")


class SimulationError(HybridKVError, ValueError):
    """The simulation cannot run (bad settings, or a request that can never fit)."""


@dataclass(frozen=True, kw_only=True)
class SimConfig:
    """Settings of one simulated run."""

    memory_bytes: int
    max_model_len: int
    strategy: Strategy = Strategy.ARENA
    block_size: int = 16
    state_block_size: int | None = None
    token_budget: int = 8192
    max_num_seqs: int = 256
    kernel_block_size: int | None = None
    pool_ratios: tuple[float, ...] | None = None
    chunk_alignment: int = DEFAULT_CHUNK_ALIGNMENT
    #: ``make_plan(state_split=)``.
    state_split: int | str = AUTO_STATE_SPLIT
    accelerator: str = "h100"
    use_arrivals: bool = True
    hasher: str = "builtin"
    timeline_points: int = 400
    window_retention: str = "tails"
    publish: str = "scheduled"
    checkpoint_admission: str = "yield"
    #: Where evicted state checkpoints go (``KVCacheManager(tier_admission=)``).
    tier_admission: str = "yield"
    #: Chances a cached block that served hits holds at most (``KVCacheManager(second_chance=)``).
    second_chance: int = DEFAULT_CHANCES
    #: The free-list pools' eviction order, ``"lru"`` or ``"2q"`` (``KVCacheManager(eviction=)``).
    eviction: str = "lru"
    #: Freed requests' blocks no hit can read (``KVCacheManager(dead_tails=)``).
    dead_tails: str = "auto"
    #: How long a state checkpoint stays cached (``KVCacheManager(checkpoint_life=)``).
    checkpoint_life: str = "auto"
    #: The same for windowed groups (``KVCacheManager(window_chances=)``; None: its default).
    window_chances: int | None = None
    #: The scheduler's ``checkpoint_before_end`` (state models; None: by the alignment).
    checkpoint_before_end: bool | None = None
    #: The scheduler's admission policy (``SchedulerConfig.admission``).
    admission: str = "reserve"
    #: Whether the scheduler compacts the cache before preempting
    #: (``SchedulerConfig.compaction``; the moves' copies are charged to the step).
    compaction: bool = True
    #: ``KVCacheManager(checkpoint_when_full=)`` (None: by layout).
    checkpoint_when_full: str | None = None
    host_memory_bytes: int | None = None
    disk_memory_bytes: int | None = None
    #: The tier that also takes every published block once its step ran
    #: (``KVCacheManager(tier_write_through=)``; None: write-back on eviction only).
    write_through: str | None = None
    #: ``"oracle"``: play a client that knows which requests a later one continues and
    #: protects their prefixes in the lower tiers until that one is admitted
    #: (:func:`hybridkv.workloads.sessions.continuations`, ``KVCacheManager.protect``);
    #: ``"none"`` (default): no hints, the tiers' recency order alone.
    protect: str = "none"
    #: The share of each lower tier protected sessions may fill
    #: (``KVCacheManager(protect_share=)``: past it the least recently protected one ends).
    protect_share: float = DEFAULT_PROTECT_SHARE
    #: The run's name in tables and plots (default: the strategy).
    label: str | None = None

    def tiers(self) -> tuple[TierSpec, ...]:
        """The lower tiers these settings ask for (host, then disk)."""
        out = []
        if self.host_memory_bytes:
            out.append(TierSpec("host", self.host_memory_bytes))
        if self.disk_memory_bytes:
            out.append(TierSpec("disk", self.disk_memory_bytes))
        return tuple(out)

    def __post_init__(self) -> None:
        # The fields make_plan, KVCacheManager and SchedulerConfig do not see are checked
        # here; theirs are checked (and named) there when the run starts.
        for name in ("use_arrivals", "compaction"):
            if not isinstance(getattr(self, name), bool):
                raise SimulationError(
                    f"{name}: must be True or False, got {brief_repr(getattr(self, name))}"
                )
        if self.checkpoint_before_end is not None and not isinstance(
            self.checkpoint_before_end, bool
        ):
            raise SimulationError(
                "checkpoint_before_end: must be True, False or None (by the alignment), got "
                f"{brief_repr(self.checkpoint_before_end)}"
            )
        points = self.timeline_points
        if type(points) is not int or points < 1:
            raise SimulationError(
                f"timeline_points: must be a positive integer, got {brief_repr(points)}"
            )
        if self.label is not None and not isinstance(self.label, str):
            raise SimulationError(f"label: must be a string or None, got {brief_repr(self.label)}")
        for name in ("host_memory_bytes", "disk_memory_bytes"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise SimulationError(f"{name}: must be a positive byte count, got {value!r}")
        if self.write_through is not None:
            have = [t.name for t in self.tiers()]
            if self.write_through not in have:
                raise SimulationError(
                    f"write_through: {self.write_through!r} is not a tier of this run (its "
                    f"tiers: {', '.join(have) or 'none'}); give its size "
                    f"({self.write_through}_memory_bytes)"
                )
        try:
            check_protect_share(self.protect_share)
        except HybridKVError as exc:
            raise SimulationError(str(exc)) from None
        if self.protect not in PROTECT_MODES:
            raise SimulationError(
                f"protect: {self.protect!r} is not a protection mode; valid: "
                f"{', '.join(PROTECT_MODES)}"
            )
        if self.accelerator not in ACCELERATORS:
            valid = ", ".join(sorted(ACCELERATORS))
            raise SimulationError(
                f"accelerator: unknown accelerator {self.accelerator!r}; valid: {valid}"
            )
