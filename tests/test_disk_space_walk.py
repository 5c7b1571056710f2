"""The recovery walk at open (storage/disk_space.py): a stale header inside a hole does not
lead it past a whole entry (review finding: it stepped over the hole with the smallest block
size whose header parsed, an earlier life's, whose payload a slot written since overlapped;
the walk then followed the old slots and lost the whole entry after the hole)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from hybridkv.storage.disk_slots import HEADER_BYTES, DiskSlots

FP = {"model": "m"}
SIZES = [96, 256]  # slots of 256 and 384 bytes


def payload(seed: int, size: int) -> bytes:
    return bytes((seed * 31 + i * 7) % 251 for i in range(size))


def read(s: DiskSlots, key: tuple[int, int], size: int) -> bytes | None:
    out = bytearray(size)
    return bytes(out) if s.read(key, memoryview(out)) else None


def open_slots(d: Path) -> DiskSlots:
    return DiskSlots(d, 8192, FP, SIZES)


def test_a_stale_header_inside_a_hole_does_not_hide_the_entry_after_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # life 1: ten small entries from the front, then the first two slots read as unwritten
    s = open_slots(tmp_path)
    for h in range(10):
        assert s.write((0, h), 0, memoryview(payload(h, 96)))
    assert [s.entries[0, h].offset for h in range(4)] == [0, 256, 512, 768]
    s.close()
    with (tmp_path / "blocks.bin").open("r+b") as f:
        for offset in (0, 256):
            f.seek(offset)
            f.write(bytes(HEADER_BYTES))
    # life 2: its walk ends at 0 (life 1's slots from 512 on stay in the file); it writes an
    # entry, then a run of a large entry A and a small one B, killed after B's write, before A's
    s = open_slots(tmp_path)
    assert s.recovered == [] and s._space.top == 0
    assert s.write((0, 100), 0, memoryview(payload(100, 96)))
    real = os.pwritev

    def a_never_written(fd: int, views: Any, offset: int) -> int:
        n = sum(memoryview(v).nbytes for v in views)
        return n if n == HEADER_BYTES + 256 else real(fd, views, offset)

    monkeypatch.setattr(os, "pwritev", a_never_written)
    big, small = memoryview(payload(200, 256)), memoryview(payload(300, 96))
    assert s.write_many([((1, 200), 0, big), ((0, 300), 0, small)]) == [True, True]
    monkeypatch.undo()
    assert (s.entries[1, 200].offset, s.entries[0, 300].offset) == (256, 640)
    s.close()
    # life 3: at A's slot (256) the header life 1 left at 512 parses, but B's header (640)
    # overwrote its payload: the walk steps over A's whole slot to B instead
    again = open_slots(tmp_path)
    assert (0, 2) not in again.entries
    assert again.entries[0, 300].offset == 640 and read(again, (0, 300), 96) == payload(300, 96)
    assert read(again, (0, 100), 96) == payload(100, 96) and (1, 200) not in again.entries
    # every entry it adopted reads back whole: B's and life 1's untouched ones past it
    for key, e in again.entries.items():
        want = payload(key[1], 96)
        assert read(again, key, e.size) == want, key
    assert sorted(again.entries) == [(0, 5), (0, 6), (0, 7), (0, 8), (0, 9), (0, 100), (0, 300)]
    again.check_invariants()
    again.close()
