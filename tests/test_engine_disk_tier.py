"""DiskTier (the disk tier's threads) against a dict: whatever order writes, drops, clears
and checked reads come in, a read returns the bytes last written under that key, or fails
for a key with none, never other bytes."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from hybridkv.engine.disk_tier import DiskTier
from hybridkv.storage.disk_slots import DiskCacheError, DiskSlots

SIZES = (64, 192)


def data(seed: int, size: int) -> torch.Tensor:
    return torch.arange(size, dtype=torch.int64).add(seed * 7).remainder(251).to(torch.uint8)


class DiskTierMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp())
        slots = DiskSlots(self.dir, 1024, {"t": 1}, SIZES)
        # small batches and queue: jobs interleave with reads
        self.tier = DiskTier(slots, readers=2, batch_bytes=128, max_pending_bytes=256)
        self.tier.max_staged_ticks = 2
        self.model: dict[tuple[int, int], torch.Tensor] = {}
        self.count = 0

    @rule(group=st.integers(0, 1), h=st.integers(0, 5))
    def write(self, group: int, h: int) -> None:
        self.count += 1
        payload = data(self.count, SIZES[group])
        buf = self.tier.buffer(payload.numel())
        buf.copy_(payload)
        self.tier.write((group, h), 0, buf)
        self.model[group, h] = payload

    @rule(group=st.integers(0, 1), h=st.integers(0, 5))
    def drop(self, group: int, h: int) -> None:
        self.tier.drop((group, h))
        self.model.pop((group, h), None)

    @rule()
    def clear(self) -> None:
        self.tier.clear()
        self.model.clear()

    @rule()
    def commit(self) -> None:
        self.tier.commit()

    @rule(group=st.integers(0, 1), h=st.integers(0, 5), wait=st.booleans())
    def check_and_load(self, group: int, h: int, wait: bool) -> None:
        key = (group, h)
        self.tier.prefetch([key])
        state = self.tier.read_state(key)
        while wait and state is None:
            self.tier.wait()
            state = self.tier.read_state(key)
        if state is None:
            return  # still in flight: asked again later
        if key not in self.model:
            assert state is False  # no entry (never written, dropped, or full): a miss
            return
        # the file has room for all 12 keys at once (headers included), so every write lands
        assert state is True
        got = self.tier.take(key)
        assert got is not None and torch.equal(got, self.model[key])
        self.tier.give(got)

    @rule()
    def tick(self) -> None:
        before = set(self.tier.staged)
        gone = self.tier.tick()
        assert len(before - set(self.tier.staged)) == gone

    @invariant()
    def staged_are_current(self) -> None:
        for key, tensor in self.tier.staged.items():
            assert key in self.model and torch.equal(tensor, self.model[key])
        ages = self.tier._staged_at
        assert list(ages) == sorted(ages, key=ages.__getitem__) and set(ages) == set(
            self.tier.staged
        )
        assert all(self.tier._ticks - at <= self.tier.max_staged_ticks for at in ages.values())

    def teardown(self) -> None:
        self.tier.flush()
        for key, payload in self.model.items():  # what stayed, reads back exactly or misses
            out = torch.empty(payload.numel(), dtype=torch.uint8)
            assert self.tier.slots.read(key, out.numpy().data)
            assert torch.equal(out, payload)
        self.tier.close()
        shutil.rmtree(self.dir, ignore_errors=True)


TestDiskTierMachine = DiskTierMachine.TestCase
TestDiskTierMachine.settings = settings(
    max_examples=40,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def test_a_forked_child_is_refused_instead_of_waiting_for_threads_it_lacks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer and reader threads stay in the parent at a fork: in the child, a write
    handed to them or a read asked of them is refused with one clear error (it hung)."""
    size = 64
    tier = DiskTier(DiskSlots(tmp_path / "d", 8 * size, {"t": 1}, [size]), readers=2)
    data = tier.buffer(size)
    data.fill_(3)
    tier.write((0, 1), 0, data)
    tier.flush()
    monkeypatch.setattr(os, "getpid", lambda: tier._pid + 1)  # as in a forked child
    with pytest.raises(DiskCacheError, match="forked child"):
        tier.write((0, 2), 0, tier.buffer(size))
    with pytest.raises(DiskCacheError, match="forked child"):
        tier.prefetch([(0, 1)])
    monkeypatch.undo()
    tier.prefetch([(0, 1)])  # the parent goes on
    while tier.reading():
        tier.wait()
    assert tier.read_state((0, 1)) is True
    tier.close()


