"""DiskTier's host memory stays bounded by the work in flight, not by the keys ever written
(review item 4): a key's generation is kept only while a read of it is in flight, yet a read
that raced a rewrite or a drop still never shows up as the newer copy; a bad read nobody asks
about again is forgotten after as many ticks as a checked copy, and a reader job's result lets
go of each copy once it is staged or given back.  Also :meth:`DiskTier.check_invariants`."""

from __future__ import annotations

import concurrent.futures as cf
import gc
import random
import threading
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import invariant

import test_engine_disk_tier as machine_tests
from hybridkv.engine.disk_tier import DiskTier
from hybridkv.errors import InvariantError
from hybridkv.storage.disk_slots import HEADER_BYTES, DiskSlots

SIZE = 64
TIMEOUT = 10.0


def payload(seed: int, size: int = SIZE) -> torch.Tensor:
    return torch.arange(size, dtype=torch.int64).add(seed * 13).remainder(251).to(torch.uint8)


def put(tier: DiskTier, key: tuple[int, int], seed: int) -> None:
    buf = tier.buffer(SIZE)
    buf.copy_(payload(seed))
    tier.write(key, 0, buf)


def settle_reads(tier: DiskTier) -> None:
    while tier.reading():
        tier.wait()


def drain_readers(tier: DiskTier) -> None:
    """Wait until the (one) reader thread has finished its jobs and their done-callbacks:
    they run on that thread before it takes the next job."""
    assert tier._readers is not None and tier.readers == 1
    tier._readers.submit(lambda: None).result(TIMEOUT)


class Gate:
    """Hold the first read of chosen keys in the reader thread: the read is made (the bytes of
    the copy on disk now), then waits until the test opens the gate, so a write or drop can
    come in between the read and its result, deterministically."""

    def __init__(self, tier: DiskTier, keys: list[tuple[int, int]]) -> None:
        self.read_done = {k: threading.Event() for k in keys}
        self.open = {k: threading.Event() for k in keys}
        real = tier._read

        def gated(key: tuple[int, int]) -> torch.Tensor | None:
            data = real(key)
            if key in self.open and not self.read_done[key].is_set():
                self.read_done[key].set()
                assert self.open[key].wait(TIMEOUT)
            return data

        tier._read = gated  # type: ignore[method-assign]


@pytest.fixture
def tier(tmp_path: Path) -> Iterator[DiskTier]:
    made = DiskTier(DiskSlots(tmp_path / "d", 4096 * SIZE, {"t": 1}, [SIZE]), readers=1)
    yield made
    made.close()


def test_generations_stay_within_the_reads_in_flight(tier: DiskTier) -> None:
    # Found by review: _gen kept an entry for every key ever written or dropped (100,000 keys
    # written and dropped, nothing on disk: 100,000 entries, 20 MiB).
    for h in range(2000):
        put(tier, (0, h), h)
        if h % 4:
            tier.drop((0, h))  # 1500 dropped, 500 stay
        if h % 100 == 99:
            tier.commit()
            tier._queue[-1][0].result(TIMEOUT)  # the writer is done with it (no flush)
            tier.tick()
            assert tier._gen == {}  # no read in flight: nothing can be stale
            assert tier._writing == {} and not tier._queue  # finished writes are let go too
            tier.check_invariants()
    tier.flush()
    assert len(tier.slots.entries) == 500 and tier._gen == {} and tier._writing == {}
    assert not tier._queue and tier._queued_bytes == 0
    # reads held in flight, three of their keys written again and one dropped: exactly those
    # four reads are stale, and only they keep a generation
    held = [(0, 4 * i) for i in range(10)]
    gate = Gate(tier, held)
    tier.prefetch(held)
    assert gate.read_done[held[0]].wait(TIMEOUT)
    for i, key in enumerate(held[:3]):
        put(tier, key, 5000 + i)
    tier.drop(held[3])
    for h in range(2000, 2300):  # unrelated keys come and go meanwhile
        put(tier, (0, h), h)
        tier.drop((0, h))
    tier.commit()
    assert sorted(tier._gen) == sorted(held[:4]) and len(tier._reads) == 10
    tier.check_invariants()
    tier.tick()  # the stale reads are forgotten at once (their copies go back once read)
    assert tier._gen == {} and sorted(tier._reads) == held[4:]
    for event in gate.open.values():
        event.set()
    settle_reads(tier)
    tier.flush()
    tier.tick()
    assert sorted(tier.staged) == held[4:] and tier._reads == {} and tier._gen == {}
    tier.check_invariants()


