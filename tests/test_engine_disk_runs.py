"""Disk stores in runs: TierStore gathers consecutive disk stores of row blocks into one
staging buffer per run and queues it with DiskTier.write_run (one checksum job, one ready
event), or, for a cache in host memory, queues the blocks' own bytes with
DiskTier.write_borrowed (no staging copy; apply waits for them); every entry still commits,
fails or reads back on its own."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import invariant, rule

from hybridkv.cache.tiers import TierOp
from hybridkv.engine import disk_runs
from hybridkv.engine.disk_tier import DiskTier
from hybridkv.engine.errors import EngineError
from hybridkv.engine.tier_store import TierStore
from hybridkv.storage import KVCacheStorage, LayoutKind, gather
from hybridkv.storage.disk_slots import HEADER_BYTES, DiskSlots
from test_engine_tier_store_stateful import HostTier
from test_storage_factories import SPECS, group, uniform_layout


def _filled(storage: KVCacheStorage, seed: int = 3) -> None:
    gen = torch.Generator().manual_seed(seed)
    for buf in storage.buffers:
        buf.copy_(torch.randint(0, 256, buf.shape, generator=gen, dtype=torch.uint8))


def _bytes(storage: KVCacheStorage, g: int, b: int) -> torch.Tensor:
    return gather(storage.descriptor(g, [b]), storage.buffers).clone()


class DiskStores(HostTier):
    """The host tier's machine (stores in batches, loads into other blocks, drops, clears)
    on a disk tier instead, its runs growing to two blocks' bytes; every entry reads back as
    the bytes its block held when it was stored."""

    tier = "disk"
    borrow = False

    def __init__(self) -> None:
        super().__init__()
        self.store.close()
        sizes = [g.block_bytes for g in self.storage.layout.groups]
        self.dir = Path(tempfile.mkdtemp())
        slots = DiskSlots(self.dir, 64 * max(sizes), {"t": 1}, sizes)
        self.store = TierStore(self.storage, 0, slots, readers=1)
        self.store._borrow = self.borrow
        assert self.store.disk is not None
        self.store.disk.batch_bytes = 2 * max(sizes)

    @rule()
    def missing_load_changes_nothing(self) -> None:
        before = [buf.clone() for buf in self.storage.buffers]
        with pytest.raises(Exception, match="failed its check"):
            self.store.apply([TierOp("load", "disk", 0, 10**9, self.ids[0][0])])
        assert all(torch.equal(a, c) for a, c in zip(before, self.storage.buffers, strict=True))

    @invariant()
    def slots_and_bytes_check_out(self) -> None:
        disk = self.store.disk
        assert disk is not None
        disk.flush()
        assert set(disk.slots.entries) == set(self.held)
        for key, expected in self.held.items():
            out = torch.empty(expected.numel(), dtype=torch.uint8)
            assert disk.slots.read(key, out.numpy().data), key
            assert torch.equal(out, expected), key

    def teardown(self) -> None:
        self.store.close()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.mark.parametrize("borrow", [False, True], ids=["staged", "borrowed"])
@pytest.mark.parametrize("kind", [LayoutKind.CROSS_LAYER, LayoutKind.PER_LAYER])
@pytest.mark.parametrize("strategy", ["pools", "uniform"])
def test_disk_store_state_machine(
    kind: LayoutKind, strategy: str, borrow: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(disk_runs, "FIRST_RUN_BYTES", 1)  # a first run of one block
    attrs = {"kind": kind, "strategy": strategy, "borrow": borrow}
    machine = type("Machine", (DiskStores,), attrs)
    machine.TestCase.settings = settings(
        max_examples=20,
        stateful_step_count=20,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    machine.TestCase().runTest()


def _one_group_store(
    tmp_path: Path,
    layers: int = 2,
    *,
    borrow: bool = False,
    kind: LayoutKind = LayoutKind.CROSS_LAYER,
) -> tuple[KVCacheStorage, TierStore, int]:
    """A disk tier over one full-attention group; stores through staging copies (as on
    CUDA) unless ``borrow``."""
    full = group(0, SPECS["full"], tuple(range(layers)))
    layout = uniform_layout((full,), num_blocks=40)
    storage = KVCacheStorage(layout, kind=kind)
    _filled(storage)
    size = full.block_bytes
    store = TierStore(storage, 0, DiskSlots(tmp_path, 64 * size, {"t": 2}, [size]), readers=0)
    store._borrow = borrow
    return storage, store, size


def test_disk_stores_go_in_runs_that_double(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    storage, store, size = _one_group_store(tmp_path)
    disk = store.disk
    assert disk is not None
    monkeypatch.setattr(disk_runs, "FIRST_RUN_BYTES", 2 * size)
    disk.batch_bytes = 8 * size
    runs: list[list[int]] = []
    real = DiskTier.write_run

    def spy(self: DiskTier, entries: Any, sizes: Any, data: Any, ready: Any = None) -> None:
        runs.append([h for (_, h), _ in entries])
        real(self, entries, sizes, data, ready)

    monkeypatch.setattr(DiskTier, "write_run", spy)
    blocks = list(range(1, 21))
    store.apply([TierOp("store", "disk", 0, 100 + b, b) for b in blocks])
    # runs of 2, 4, 8 blocks, then capped at the tier's batch size (8 blocks' bytes)
    assert [len(r) for r in runs] == [2, 4, 8, 6]
    assert [h for r in runs for h in r] == [100 + b for b in blocks]
    disk.flush()
    for b in blocks:
        out = torch.empty(size, dtype=torch.uint8)
        assert disk.slots.read((0, 100 + b), out.numpy().data)
        assert torch.equal(out, _bytes(storage, 0, b))
    assert store.stored == 20
    store.close()


def test_a_run_is_one_writer_job_and_a_failed_entry_is_only_that_miss(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    storage, store, _ = _one_group_store(tmp_path)
    disk = store.disk
    assert disk is not None
    jobs = []
    real_many = DiskSlots.write_many

    def counted(self: DiskSlots, items: Any, helper: Any = None) -> list[bool]:
        jobs.append(len(items))
        return real_many(self, items, helper)

    monkeypatch.setattr(DiskSlots, "write_many", counted)
    real_pwritev = os.pwritev
    bad = bytes(_bytes(storage, 0, 6).numpy())

    def flaky(fd: int, views: Any, offset: int) -> int:
        if b"".join(bytes(v) for v in views)[HEADER_BYTES:] == bad:  # block 6's payload
            raise OSError(5, "Input/output error")
        return real_pwritev(fd, views, offset)

    monkeypatch.setattr(os, "pwritev", flaky)
    store.apply([TierOp("store", "disk", 0, 200 + b, b) for b in (5, 6, 7)])
    disk.flush()
    assert jobs == [3]
    assert disk.slots.write_errors == 1
    assert set(disk.slots.entries) == {(0, 205), (0, 207)}
    for key, b, ok in (((0, 205), 5, True), ((0, 206), 6, False), ((0, 207), 7, True)):
        assert disk.read_state(key) is ok
        if ok:
            got = disk.take(key)
            assert got is not None and torch.equal(got, _bytes(storage, 0, b))
            disk.give(got)
    store.close()


def test_write_run_refuses_bad_arguments_and_queues_nothing(tmp_path: Path) -> None:
    slots = DiskSlots(tmp_path, 1 << 16, {"t": 3}, [64])
    tier = DiskTier(slots, readers=0)
    data = tier.buffer(128)
    tier.staged[0, 1] = tier.buffer(64)  # a checked copy a bad call must not drop
    bad: list[tuple[Any, Any, str]] = [
        ([((0, 1), 0), ((0, 2), 0)], [64], "2 entries"),
        ([((0, 1), 0), ((0, 2), 0)], [-64, 192], "sizes \\[-64, 192\\]"),
        ([((0, 1), 0), ((0, 2),)], [64, 64], "1 malformed"),
        ([((0, 1), 0), ((0, 2), 0)], [64, 128], "192 bytes of a 128-byte buffer"),
    ]
    for entries, sizes, match in bad:
        with pytest.raises(ValueError, match=match):
            tier.write_run(entries, sizes, data)
    assert tier._batch == [] and tier._gen == {} and (0, 1) in tier.staged
    tier.write_run([], [], data)  # nothing to write: the buffer goes back to the spares
    assert tier.buffer(128) is data
    tier.close()


def test_spare_buffers_stay_within_their_bound(tmp_path: Path) -> None:
    slots = DiskSlots(tmp_path, 1 << 16, {"t": 4}, [64])
    tier = DiskTier(slots, readers=0, max_pending_bytes=256, batch_bytes=128)
    assert tier.max_spare_bytes == 512
    made = [tier.buffer(n) for n in (64, 128, 256, 256, 64)]
    for t in made:
        tier.give(t)
    # 64 + 128 + 256 kept (448 bytes); the second 256 would pass 512: freed; the last 64 kept
    assert tier.spare_bytes == 512
    assert tier.buffer(256) is made[2] and tier.spare_bytes == 256
    assert tier.buffer(256) is not made[3]  # it was freed, a new one is made
    tier.close()


@pytest.mark.parametrize("staged", [True, False], ids=["cuda-path", "cpu-path"])
def test_a_disk_load_run_without_a_disk_tier_is_an_engine_error(staged: bool) -> None:
    full = group(0, SPECS["full"], (0, 1))
    storage = KVCacheStorage(uniform_layout((full,), num_blocks=8), kind=LayoutKind.CROSS_LAYER)
    store = TierStore(storage, 1 << 16)
    store._async = staged  # both paths send disk loads in runs
    with pytest.raises(EngineError, match="stores no disk tier"):
        store.apply([TierOp("load", "disk", 0, 5, 1)])
    store.close()
