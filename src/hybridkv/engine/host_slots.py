"""The host tier's buffer as byte slots: one CPU tensor of the tier's capacity (pinned when
the cache lives on CUDA), carved by a bump pointer into slots of each group's packed block
size and reused through a free list per size, so steady-state copies allocate nothing."""

from __future__ import annotations

import torch

from hybridkv.errors import InvariantError
from hybridkv.storage import allocate_bytes

__all__ = ["HostSlots"]


class HostSlots:
    """Byte slots of one buffer: bump allocation plus a free list per slot size."""

    def __init__(self, capacity: int, pin: bool) -> None:
        (self.buffer,) = allocate_bytes(
            [capacity], torch.device("cpu"), pin, "host_memory_bytes", zeroed=False
        )
        self.top = 0
        self.free: dict[int, list[int]] = {}

    def take(self, size: int) -> int:
        """A free slot's offset, or -1 when there is no room."""
        spare = self.free.get(size)
        if spare:
            return spare.pop()
        if self.top + size > self.buffer.numel():
            return -1
        self.top += size
        return self.top - size

    def take_many(self, size: int, count: int) -> list[int]:
        """Offsets of ``count`` slots of ``size`` bytes, as :meth:`take` would give them one
        by one (-1 for each that finds no room), in one call."""
        out: list[int] = []
        spare = self.free.get(size)
        if spare:
            k = min(count, len(spare))
            out = spare[-k:]
            out.reverse()  # the order of k pops
            del spare[-k:]
        rest = count - len(out)
        if rest:
            fit = min(rest, (self.buffer.numel() - self.top) // size)
            out.extend(range(self.top, self.top + fit * size, size))
            self.top += fit * size
            out.extend([-1] * (rest - fit))
        return out

    def give(self, offset: int, size: int) -> None:
        self.free.setdefault(size, []).append(offset)

    def reset(self) -> None:
        self.top = 0
        self.free.clear()

    def check(self, used: list[tuple[int, int, str]]) -> None:
        """Raise :class:`~hybridkv.errors.InvariantError` unless the slots in ``used``
        (``(offset, bytes, what)``) and the free ones lie under the bump mark, within the
        buffer, with no two overlapping and no free slot listed twice."""
        spans = list(used)
        for size, free in self.free.items():
            if len(set(free)) != len(free):
                raise InvariantError(f"tier store: a free {size} B slot is listed twice")
            spans += [(offset, size, f"free slot of {size} B") for offset in free]
        end = 0
        last = "the buffer's start"
        for offset, size, what in sorted(spans):
            if offset < end:
                raise InvariantError(f"tier store: {what} at {offset} overlaps {last}")
            end, last = offset + size, what
        if end > self.top or self.top > self.buffer.numel():
            raise InvariantError(
                f"tier store: slots reach byte {end}, bump mark {self.top}, buffer "
                f"{self.buffer.numel()} B"
            )
