"""Ids and typed results of the cache manager.

Units: *tokens* are token positions or counts; *blocks* are block ids of one group (see
:mod:`hybridkv.plan.layout` for how a block id maps to bytes).  Block id ``0`` is the null
block: it stands for a position the request no longer (or never) keeps and holds no data.
"""

from __future__ import annotations

from typing import NamedTuple, NewType

__all__ = [
    "AllocationResult",
    "BlockHash",
    "BlockId",
    "BlockMove",
    "ComputedBlocks",
    "StateCopy",
    "StateSlot",
    "TierLoad",
]

#: A block id inside one group's id space (``0`` is the null block).
BlockId = NewType("BlockId", int)
#: A chained hash of a token prefix (non-negative, below 2**256).
BlockHash = NewType("BlockHash", int)


class StateCopy(NamedTuple):
    """Copy one recurrent-state slot onto another: ``dst[:] = src`` for every member layer.

    Both ids are blocks of group ``group_id``; one block of a state group is one state slot.
    """

    group_id: int
    src: BlockId
    dst: BlockId


class BlockMove(NamedTuple):
    """Compaction moved a block: copy block ``src`` of group ``group_id`` to block ``dst``
    (every member layer) before the next step reads or writes either; tables that held
    ``src`` hold ``dst`` now (:meth:`KVCacheManager.compact`)."""

    group_id: int
    src: BlockId
    dst: BlockId


class StateSlot(NamedTuple):
    """One state slot of group ``group_id`` (used for slots to zero before a step)."""

    group_id: int
    block: BlockId


class ComputedBlocks(NamedTuple):
    """The prefix-cache hit of a request, as :meth:`KVCacheManager.get_computed_blocks` finds it.

    ``blocks[g]`` is what group ``g`` would hold for the hit: for attention kinds one entry per
    block of the first ``num_computed_tokens`` tokens (``0`` where the kind keeps nothing); for a
    state kind the one checkpoint block to restore (empty when the hit is 0).
    ``num_computed_tokens`` is a multiple of the layout's ``schedule_alignment`` and smaller
    than the request's token count.  ``junction_tokens`` (>= ``num_computed_tokens``) is where
    this prompt leaves the cached prefix: the shortest standalone hit of the prefix-closed
    groups (full attention, MLA), or without those the longest standalone hit of the other
    attention groups.  A scheduler that ends a step exactly there lets state groups checkpoint
    where the next request sharing the prefix needs it.  Nothing is referenced: pass the
    object back to ``allocate_slots`` before any other allocation, or call
    ``get_computed_blocks`` again.
    """

    blocks: tuple[tuple[BlockId, ...], ...]
    num_computed_tokens: int
    junction_tokens: int


class TierLoad(NamedTuple):
    """Copy the block with hash ``block_hash`` of group ``group_id`` from lower tier ``tier``
    (``host`` or ``disk``) into device block ``block`` before the step reads it."""

    group_id: int
    block: BlockId
    tier: str
    block_hash: BlockHash


class AllocationResult(NamedTuple):
    """What one successful ``allocate_slots`` call changed.

    ``new_block_ids[g]``: freshly allocated block ids this call appended to group ``g``'s
    block table (hit blocks are the ones ``get_computed_blocks`` returned; a state group's
    checkpoint slots appear only in ``copies_after``).  ``copies_before``: state copies to
    perform before the step runs (restore a cached checkpoint into the running slot).
    ``zero_before``: state slots to zero before the step (a fresh running state).
    ``copies_after``: state copies to perform after the step ran (save the running state into
    a checkpoint slot).  ``loads``: blocks of the hit read back from a lower tier
    (:class:`~hybridkv.cache.tiers.TierLoad`), to copy into their device blocks before
    ``copies_before`` and before the step reads them.
    """

    new_block_ids: tuple[tuple[BlockId, ...], ...]
    copies_before: tuple[StateCopy, ...]
    zero_before: tuple[StateSlot, ...]
    copies_after: tuple[StateCopy, ...]
    loads: tuple[TierLoad, ...] = ()
