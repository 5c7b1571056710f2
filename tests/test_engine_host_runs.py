"""Runs of host-tier copies (hybridkv.engine.host_runs): how blocks merge into runs, where a
block sits as a row, and that runs copy exactly the blocks' bytes both ways."""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from hybridkv.engine import host_runs
from hybridkv.engine.host_runs import (
    BlockRows,
    copy_all,
    load_parts,
    load_rows,
    merge_runs,
    spans,
    store_rows,
)

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def test_runs_merge_adjacent_slots_in_host_order_and_close_on_a_gap_or_another_table() -> None:
    size = 1000
    items = [
        (5000, 0, (7,), size),
        (6000, 0, (3,), size),  # after the first's end
        (4000, 0, (9,), size),  # before its start: sorted in
        (8000, 0, (1,), size),  # a gap: the run closes
        (9000, 1, (2,), size),  # adjacent, another table: closes too
        (10000, 1, (4,), size),
    ]
    assert merge_runs(items, 1 << 20) == [(4000, 0, [9, 7, 3]), (8000, 0, [1]), (9000, 1, [2, 4])]


def test_a_block_of_several_rows_keeps_its_rows_in_order() -> None:
    items = [(400, 0, (1, 2), 200), (600, 0, (5, 6), 200), (200, 0, (8, 3), 200)]
    assert merge_runs(items, 1 << 20) == [(200, 0, [8, 3, 1, 2, 5, 6])]


def test_a_run_stays_within_its_cap_and_a_cap_of_0_keeps_every_block_alone() -> None:
    items = [(i, 0, (i,), 1) for i in range(7)]
    assert [len(r) for _, _, r in merge_runs(list(items), 3)] == [3, 3, 1]
    assert merge_runs(list(items[:2]), 0) == [(0, 0, [0]), (1, 0, [1])]
    assert merge_runs([(0, 0, (5,), 10)], 1) == [(0, 0, [5])]  # a block over the cap: alone


def test_block_rows_place_blocks_by_length_and_offset_phase() -> None:
    buf = torch.zeros(1000, dtype=torch.uint8)
    rows = BlockRows((buf,))
    assert rows.place(0, 192, 96) == (0, 2)
    assert rows.place(0, 864, 96) == (0, 9)
    assert rows.place(0, 240, 96) == (1, 2)  # another phase (48): another table
    assert rows.place(0, 250, 96) == (2, 2)  # phase 58
    assert rows.place(0, 60, 30) == (3, 2)  # another length
    assert rows.tables[1].shape == (9, 96)  # bytes 48..912 of 1000
    assert [w is not None and tuple(w.shape) for w in rows.wide] == [
        (10, 12),
        (9, 12),
        False,  # rows starting at byte 58: not on 8-byte words
        False,  # 30 bytes a row
    ]
    rows.tables[0][2].fill_(7)
    assert int(buf[192:288].sum()) == 7 * 96  # rows are views of the buffer
    assert rows.view(0, 2).data_ptr() == buf[192:].data_ptr()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("length", [64, 40, 30])  # 8-byte words, or bytes
def test_store_and_load_rows_move_exactly_the_blocks(device: str, length: int) -> None:
    """Rows gathered into a host range and scattered back, in host order, for blocks of
    8-byte words and not (30 bytes), at a phase that is and is not word-aligned."""
    gen = torch.Generator().manual_seed(3)
    buf = torch.randint(0, 256, (64 * length + 8,), generator=gen, dtype=torch.uint8)
    buf = buf.to(device)
    rows = BlockRows((buf,))
    for phase in (0, 8, 3):
        table, _ = rows.place(0, phase, length)
        picked = random.Random(phase).sample(range(rows.tables[table].shape[0]), 9)
        host = torch.empty(9 * length + 16, dtype=torch.uint8, pin_memory=device == "cuda")
        for at in (0, 8, 5):  # host ranges at word and byte offsets
            out = host[at : at + 9 * length]
            out.fill_(0)
            store_rows(rows, table, picked, out, non_blocking=device == "cuda")
            if device == "cuda":
                torch.cuda.synchronize()
            want = torch.cat([rows.tables[table][r].cpu() for r in picked])
            assert torch.equal(out, want), (phase, at)
            targets = [r for r in range(rows.tables[table].shape[0]) if r not in picked][:9]
            load_rows(rows, table, targets, out, non_blocking=device == "cuda")
            got = torch.cat([rows.tables[table][r].cpu() for r in targets])
            assert torch.equal(got, want), (phase, at)
    one = torch.empty(length, dtype=torch.uint8)
    store_rows(rows, 0, [4], one, non_blocking=False)
    assert torch.equal(one, rows.tables[0][4].cpu())
    load_rows(rows, 0, [5], one, non_blocking=False)
    assert torch.equal(rows.tables[0][5].cpu(), one)