@pytest.mark.parametrize("seen_by", ["tick", "read_state"])
@pytest.mark.parametrize("then", ["rewrite", "drop"])
def test_a_read_older_than_a_rewrite_or_drop_never_serves_its_bytes(
    tier: DiskTier, then: str, seen_by: str
) -> None:
    # the guard the generations exist for, observed only through what the tier serves
    key = (0, 1)
    put(tier, key, 1)
    tier.flush()
    gate = Gate(tier, [key])
    tier.prefetch([key])
    assert gate.read_done[key].wait(TIMEOUT)  # the reader holds version 1's bytes
    if then == "rewrite":
        put(tier, key, 2)
    else:
        tier.drop(key)
    tier.flush()  # done on disk: no write of the key is in flight any more
    gate.open[key].set()
    drain_readers(tier)  # the old read is finished too
    if seen_by == "tick":
        tier.tick()
    state = tier.read_state(key)
    while state is None:
        tier.wait()
        state = tier.read_state(key)
    got = tier.take(key)
    if then == "rewrite":
        assert state is True and got is not None and torch.equal(got, payload(2))
    else:
        assert state is False and got is None
    assert tier._gen == {} and tier._reads == {}
    tier.check_invariants()


def test_a_read_that_raced_a_rewrite_never_shows_up_as_the_newer_copy(tier: DiskTier) -> None:
    old, new, dropped = (0, 1), (0, 2), (0, 3)
    for key in (old, dropped):
        put(tier, key, 1)
    tier.flush()
    gate = Gate(tier, [old, dropped])
    tier.prefetch([old])
    assert gate.read_done[old].wait(TIMEOUT)  # the reader holds version 1's bytes
    put(tier, old, 2)  # version 2, written while that read is in flight
    for h in range(100, 400):  # many other keys written and dropped: their entries go
        put(tier, (1, h), h)
        tier.drop((1, h))
    tier.flush()  # version 2 is on disk and no write of the key is in flight any more
    first = tier._reads[old][1]
    assert list(tier._gen) == [old]  # the stale read keeps its key's generation
    tier.check_invariants()
    # asked now, the stale read is dropped and the key read again (behind the held job)
    assert tier.read_state(old) is None
    assert tier._reads[old][1] is not first and tier._gen == {}
    spare = tier.spare_bytes
    gate.open[old].set()
    drain_readers(tier)
    assert old not in first.result()  # version 1's copy left the job's result ...
    # ... back to the spares, never staged (the second read then took it back out)
    assert tier.spare_bytes == spare
    settle_reads(tier)
    assert tier.read_state(old) is True
    assert torch.equal(tier.staged[old], payload(2))
    tier.check_invariants()

    # the same race through tick(), with a drop: the dropped key's old copy never shows up
    tier.prefetch([dropped])
    assert gate.read_done[dropped].wait(TIMEOUT)
    held = tier._reads[dropped][1]
    tier.drop(dropped)
    tier.commit()
    tier.tick()  # stale: forgotten while its job still runs
    assert dropped not in tier._reads and tier._gen == {}
    gate.open[dropped].set()
    drain_readers(tier)
    tier.flush()
    for _ in range(3):
        tier.tick()
    assert dropped not in tier.staged and dropped not in held.result()
    state = tier.read_state(dropped)
    while state is None:
        tier.wait()
        state = tier.read_state(dropped)
    assert state is False and tier.bad_reads == 1  # its entry is gone: a miss
    assert tier.take(new) is None  # never written: a miss, read inline
    tier.check_invariants()


def _corrupt(tier: DiskTier, key: tuple[int, int]) -> None:
    with (tier.slots.directory / "blocks.bin").open("r+b") as f:
        f.seek(tier.slots.entries[key].offset + HEADER_BYTES + 5)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 1]))


