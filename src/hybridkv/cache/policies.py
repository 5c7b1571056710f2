"""The manager's policy names and their check: one place that says what each accepts.

:func:`check_policies` raises :class:`~hybridkv.errors.PlanError` naming the field, the value
and the valid ones, before anything is built.
"""

from __future__ import annotations

from typing import Final

from hybridkv.cache.admission import CHECKPOINT_ADMISSION, CHECKPOINT_WHEN_FULL, TIER_ADMISSION
from hybridkv.errors import PlanError

__all__ = [
    "CHECKPOINT_LIFE",
    "DEAD_TAILS",
    "PUBLISH_MODES",
    "WINDOW_RETENTION",
    "check_policies",
    "drops_dead_tails",
    "lives_with_kv",
]

#: When attention blocks join the prefix cache: ``scheduled`` (default) at the allocation of
#: the step that fills them, as vLLM does, so requests admitted later in the same step hit
#: them (the runner writes a step's tokens before reading them); ``computed`` only once the
#: scheduler reports them computed (the next allocation or the free).  State checkpoints are
#: always published once computed: a recurrent layer cannot read a state its own pass is
#: still producing.
PUBLISH_MODES = ("scheduled", "computed")

#: Which blocks of windowed kinds (sliding window, chunked local) join the prefix cache:
#: ``tails`` (default): only those a hit at a likely position reads (the window before the
#: prompt's end, the request's hit and junction, and its computed end when freed; the rest
#: leave the window uncached, so they are reused before any cached block is evicted);
#: ``all``: every computed block.
WINDOW_RETENTION = ("tails", "all")

#: A freed request's attention blocks no hit can read (:mod:`~hybridkv.cache.dead_tails`):
#: ``auto`` (default) drops them without lower tiers and keeps them with tiers; ``drop``;
#: ``keep`` (plain LRU).
DEAD_TAILS: Final = ("auto", "drop", "keep")


#: How long a recurrent-state checkpoint stays cached (:mod:`~hybridkv.cache.coupling`):
#: ``kv``: as long as the KV it ends, refreshed when its request frees its blocks (it was
#: published mid-prefill and would otherwise age while its request decodes; only where its
#: bytes are at most half the prefix-closed KV before it) and dropped once the prefix-closed
#: block ending where it does leaves the device (no hit can reach it there any more);
#: ``alone``: it ages from its publication and leaves in its own turn of the eviction order;
#: ``auto`` (default): ``kv`` without lower tiers, ``alone`` with them (measured in
#: docs/vllm.md, section 6, "Checkpoints that live as their KV").
CHECKPOINT_LIFE: Final = ("auto", "kv", "alone")


def lives_with_kv(policy: str, has_tiers: bool) -> bool:
    """Whether the ``checkpoint_life`` ``policy`` ties checkpoints to their KV, in a cache
    with or without lower tiers."""
    return policy == "kv" or (policy == "auto" and not has_tiers)


def drops_dead_tails(policy: str, has_tiers: bool) -> bool:
    """Whether the ``dead_tails`` ``policy`` drops them, in a cache with or without lower
    tiers.  A plan for a cache that keeps them should share chunks between state slots
    (``make_plan(one_slot_chunks=False)``): kept tails hold cached blocks in every attention
    chunk, so few chunks drain whole for a slot of its own."""
    return policy == "drop" or (policy == "auto" and not has_tiers)


def _one_of(field: str, value: object, valid: tuple[str, ...], extra: str = "") -> None:
    if value not in valid:
        raise PlanError(f"{field}: unknown policy {value!r}; valid: {', '.join(valid)}{extra}")


def check_policies(
    *,
    publish: str,
    window_retention: str,
    checkpoint_admission: str,
    tier_admission: str,
    checkpoint_when_full: str | None,
    dead_tails: str,
    checkpoint_life: str = "auto",
) -> None:
    """Raise :class:`PlanError` for the first policy name that is not one of its valid ones."""
    if checkpoint_when_full is not None:
        by_layout = " (or None: by layout)"
        _one_of("checkpoint_when_full", checkpoint_when_full, CHECKPOINT_WHEN_FULL, by_layout)
    _one_of("tier_admission", tier_admission, TIER_ADMISSION)
    _one_of("checkpoint_admission", checkpoint_admission, CHECKPOINT_ADMISSION)
    _one_of("window_retention", window_retention, WINDOW_RETENTION)
    _one_of("publish", publish, PUBLISH_MODES)
    _one_of("dead_tails", dead_tails, DEAD_TAILS)
    _one_of("checkpoint_life", checkpoint_life, CHECKPOINT_LIFE)