def test_spans_cut_rows_into_arithmetic_progressions() -> None:
    assert spans([]) == []
    assert spans([7]) == [(0, 1, 7, 1)]
    # a per-layer block (rows 3, 13, 23, 33), then another, then rows that go down
    assert spans([3, 13, 23, 33, 5, 15, 25, 35, 9, 4, 2]) == [
        (0, 4, 3, 10),
        (4, 4, 5, 10),
        (8, 1, 9, 1),  # 9 -> 4 goes down: 9 alone
        (9, 1, 4, 1),
        (10, 1, 2, 1),
    ]
    assert spans([1, 2, 3, 10, 11]) == [(0, 3, 1, 1), (3, 2, 10, 1)]
    assert spans([4, 4]) == [(0, 1, 4, 1), (1, 1, 4, 1)]  # no step of 0


@pytest.mark.parametrize("path", ["rows", "stretches", "index"])
@pytest.mark.parametrize("length", [64, 30])
def test_cpu_loads_by_row_stretch_or_index_write_exactly_the_rows(
    monkeypatch: pytest.MonkeyPatch, path: str, length: int
) -> None:
    """Loads of per-layer-like blocks (rows at one stride), of single rows and of rows going
    down, by a copy a row, by strided copies of stretches and by the indexed scatter alike,
    write exactly the picked rows and nothing else."""
    monkeypatch.setattr(host_runs, "CPU_WIDE_ROW", 0 if path == "rows" else 1 << 40)
    monkeypatch.setattr(host_runs, "CPU_WIDE_SPAN", 0 if path == "stretches" else 1 << 40)
    gen = torch.Generator().manual_seed(9)
    buf = torch.randint(0, 256, (200 * length,), dtype=torch.uint8, generator=gen)
    before = buf.clone()
    rows = BlockRows((buf,))
    table, _ = rows.place(0, 0, length)
    per_layer = [b + 50 * k for b in (7, 2, 11) for k in range(4)]  # 3 blocks of 4 rows
    picked = [*per_layer, 199, 120, 121, 122, 60, 59]
    host = torch.randint(0, 256, (len(picked) * length,), dtype=torch.uint8, generator=gen)
    load_rows(rows, table, picked, host, non_blocking=False)
    want = before.view(200, length).clone()
    for k, r in enumerate(picked):
        want[r] = host[k * length : (k + 1) * length]
    assert torch.equal(buf.view(200, length), want)
    out = torch.empty_like(host)
    store_rows(rows, table, picked, out, non_blocking=False)
    assert torch.equal(out, host)