def test_a_bad_read_nobody_asks_about_is_forgotten_like_a_checked_copy(tier: DiskTier) -> None:
    # Found by review: tick() skipped finished bad reads, so one nobody asked about again
    # stayed in _reads for good, and its job's result kept the copies of the other keys it
    # read alive after they had been staged and given back.
    good, corrupt, asked, missing = [(0, 0), (0, 1)], (0, 2), (0, 3), (0, 99)
    for h in range(4):
        put(tier, (0, h), h)
    tier.flush()
    _corrupt(tier, corrupt)
    _corrupt(tier, asked)
    tier.prefetch([*good, corrupt, asked, missing])  # one reader: one job reads all five
    job = tier._reads[missing][1]
    settle_reads(tier)
    assert tier.tick() == 0
    assert sorted(tier.staged) == good
    assert job.result() == {corrupt: None, asked: None, missing: None}  # the copies left it
    assert sorted(tier._bad_at) == [corrupt, asked, missing]
    tier.check_invariants()
    ref = weakref.ref(job)
    del job
    left: list[tuple[int, list[tuple[int, int]], list[tuple[int, int]]]] = []
    for n in range(2, 13):
        if n == 5:
            assert tier.read_state(asked) is False  # asked in time: reported, counted
        gone = tier.tick()
        left.append((gone, sorted(tier.staged), sorted(tier._reads)))
        tier.check_invariants()
    # the checked copies (staged at tick 1) go at tick 10, 9 ticks unasked; so do the bad
    # reads seen at tick 1 (no later tick holds either)
    assert left[7] == (0, good, [corrupt, missing])  # tick 9
    assert left[8] == (2, [], [])  # tick 10
    assert tier.expired == 2 and tier.expired_bad == 2 and tier.bad_reads == 1
    assert tier._bad_at == {} and tier._reads == {} and tier._gen == {}
    gc.collect()
    assert ref() is None  # nothing keeps the job (nor anything it read) alive
    # a later ask reads the copy again, and reports it
    assert tier.read_state(corrupt) is None
    settle_reads(tier)
    assert tier.read_state(corrupt) is False and tier.bad_reads == 2


def test_a_read_that_raised_is_forgotten_too_and_reported_when_asked(tier: DiskTier) -> None:
    put(tier, (0, 1), 1)
    put(tier, (0, 2), 2)
    tier.flush()
    real = tier._read

    def failing(key: tuple[int, int]) -> torch.Tensor | None:
        if key[1] == 2:
            raise OSError("the disk went away")
        return real(key)

    tier._read = failing  # type: ignore[method-assign]
    tier.prefetch([(0, 2)])
    settle_reads(tier)
    tier.tick()
    assert list(tier._bad_at) == [(0, 2)]
    with pytest.raises(OSError, match="went away"):
        tier.read_state((0, 2))  # asked in time: the reader's error
    tier.prefetch([(0, 2)])
    settle_reads(tier)
    for _ in range(tier.max_staged_ticks + 1):
        tier.tick()
    assert list(tier._reads) == [(0, 2)]
    tier.tick()
    assert tier._reads == {} and tier._bad_at == {} and tier.expired_bad == 1
    tier.check_invariants()


def test_take_forgets_a_read_still_in_flight_of_the_same_key(tier: DiskTier) -> None:
    # take() reads inline; the copy the prefetch was making would only wait staged, unasked
    put(tier, (0, 1), 1)
    tier.flush()
    gate = Gate(tier, [(0, 1)])
    tier.prefetch([(0, 1)])
    assert gate.read_done[(0, 1)].wait(TIMEOUT)
    job = tier._reads[(0, 1)][1]
    got = tier.take((0, 1))
    assert got is not None and torch.equal(got, payload(1)) and tier._reads == {}
    gate.open[(0, 1)].set()
    drain_readers(tier)
    tier.tick()
    assert tier.staged == {} and job.result() == {}
    tier.give(got)
    tier.check_invariants()


