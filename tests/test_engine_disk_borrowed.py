"""Disk stores of a cache in host memory: TierStore queues each block's own byte ranges
(DiskTier.write_borrowed, no staging copy), the writer and the helper thread checksum and
write them (DiskSlots.write_many), and apply waits for them before anything writes the
storage (a load) and before it returns.  The hypothesis machine of test_engine_disk_runs runs
this path too (its "borrowed" cases)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from hybridkv.cache.tiers import TierOp
from hybridkv.engine.disk_tier import DiskTier
from hybridkv.engine.tier_store import TierStore
from hybridkv.storage import KVCacheStorage, LayoutKind
from hybridkv.storage.disk_slots import HEADER_BYTES, DiskSlots
from test_engine_disk_runs import _bytes, _one_group_store


def _borrowed(
    tmp_path: Path, layers: int = 2, kind: LayoutKind = LayoutKind.CROSS_LAYER
) -> tuple[KVCacheStorage, TierStore, DiskTier, int]:
    """A one-group CPU store whose disk stores are borrowed, its disk tier, a block's bytes."""
    storage, store, size = _one_group_store(tmp_path, layers, borrow=True, kind=kind)
    assert store.disk is not None
    return storage, store, store.disk, size


def _read(disk: DiskTier, key: tuple[int, int], size: int) -> torch.Tensor | None:
    out = torch.empty(size, dtype=torch.uint8)
    return out if disk.slots.read(key, out.numpy().data) else None


@pytest.mark.parametrize("kind", [LayoutKind.CROSS_LAYER, LayoutKind.PER_LAYER])
def test_borrowed_stores_go_in_one_job_and_are_written_when_apply_returns(
    kind: LayoutKind, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    storage, store, disk, size = _borrowed(tmp_path, 4, kind)
    disk.batch_bytes = 8 * size  # staged writes would go in jobs of 8 blocks; these do not
    runs: list[list[int]] = []
    pieces: list[int] = []
    jobs: list[int] = []
    real, real_many = DiskTier.write_borrowed, DiskSlots.write_many

    def spy(self: DiskTier, entries: Any, payloads: Any) -> None:
        runs.append([h for (_, h), _ in entries])
        pieces.extend(len(p) for p in payloads)
        real(self, entries, payloads)

    def many(self: DiskSlots, items: Any, helper: Any = None) -> list[bool]:
        jobs.append(len(items))
        return real_many(self, items, helper)

    monkeypatch.setattr(DiskTier, "write_borrowed", spy)
    monkeypatch.setattr(DiskSlots, "write_many", many)
    blocks = list(range(1, 21))
    before = {b: _bytes(storage, 0, b) for b in blocks}
    store.apply([TierOp("store", "disk", 0, 100 + b, b) for b in blocks])
    assert runs == [[100 + b for b in blocks]] and jobs == [20]
    # a cross-layer block is one range; a per-layer one a range per layer and K/V
    assert set(pieces) == {1 if kind is LayoutKind.CROSS_LAYER else 8}
    assert not disk._queue and len(disk.slots.entries) == 20  # written before apply returned
    for buf in storage.buffers:
        buf.zero_()  # the next step writes the blocks: what is on disk stays
    for b in blocks:
        got = _read(disk, (0, 100 + b), size)
        assert got is not None and torch.equal(got, before[b])
    assert store.stored == 20
    store.close()


def test_a_load_into_a_block_just_stored_waits_for_its_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    storage, store, disk, size = _borrowed(tmp_path)
    store.apply([TierOp("store", "disk", 0, 206, 6)])
    six, five = _bytes(storage, 0, 6), _bytes(storage, 0, 5)
    real = DiskSlots._pwritev

    def slow(self: DiskSlots, pieces: Any, offset: int) -> None:
        time.sleep(0.2)  # an entry's write (header and payload): late
        real(self, pieces, offset)

    monkeypatch.setattr(DiskSlots, "_pwritev", slow)
    # block 5 goes to disk, then the entry of block 6 is loaded into it, in one batch
    store.apply([TierOp("store", "disk", 0, 105, 5), TierOp("load", "disk", 0, 206, 5)])
    got = _read(disk, (0, 105), size)
    assert got is not None and torch.equal(got, five)  # written before the load overwrote it
    assert torch.equal(_bytes(storage, 0, 5), six)
    store.close()


def test_a_failed_payload_in_a_borrowed_run_misses_only_that_entry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    storage, store, disk, _ = _borrowed(tmp_path)
    real = os.pwritev
    bad = bytes(_bytes(storage, 0, 6).numpy())

    def flaky(fd: int, views: Any, offset: int) -> int:
        if b"".join(bytes(v) for v in views)[HEADER_BYTES:] == bad:
            raise OSError(5, "Input/output error")
        return real(fd, views, offset)

    monkeypatch.setattr(os, "pwritev", flaky)
    store.apply([TierOp("store", "disk", 0, 200 + b, b) for b in (5, 6, 7)])
    assert disk.slots.write_errors == 1
    assert set(disk.slots.entries) == {(0, 205), (0, 207)}
    assert disk.read_state((0, 206)) is False
    for key, b in (((0, 205), 5), ((0, 207), 7)):
        assert disk.read_state(key) is True
        got = disk.take(key)
        assert got is not None and torch.equal(got, _bytes(storage, 0, b))
        disk.give(got)
    store.close()
