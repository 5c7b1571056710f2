"""DiskTier.take: a finished good prefetch of the key serves its load (review finding: take
read the key from disk again and threw the prefetched copy away)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hybridkv.engine.disk_tier import DiskTier
from hybridkv.storage.disk_slots import DiskSlots

TIMEOUT = 10.0


def test_take_uses_a_finished_prefetch_instead_of_reading_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    slots = DiskSlots(tmp_path, 4096, {"t": 1}, [64])
    tier = DiskTier(slots, readers=1)
    for h, fill in ((1, 7), (2, 9)):
        buf = tier.buffer(64)
        buf.fill_(fill)
        tier.write((0, h), 0, buf)
    tier.flush()
    reads: list[tuple[int, int]] = []
    real = slots.read

    def counted(key: tuple[int, int], out: memoryview) -> bool:
        reads.append(key)
        return real(key, out)

    monkeypatch.setattr(slots, "read", counted)
    tier.prefetch([(0, 1), (0, 2)])
    tier._reads[0, 1][1].result(TIMEOUT)  # both read and checked, neither staged yet
    assert reads == [(0, 1), (0, 2)]
    got = tier.take((0, 1))
    assert got is not None and torch.equal(got, torch.full((64,), 7, dtype=torch.uint8))
    assert reads == [(0, 1), (0, 2)] and (0, 1) not in tier._reads
    tier.check_invariants()
    tier.give(got)
    # a prefetch a later write made stale is not used: the key is read again, after the write
    buf = tier.buffer(64)
    buf.fill_(3)
    tier.write((0, 2), 0, buf)
    again = tier.take((0, 2))
    assert again is not None and torch.equal(again, torch.full((64,), 3, dtype=torch.uint8))
    assert reads == [(0, 1), (0, 2), (0, 2)]
    tier.give(again)
    tier.check_invariants()
    tier.close()