@pytest.mark.parametrize("readers", [0, 2])
def test_check_invariants_holds_through_a_random_mix_of_operations(
    tmp_path: Path, readers: int
) -> None:
    sizes = (64, 192)
    tier = DiskTier(
        DiskSlots(tmp_path / "d", 1 << 14, {"t": 2}, list(sizes)),
        readers=readers,
        batch_bytes=256,
        max_pending_bytes=512,
    )
    tier.max_staged_ticks = 3
    rng = random.Random(7)
    model: dict[tuple[int, int], torch.Tensor] = {}
    borrowed: list[torch.Tensor] = []  # kept unchanged until settle()
    count = 0

    def data(group: int) -> torch.Tensor:
        nonlocal count
        count += 1
        return payload(count, sizes[group])

    def key() -> tuple[int, int]:
        return (rng.randrange(2), rng.randrange(6))

    def write() -> None:
        k = key()
        buf = tier.buffer(sizes[k[0]])
        model[k] = data(k[0])
        buf.copy_(model[k])
        tier.write(k, 0, buf)

    def write_run() -> None:
        keys = list(dict.fromkeys(key() for _ in range(3)))
        parts = [data(k[0]) for k in keys]
        buf = tier.buffer(sum(p.numel() for p in parts) + 8)  # a slack tail, as disk_runs
        buf[: buf.numel() - 8].copy_(torch.cat(parts))
        tier.write_run([(k, 0) for k in keys], [p.numel() for p in parts], buf)
        model.update(zip(keys, parts, strict=True))

    def write_borrowed() -> None:
        k = key()
        model[k] = data(k[0])
        borrowed.append(model[k])
        tier.write_borrowed([(k, 0)], [[model[k].numpy().data]])

    def drop() -> None:
        k = key()
        tier.drop(k)
        model.pop(k, None)

    def clear() -> None:
        tier.clear()
        model.clear()

    def check() -> None:
        keys = [key() for _ in range(3)]
        tier.prefetch(keys)
        for k in keys:
            state = tier.read_state(k)
            if state is None:
                continue
            assert state is (k in model)
            if state and rng.random() < 0.5:
                got = tier.take(k)
                assert got is not None and torch.equal(got, model[k])
                tier.give(got)

    def tick() -> None:
        tier.settle()
        borrowed.clear()
        tier.tick()

    ops: list[tuple[float, Callable[[], None]]] = [
        (4, write),
        (2, write_run),
        (1, write_borrowed),
        (3, drop),
        (0.2, clear),
        (1, tier.commit),
        (4, check),
        (3, tick),
    ]
    for _ in range(600):
        rng.choices([op for _, op in ops], [w for w, _ in ops])[0]()
        tier.check_invariants()
    tier.flush()
    tier.check_invariants()
    assert tier._gen.keys() <= tier._reads.keys()
    tier.close()


class CheckedDiskTierMachine(machine_tests.DiskTierMachine):
    """The stateful test of test_engine_disk_tier, with check_invariants after every step."""

    @invariant()
    def consistent(self) -> None:
        self.tier.check_invariants()


TestCheckedDiskTierMachine = CheckedDiskTierMachine.TestCase
TestCheckedDiskTierMachine.settings = settings(
    max_examples=25,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def test_check_invariants_names_what_is_broken(tier: DiskTier) -> None:
    for h in range(3):
        put(tier, (0, h), h)
    tier.flush()
    assert [tier.read_state((0, h)) for h in range(3)] == [None] * 3
    settle_reads(tier)
    assert [tier.read_state((0, h)) for h in range(3)] == [True] * 3
    put(tier, (0, 5), 5)  # one write queued, in the batch
    tier.check_invariants()
    staged = tier.staged[0, 0]
    done: cf.Future[object] = tier._writer.submit(lambda: None)
    done.result(TIMEOUT)

    def breaks(match: str, corrupt: Callable[[], object], undo: Callable[[], object]) -> None:
        corrupt()
        with pytest.raises(InvariantError, match=match):
            tier.check_invariants()
        undo()
        tier.check_invariants()

    def add(attr: str, n: int) -> Callable[[], None]:
        return lambda: setattr(tier, attr, getattr(tier, attr) + n)

    breaks(
        "writer queue holds 0 B, its count says 1",
        add("_queued_bytes", 1),
        add("_queued_bytes", -1),
    )
    breaks(
        "the batch holds 64 B, its count says 65", add("_batch_bytes", 1), add("_batch_bytes", -1)
    )
    breaks("spares hold .* spare_bytes says", add("_spare_bytes", 8), add("_spare_bytes", -8))
    breaks(
        "generation of \\(0, 9\\) kept with no read",
        lambda: tier._gen.__setitem__((0, 9), tier._clock),
        tier._gen.clear,
    )
    breaks(
        "staged copy \\(0, 0\\) is also a spare",
        lambda: tier.give(staged),
        lambda: tier.buffer(SIZE),  # takes it back out (the newest spare of its size)
    )
    breaks(
        "staged copy \\(0, 1\\) holds 32 B, the disk has an entry of 64 B",
        lambda: tier.staged.__setitem__((0, 1), torch.zeros(32, dtype=torch.uint8)),
        lambda: tier.staged.__setitem__((0, 1), tier.buffer(SIZE)),
    )
    breaks(
        "staged copy \\(0, 0\\) last asked for at tick 0, now 9: past max_staged_ticks=8",
        add("_ticks", 9),
        add("_ticks", -9),
    )
    breaks(
        "queued write of \\(0, 7\\) names a job not queued",
        lambda: tier._writing.__setitem__((0, 7), done),
        lambda: tier._writing.pop((0, 7)),
    )
    breaks(
        "staged copies \\[\\(0, 2\\)\\] have no age",
        lambda: tier._staged_at.pop((0, 2)),
        lambda: tier._stage((0, 2), tier.staged[0, 2]),
    )
