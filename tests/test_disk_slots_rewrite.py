"""DiskSlots: a rewrite of a stored key that finds no slot keeps the old copy (review finding:
the old copy was dropped before a slot for the new one was looked for, and lost)."""

from __future__ import annotations

from pathlib import Path

from hybridkv.storage.disk_slots import DiskSlots

FP = {"model": "m"}
SIZES = [96, 256]


def payload(seed: int, size: int) -> bytes:
    return bytes((seed * 31 + i * 7) % 251 for i in range(size))


def read(s: DiskSlots, key: tuple[int, int], size: int) -> bytes | None:
    out = bytearray(size)
    return bytes(out) if s.read(key, memoryview(out)) else None


def full(d: Path) -> DiskSlots:
    """Slots whose file holds five 96-byte entries, (0, 0) to (0, 4): all taken."""
    s = DiskSlots(d, 4 * 96, FP, SIZES)
    for h in range(5):
        assert s.write((0, h), 0, memoryview(payload(h, 96)))
    assert not s.write((0, 5), 0, memoryview(payload(5, 96))) and s.no_room == 1
    return s


def test_a_rewrite_that_finds_no_slot_keeps_the_old_copy(tmp_path: Path) -> None:
    s = full(tmp_path)
    before = dict(s.entries)
    # larger than the old copy's slot (and no other room): refused, the old copy stays
    assert not s.write((0, 1), 7, memoryview(payload(9, 256)))
    assert s.entries == before and s.no_room == 2
    assert read(s, (0, 1), 96) == payload(1, 96)
    s.check_invariants()
    # in a run too, where the other entries still go out
    assert s.write_many(
        [((0, 1), 0, memoryview(payload(9, 256))), ((0, 3), 0, memoryview(payload(30, 96)))]
    ) == [False, True]
    assert read(s, (0, 1), 96) == payload(1, 96) and read(s, (0, 3), 96) == payload(30, 96)
    s.check_invariants()
    s.close()
    again = DiskSlots(tmp_path, 4 * 96, FP, SIZES)
    assert sorted(again.entries) == [(0, h) for h in range(5)]
    assert read(again, (0, 1), 96) == payload(1, 96)
    again.check_invariants()
    again.close()


def test_a_rewrite_in_a_full_file_still_takes_the_old_copy_s_place(tmp_path: Path) -> None:
    s = full(tmp_path)
    offset = s.entries[0, 2].offset
    assert s.write((0, 2), 5, memoryview(payload(20, 96)))  # same size: rewritten in place
    assert s.entries[0, 2].offset == offset and s.entries[0, 2].tag == 5
    assert read(s, (0, 2), 96) == payload(20, 96)
    s.check_invariants()
    s.close()
