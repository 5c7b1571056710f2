"""The host tier's buffer as byte slots: one CPU tensor of the tier's capacity (pinned when
the cache lives on CUDA), carved from the front into slots of each group's packed block size;
a freed slot joins its free neighbours (:class:`hybridkv.extents.FreeExtents`), so space one
size freed serves another later, and steady-state copies allocate nothing."""

from __future__ import annotations

import torch

from hybridkv.extents import FreeExtents
from hybridkv.storage import allocate_bytes

__all__ = ["HostSlots"]


class HostSlots:
    """Byte slots of one buffer (see the module doc)."""

    def __init__(self, capacity: int, pin: bool) -> None:
        (self.buffer,) = allocate_bytes(
            [capacity], torch.device("cpu"), pin, "host_memory_bytes", zeroed=False
        )
        #: The buffer's free space.
        self.space = FreeExtents(capacity, lower_top=True)

    @property
    def top(self) -> int:
        """Bytes carved from the front (slots and free extents lie below)."""
        return self.space.top

    def take(self, size: int) -> int:
        """A free slot's offset, or -1 when there is no room."""
        got = self.space.take(size)
        return -1 if got is None else got[0]

    def take_many(self, size: int, count: int) -> list[int]:
        """Offsets of ``count`` slots of ``size`` bytes, as :meth:`take` gives them one by
        one (-1 for each that finds no room)."""
        return [self.take(size) for _ in range(count)]

    def give(self, offset: int, size: int) -> None:
        self.space.give(offset, size)

    def reset(self) -> None:
        self.space.reset()

    def check(self, used: list[tuple[int, int, str]]) -> None:
        """Raise :class:`~hybridkv.errors.InvariantError` unless the slots in ``used``
        (``(offset, bytes, what)``) and the free extents lie under the bump mark, within the
        buffer, with no two overlapping (:meth:`FreeExtents.check`)."""
        self.space.check(used)