@pytest.mark.parametrize("wide", [False, True], ids=["stretches", "a-row-each"])
@pytest.mark.parametrize("length", [64, 30])
def test_load_parts_writes_each_part_into_its_rows_in_one_copy(
    monkeypatch: pytest.MonkeyPatch, wide: bool, length: int
) -> None:
    """Blocks checked in tensors of their own (a disk load run): per-layer-like blocks,
    a single row and rows going down, all by one multi-tensor copy, write exactly their rows
    (as a load_rows each would) and nothing else; on 8-byte words and on bytes."""
    monkeypatch.setattr(host_runs, "CPU_WIDE_ROW", 0 if wide else 1 << 40)
    calls: list[int] = []
    real = torch._foreach_copy_

    def counted(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
        calls.append(len(dsts))
        real(dsts, srcs)

    monkeypatch.setattr(torch, "_foreach_copy_", counted)
    gen = torch.Generator().manual_seed(11)
    buf = torch.randint(0, 256, (200 * length,), dtype=torch.uint8, generator=gen)
    before = buf.clone()
    rows = BlockRows((buf,))
    table, _ = rows.place(0, 0, length)
    blocks = [tuple(b + 50 * k for k in range(4)) for b in (7, 2, 11)] + [(199,), (122, 121, 120)]
    parts = [
        (picked, torch.randint(0, 256, (len(picked) * length,), dtype=torch.uint8, generator=gen))
        for picked in blocks
    ]
    load_parts(rows, table, parts)
    assert len(calls) == 1
    want = before.view(200, length).clone()
    for picked, host in parts:
        for k, r in enumerate(picked):
            want[r] = host[k * length : (k + 1) * length]
    assert torch.equal(buf.view(200, length), want)


def test_stretches_are_made_once_per_block_and_view_exactly_its_rows() -> None:
    """A block's strided views are built on its first load and reused (the same tensors);
    on words and on bytes they cover exactly the picked rows, stretch by stretch."""
    buf = torch.arange(64 * 40, dtype=torch.int64).view(torch.uint8)  # 64 rows of 320 bytes
    rows = BlockRows((buf,))
    table, _ = rows.place(0, 0, 320)
    picked = (3, 13, 23, 40, 41)  # a stretch of step 10, then one of step 1
    for wide in (True, False):
        got = rows.stretches(table, picked, wide)
        assert rows.stretches(table, picked, wide) is got
        assert [(at, count) for at, count, _ in got] == [(0, 3), (3, 2)]
        table_view = rows.tables[table]
        for at, count, view in got:
            for k in range(count):
                want = table_view[picked[at + k]]
                assert torch.equal(view[k].view(torch.uint8).reshape(-1), want)
                assert view[k].data_ptr() == want.data_ptr()


@pytest.mark.parametrize(("pieces", "size", "shared"), [(64, 4096, True), (4, 64 << 10, False)])
def test_copy_all_splits_small_copies_over_threads_with_the_same_result(
    monkeypatch: pytest.MonkeyPatch, pieces: int, size: int, shared: bool
) -> None:
    """Many small copies (CPU_SERIAL_ELEMENTS or fewer each, CPU_SHARED_MIN bytes in all) go
    out in one share per torch thread, the first on the caller; ones torch spreads over its
    threads itself as one multi-tensor copy.
    Either way every destination holds its source and nothing else changed."""
    monkeypatch.setattr(host_runs, "CPU_SHARED_MIN", 64 << 10)
    monkeypatch.setattr(host_runs, "_pool", None)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    calls: list[tuple[int, str]] = []
    real = torch._foreach_copy_

    def counted(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
        calls.append((len(dsts), threading.current_thread().name))
        real(dsts, srcs)

    monkeypatch.setattr(torch, "_foreach_copy_", counted)
    gen = torch.Generator().manual_seed(5)
    out = torch.zeros(pieces * size + 7, dtype=torch.uint8)
    srcs = [torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen) for _ in range(pieces)]
    dsts = [out[i * size : (i + 1) * size] for i in range(pieces)]
    copy_all(dsts, srcs)
    assert torch.equal(out[: pieces * size], torch.cat(srcs))
    assert not out[pieces * size :].any()
    if shared:
        assert sorted(n for n, _ in calls) == [pieces // 2, pieces // 2]
        assert sorted(name.startswith("hybridkv-copy") for _, name in calls) == [False, True]
    else:
        assert calls == [(pieces, threading.current_thread().name)]
    copy_all([], [])  # nothing to copy: no call
    assert len(calls) == (2 if shared else 1)


def test_copy_all_makes_its_threads_again_in_a_forked_child(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A pool made by another process (a forked child inherits the object, not its threads)
    is never handed work: the child makes its own."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    stale = ThreadPoolExecutor(1)
    stale.shutdown()
    monkeypatch.setattr(host_runs, "_pool", (stale, 1, -1))  # made by "another process"
    monkeypatch.setattr(host_runs, "CPU_SHARED_MIN", 0)
    srcs = [torch.full((64,), i, dtype=torch.int64) for i in range(8)]
    dsts = [torch.zeros(64, dtype=torch.int64) for _ in range(8)]
    copy_all(dsts, srcs)  # the stale pool is shut down: handing it work would raise
    assert all(torch.equal(d, s) for d, s in zip(dsts, srcs, strict=True))
    assert host_runs._pool is not None
    assert host_runs._pool[0] is not stale and host_runs._pool[2] == os.getpid()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_child_forked_while_the_pool_lock_is_held_still_copies() -> None:
    """A parent thread may hold the pool's lock at the fork; the child's copy of that lock
    would never be released, so the child takes a fresh lock (it deadlocked before)."""
    with host_runs._pool_lock:
        pid = os.fork()
        if pid == 0:  # the child: copy on its own threads, then leave without cleanup
            code = 1
            try:
                host_runs.CPU_SHARED_MIN = 0
                torch.set_num_threads(2)
                srcs = [torch.full((64,), i, dtype=torch.int64) for i in range(8)]
                dsts = [torch.zeros(64, dtype=torch.int64) for _ in range(8)]
                copy_all(dsts, srcs)
                ok = all(torch.equal(d, s) for d, s in zip(dsts, srcs, strict=True))
                code = 0 if ok and host_runs._pool is not None else 1
            finally:
                os._exit(code)
    for _ in range(200):  # up to 10 s
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked child hung on the pool lock")
    assert os.waitstatus_to_exitcode(status) == 0


def test_copy_all_shares_write_a_cache_made_in_inference_mode(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Inference mode is per thread: a cache made under torch.inference_mode() holds
    inference tensors, and the helper thread's share must write them in that mode too (it
    raised outside it)."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr(host_runs, "_pool", None)
    monkeypatch.setattr(host_runs, "CPU_SHARED_MIN", 0)
    with torch.inference_mode():
        buf = torch.zeros(64 * 256, dtype=torch.uint8)
        rows = BlockRows((buf,))
        table, _ = rows.place(0, 0, 256)
        parts = [
            (tuple(b + 16 * k for k in range(4)), torch.full((4 * 256,), b + 1, dtype=torch.uint8))
            for b in range(16)
        ]
        load_parts(rows, table, parts)
    view = buf.view(64, 256)
    for b in range(16):
        for k in range(4):
            assert bool((view[b + 16 * k] == b + 1).all())
