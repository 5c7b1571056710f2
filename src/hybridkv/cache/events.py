"""KV-cache events for an external router (a prefix-aware load balancer).

A router mirrors which prefixes an engine holds by replaying these events in order:
:class:`BlockStored` adds hashes, :class:`BlockRemoved` drops them, :class:`AllBlocksCleared`
drops everything; ``medium`` says whether a block is on the device or in a lower tier
(``host``, ``disk``: a block read back from a tier is stored on the device again, and a tier
entry that moves down is removed from one tier and stored in the next).  Hashes are the
manager's group-level block hashes
(:mod:`hybridkv.cache.hashing`); a group with block size ``k * hash_block_size`` stores the
hash of the last hash block of each of its blocks.  A device ``BlockStored`` also carries the
token ids its blocks cover and the request's LoRA id, as vLLM's event of that name does, so a
router that keys on hashes of its own (computed from tokens) can follow it too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

from hybridkv.cache.types import BlockHash

__all__ = ["AllBlocksCleared", "BlockRemoved", "BlockStored", "EventLog", "KVEvent"]


class BlockStored(NamedTuple):
    """Consecutive blocks of group ``group_id`` entered the prefix cache.

    ``block_hashes`` in prefix order; ``parent_block_hash`` is the group-level hash of the block
    just before the first one (``None`` when the first is the request's first block);
    ``token_count`` tokens are covered (``len(block_hashes) * block_size``), and
    ``token_ids`` are those tokens (the request's own, in order; for a state group, the
    tokens its checkpoints' blocks span), with ``lora_id`` the request's LoRA id (``None``
    without one).  A lower tier's events name one block each, in the order the blocks went
    down (often the tail first), with ``parent_block_hash`` ``None`` and no token ids:
    unknown there, not a first block or an empty one (a tier entry keeps neither its parent
    nor its tokens).  Other extra keys (a cache salt, multimodal items) are in the hashes
    only.
    """

    group_id: int
    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_count: int
    block_size: int
    #: Where the blocks are: ``device``, or a lower tier (``host``, ``disk``).
    medium: str = "device"
    #: The ``token_count`` tokens the blocks cover (empty for a lower tier's event).
    token_ids: tuple[int, ...] = ()
    #: The LoRA adapter the blocks were computed with (``None``: none or, in a lower tier's
    #: event, unknown).
    lora_id: int | str | None = None


class BlockRemoved(NamedTuple):
    """Blocks of group ``group_id`` left the prefix cache (evicted) of ``medium``."""

    group_id: int
    block_hashes: tuple[BlockHash, ...]
    medium: str = "device"


class AllBlocksCleared(NamedTuple):
    """The whole prefix cache was reset."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EventLog:
    """An append-only buffer of events; :meth:`take` drains it.  Disabled logs record nothing."""

    __slots__ = ("_coupled", "_events", "_sink", "enabled", "orphaned", "tracks_evictions")

    def __init__(self, *, enabled: bool) -> None:
        self.enabled = enabled
        self._events: list[KVEvent] = []
        self._sink: Callable[[int, Sequence[int], Sequence[int]], None] | None = None
        self._coupled: frozenset[int] = frozenset()
        #: Hashes the coupled groups evicted since the owner last drained this list (see
        #: :meth:`couple`).
        self.orphaned: list[BlockHash] = []
        #: Whether pools must report evictions (:meth:`evicted`): events on, a sink set or
        #: coupled groups.
        self.tracks_evictions = enabled

    def couple(self, group_ids: Sequence[int]) -> None:
        """Also note in :attr:`orphaned` the hashes every eviction of ``group_ids`` removes
        (the groups whose entries under one hash serve a hit only together: the parts of a
        state checkpoint, :mod:`hybridkv.cache.coupling`)."""
        self._coupled = frozenset(group_ids)
        self._track()

    def _track(self) -> None:
        self.tracks_evictions = self.enabled or self._sink is not None or bool(self._coupled)

    def set_eviction_sink(
        self, sink: Callable[[int, Sequence[int], Sequence[int]], None] | None
    ) -> None:
        """Also hand every eviction to ``sink(group_id, hashes, blocks)`` (the lower cache
        tiers; ``blocks[i]`` still holds the data of ``hashes[i]``)."""
        self._sink = sink
        self._track()

    def evicted(
        self, group_id: int, block_hashes: tuple[BlockHash, ...], blocks: Sequence[int]
    ) -> None:
        """The pool evicted these cached blocks of ``group_id`` (held in ``blocks``, whose
        data is intact until the step that reuses them runs) to reuse them."""
        if self.enabled:
            self._events.append(BlockRemoved(group_id, block_hashes))
        if self._sink is not None:
            self._sink(group_id, block_hashes, blocks)
        if group_id in self._coupled:
            self.orphaned.extend(block_hashes)

    def stored(
        self,
        group_id: int,
        block_hashes: tuple[BlockHash, ...],
        parent: BlockHash | None,
        block_size: int,
        token_ids: tuple[int, ...] = (),
        lora_id: int | str | None = None,
    ) -> None:
        self._events.append(
            BlockStored(
                group_id,
                block_hashes,
                parent,
                len(block_hashes) * block_size,
                block_size,
                "device",
                token_ids,
                lora_id,
            )
        )

    def removed(self, group_id: int, block_hashes: tuple[BlockHash, ...]) -> None:
        self._events.append(BlockRemoved(group_id, block_hashes))

    def tier_stored(self, group_id: int, block_hash: int, tier: str, block_size: int) -> None:
        """Block ``block_hash`` of ``group_id`` entered lower tier ``tier``."""
        h = BlockHash(block_hash)
        self._events.append(BlockStored(group_id, (h,), None, block_size, block_size, tier))

    def tier_removed(self, group_id: int, block_hash: int, tier: str) -> None:
        """Block ``block_hash`` of ``group_id`` left lower tier ``tier``."""
        self._events.append(BlockRemoved(group_id, (BlockHash(block_hash),), tier))

    def cleared(self) -> None:
        self._events.append(AllBlocksCleared())

    def take(self) -> list[KVEvent]:
        """Every event since the last call, oldest first; the log is empty afterwards."""
        out = self._events
        self._events = []
        return out

    def __len__(self) -> int:
        return len(self._events)