def test_a_run_the_writer_cannot_make_is_logged_and_the_batch_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Found by review: an exception inside a writer job vanished (finished jobs were popped
    # unread) and skipped the rest of the job, so a drop queued after the failed run never
    # ran; and close() raised before it gave the threads and the file back.
    slots = DiskSlots(tmp_path, 1 << 16, {"t": 1}, [64])
    tier = DiskTier(slots, readers=0)
    tier.write((0, 1), 0, torch.ones(64, dtype=torch.uint8))
    tier.flush()
    real = slots.write_many

    def failing(items: Any, helper: Any = None) -> list[bool]:
        if any(key == (0, 2) for key, _, _ in items):
            raise MemoryError("the writer ran out")
        return real(items, helper)

    monkeypatch.setattr(slots, "write_many", failing)
    tier.write((0, 2), 0, torch.full((64,), 2, dtype=torch.uint8))
    tier.drop((0, 1))  # queued after the failing run, in the same job
    tier.flush()
    assert tier.failed_runs == 1 and "a run of 1 writes failed" in caplog.text
    assert sorted(slots.entries) == []  # the drop ran; the failed write stored nothing
    monkeypatch.setattr(tier, "commit", lambda: (_ for _ in ()).throw(OSError("gone")))
    with pytest.raises(OSError, match="gone"):
        tier.close()
    assert slots._fd < 0 and tier._writer._shutdown  # given back all the same


def test_staged_copies_nobody_asks_for_are_given_back_and_close_frees_the_rest(
    tmp_path: Path,
) -> None:
    # Found by review: a checked copy read for an admission that then went without its hit
    # (or was aborted) stayed staged until its entry left the disk, host memory outside
    # every budget; and close() kept them.
    size = 64
    tier = DiskTier(DiskSlots(tmp_path / "d", 8 * size, {"t": 1}, [size]), readers=0)
    for h in range(3):
        tier.write((0, h), 0, data(h, size))
    tier.flush()
    assert [tier.read_state((0, h)) for h in range(3)] == [True, True, True]
    tier.max_staged_ticks = 3
    assert [tier.tick() for _ in range(2)] == [0, 0]
    assert tier.read_state((0, 1)) is True  # asked again: young again
    assert tier.tick() == 0 and tier.tick() == 2  # (0, 0) and (0, 2): 4 ticks unasked
    assert list(tier.staged) == [(0, 1)] and tier.expired == 2
    assert tier.spare_bytes == 2 * size  # their tensors are back for reuse
    assert tier.read_state((0, 0)) is True  # a later ask reads it again, checked
    got = tier.take((0, 0))
    assert got is not None and torch.equal(got, data(0, size))
    tier.close()
    assert tier.staged == {}
    tier.close()  # a second close does nothing


def test_a_closed_disk_tier_refuses_work_with_its_own_error(tmp_path: Path) -> None:
    size = 64
    tier = DiskTier(DiskSlots(tmp_path / "d", 8 * size, {"t": 1}, [size]), readers=2)
    tier.close()
    calls = [
        lambda: tier.write((0, 1), 0, tier.buffer(size)),
        lambda: tier.drop((0, 1)),
        lambda: tier.clear(),
        lambda: tier.prefetch([(0, 1)]),
        lambda: tier.read_state((0, 1)),
        lambda: tier.take((0, 1)),
    ]
    for call in calls:
        with pytest.raises(DiskCacheError, match="used after close"):
            call()
