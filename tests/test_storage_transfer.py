"""Transfer descriptors: exact coalesced ranges, typed errors, copies between storages."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import textwrap
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as hst

from hybridkv.errors import StorageError
from hybridkv.plan import MemoryLayout
from hybridkv.specs import StateMixer, StateSpec, StateTensor
from hybridkv.storage import (
    BlockLiveness,
    BlockRangeError,
    ByteRange,
    FreedBlockError,
    KVCacheStorage,
    LayoutKind,
    TransferError,
    copy_blocks,
    gather,
    scatter,
    transfer,
)
from hybridkv.storage import storage as storage_module
from test_storage_factories import SPECS, build, group, mixed_groups, pools_layout

ROOT = Path(__file__).resolve().parent.parent


class Live:
    """A stand-in for the cache manager's pools."""

    def __init__(self, blocks: dict[int, set[int]]) -> None:
        self.blocks = blocks

    def is_allocated(self, group_id: int, block_id: int) -> bool:
        return block_id in self.blocks.get(group_id, set())


def _full(page_bytes: int | None = None, extra: int = 0) -> KVCacheStorage:
    g = group(0, SPECS["full"], (0, 1), page_bytes=page_bytes)  # 256 B pages, 512 B blocks
    return KVCacheStorage(pools_layout((g,), num_blocks=10, extra=extra))


def test_adjacent_blocks_coalesce() -> None:
    storage = _full()
    desc = storage.descriptor(0, [3, 4, 9, 5])
    assert desc.ranges == (
        ByteRange(0, 1536, 1024),
        ByteRange(0, 4608, 512),
        ByteRange(0, 2560, 512),
    )
    assert desc.total_bytes == 4 * 512
    assert desc.piece_lengths == (512,)


def test_padding_is_not_transferred() -> None:
    padded_pool = _full(extra=64)  # 64 B of pool padding per block
    assert padded_pool.descriptor(0, [3, 4]).ranges == (
        ByteRange(0, 1728, 512),
        ByteRange(0, 2304, 512),
    )
    padded_page = _full(page_bytes=320)  # 64 B page tails
    assert padded_page.descriptor(0, [2]).ranges == (
        ByteRange(0, 1280, 256),
        ByteRange(0, 1600, 256),
    )


def test_state_tensors_are_separate_ranges_when_split() -> None:
    spec = StateSpec(
        mixer=StateMixer.MAMBA2,
        tensors=(
            StateTensor(name="conv", shape=(3, 4), dtype="bf16"),
            StateTensor(name="ssm", shape=(2, 4), dtype="fp32"),
        ),
    )
    aligned = KVCacheStorage(pools_layout((group(0, spec, (0,), page_bytes=128),), num_blocks=4))
    # ssm (32 B) at 0, conv (24 B) at 64: two ranges per slot, piece-major order
    assert aligned.descriptor(0, [1, 2]).ranges == (
        ByteRange(0, 128, 32),
        ByteRange(0, 256, 32),
        ByteRange(0, 192, 24),
        ByteRange(0, 320, 24),
    )
    packed = KVCacheStorage(pools_layout((group(0, spec, (0,)),), num_blocks=4))
    assert packed.descriptor(0, [1, 2]).ranges == (ByteRange(0, 56, 112),)


def test_per_layer_costs_ranges_per_layer() -> None:
    g = group(0, SPECS["full"], (0, 1, 2))
    layout = pools_layout((g,), num_blocks=10)
    cross = KVCacheStorage(layout).descriptor(0, [2, 7, 5])
    per_layer = KVCacheStorage(layout, kind=LayoutKind.PER_LAYER).descriptor(0, [2, 7, 5])
    assert len(cross.ranges) == 3
    assert len(per_layer.ranges) == 3 * 3 * 2  # blocks x layers x (K, V)
    contiguous = KVCacheStorage(layout, kind=LayoutKind.PER_LAYER).descriptor(0, [4, 5, 6])
    assert len(contiguous.ranges) == 3 * 2


def test_descriptor_errors() -> None:
    storage = _full()
    with pytest.raises(BlockRangeError, match=r"\[0\] invalid .*block 0 is the null block"):
        storage.descriptor(0, [0])
    with pytest.raises(
        BlockRangeError, match=r"\[10\] invalid for group 0; valid ids are \[1, 10\)"
    ):
        storage.descriptor(0, [1, 10])
    with pytest.raises(BlockRangeError, match=r"ids repeat: \[2\]"):
        storage.descriptor(0, [2, 3, 2])
    live = Live({0: {1, 2}})
    assert isinstance(live, BlockLiveness)
    assert storage.descriptor(0, [1, 2], liveness=live).total_bytes == 1024
    with pytest.raises(FreedBlockError, match=r"\[3\] are not allocated to group 0"):
        storage.descriptor(0, [1, 3], liveness=live)


def test_gather_scatter_copy_round_trip_between_storages() -> None:
    layout = build("pools", mixed_groups())
    a = KVCacheStorage(layout)
    b = KVCacheStorage(layout, kind=LayoutKind.CROSS_LAYER)
    gen = torch.Generator().manual_seed(0)
    for buf in a.buffers:
        buf.copy_(torch.randint(0, 256, buf.shape, generator=gen, dtype=torch.uint8))
    for gid in range(len(layout.groups)):
        src = a.descriptor(gid, [1, 2, 3])  # one range
        dst = b.descriptor(gid, [5, 1, 3])  # cut differently
        assert src.matches(dst)
        assert copy_blocks(src, a.buffers, dst, b.buffers) == src.total_bytes
        assert torch.equal(gather(src, a.buffers), gather(dst, b.buffers))
        host = torch.empty(src.total_bytes + 8, dtype=torch.uint8)  # a staging buffer
        gather(src, a.buffers, host)
        back = b.descriptor(gid, [4])
        scatter(a.descriptor(gid, [2]), a.buffers, torch.zeros(back.total_bytes, dtype=torch.uint8))
        scatter(a.descriptor(gid, [1, 2, 3]), a.buffers, host)
        assert torch.equal(gather(src, a.buffers), host[: src.total_bytes])
    for member in b.placement.groups[0].members:
        got, sent = b.kv_view(member.layer).key[5], a.kv_view(member.layer).key[1]
        assert torch.equal(got.view(torch.int16), sent.view(torch.int16))  # bits: NaNs inside


def test_descriptors_of_other_layout_kinds_or_page_orders_do_not_match() -> None:
    # Found by review: matching compared piece lengths only, so a byte copy from NHD pages
    # into HND ones (or cross-layer into head-major) went through and scrambled K and V.
    layout = build("pools", mixed_groups())
    a = KVCacheStorage(layout, kind=LayoutKind.CROSS_LAYER, page_order="nhd")
    for kind, order, shown in (
        (LayoutKind.CROSS_LAYER, "hnd", "cross_layer/nhd, the destination's cross_layer/hnd"),
        (
            LayoutKind.CROSS_LAYER_HEAD_MAJOR,
            "nhd",
            "cross_layer/nhd, the destination's cross_layer_head_major/nhd",
        ),
    ):
        b = KVCacheStorage(layout, kind=kind, page_order=order)
        src, dst = a.descriptor(0, [1]), b.descriptor(0, [1])
        assert src.piece_lengths == dst.piece_lengths and not src.matches(dst)
        before = [x.clone() for x in b.buffers]
        with pytest.raises(TransferError, match=f"laid out {shown}: a byte copy would scramble"):
            copy_blocks(src, a.buffers, dst, b.buffers)
        assert all(torch.equal(x, y) for x, y in zip(before, b.buffers, strict=True))
    assert a.descriptor(0, [1]).matches(KVCacheStorage(layout).descriptor(0, [3]))


@pytest.mark.parametrize("extra", [32, 0])  # padded blocks (a range each) / one range
def test_copy_blocks_refuses_ranges_that_overlap_in_memory(extra: int) -> None:
    # Found by review: blocks [1, 2] -> [2, 3] of one buffer copied block 1 into block 3 when
    # padded (block 2 was overwritten before it was read) and raised torch's RuntimeError
    # when not; a copy onto itself stays allowed.
    storage = _full(extra=extra)
    key = storage.kv_view(0).key
    for b in range(1, 4):
        key[b].fill_(b)
    before = [x.clone() for x in storage.buffers]
    with pytest.raises(TransferError, match="source and destination ranges overlap in memory"):
        copy_blocks(
            storage.descriptor(0, [1, 2]),
            storage.buffers,
            storage.descriptor(0, [2, 3]),
            storage.buffers,
        )
    assert all(torch.equal(x, y) for x, y in zip(before, storage.buffers, strict=True))
    same = storage.descriptor(0, [2, 5])
    assert copy_blocks(same, storage.buffers, storage.descriptor(0, [2, 6]), storage.buffers)
    assert [int(key[b].flatten()[0]) for b in (2, 5, 6)] == [2, 0, 0]


def test_storage_refuses_buffers_and_moves_of_the_wrong_shape() -> None:
    layout = build("pools", mixed_groups())
    with pytest.raises(StorageError, match=r"buffers\[0\]: need a flat uint8 tensor, got bytes"):
        KVCacheStorage(layout, buffers=[b"x"])  # type: ignore[list-item]
    with pytest.raises(StorageError, match="buffers: need a sequence of flat uint8 tensors"):
        KVCacheStorage(layout, buffers=3)  # type: ignore[arg-type]
    storage = KVCacheStorage(layout)
    with pytest.raises(StorageError, match=r"moves: need an iterable of .* got NoneType"):
        storage.move_blocks(None)  # type: ignore[arg-type]
    with pytest.raises(StorageError, match=r"moves: \(0, 1\) is not a \(group, src, dst\) triple"):
        storage.move_blocks([(0, 2, 3), (0, 1)])  # type: ignore[list-item]
    shared = KVCacheStorage(layout, buffers=(b for b in storage.buffers))  # any iterable
    assert shared.buffers[0].data_ptr() == storage.buffers[0].data_ptr()


def test_transfer_errors_change_nothing() -> None:
    a, b = _full(), _full(page_bytes=320)
    src, dst = a.descriptor(0, [1]), b.descriptor(0, [1])
    with pytest.raises(TransferError, match=r"source \(pieces \(512,\), 1 blocks\)"):
        copy_blocks(src, a.buffers, dst, b.buffers)
    with pytest.raises(TransferError, match="packed: 10 bytes, the descriptor needs 512"):
        scatter(src, a.buffers, torch.ones(10, dtype=torch.uint8))
    with pytest.raises(TransferError, match="flat contiguous uint8"):
        gather(src, [a.buffers[0].view(torch.int16)])
    with pytest.raises(TransferError, match="leaves buffer 0"):
        gather(src, [torch.zeros(100, dtype=torch.uint8)])
    assert int(a.buffers[0].count_nonzero()) == 0


_CHILD = textwrap.dedent(
    """
    import json, sys
    from multiprocessing import resource_tracker, shared_memory
    import torch
    from hybridkv.plan import MemoryLayout
    from hybridkv.storage import KVCacheStorage, copy_blocks

    layout = MemoryLayout.from_dict(json.loads(sys.argv[1]))
    a_shm = shared_memory.SharedMemory(name=sys.argv[2])
    b_shm = shared_memory.SharedMemory(name=sys.argv[3])
    for shm in (a_shm, b_shm):  # the parent owns them: do not unlink at exit (Python < 3.13)
        resource_tracker.unregister(shm._name, "shared_memory")
    a = KVCacheStorage(layout, buffers=[torch.frombuffer(a_shm.buf, dtype=torch.uint8)])
    b = KVCacheStorage(layout, buffers=[torch.frombuffer(b_shm.buf, dtype=torch.uint8)])
    for gid, (src, dst) in enumerate(json.loads(sys.argv[4])):
        copy_blocks(a.descriptor(gid, src), a.buffers, b.descriptor(gid, dst), b.buffers)
    del a, b
    print("copied")
    """
)


def test_copy_between_two_processes_through_shared_memory() -> None:
    layout = build("arena", mixed_groups(), num_chunks=14)
    size = layout.total_bytes
    a_shm = shared_memory.SharedMemory(create=True, size=size)
    b_shm = shared_memory.SharedMemory(create=True, size=size)
    try:
        a_buf = torch.frombuffer(a_shm.buf, dtype=torch.uint8)
        b_buf = torch.frombuffer(b_shm.buf, dtype=torch.uint8)
        a_buf.copy_(torch.randint(0, 256, (size,), dtype=torch.uint8))
        b_buf.zero_()
        plan = []
        for gid in range(len(layout.groups)):
            per = layout.blocks_per_chunk(gid)
            plan.append(([(1 + 2 * gid) * per], [(2 + 2 * gid) * per]))
        proc = subprocess.run(
            [
                sys.executable,
                "-c",
                _CHILD,
                json.dumps(layout.to_dict()),
                a_shm.name,
                b_shm.name,
                json.dumps(plan),
            ],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
            cwd=ROOT,
        )
        assert proc.returncode == 0, proc.stderr
        a = KVCacheStorage(layout, buffers=[a_buf])
        b = KVCacheStorage(layout, buffers=[b_buf])
        for gid, (src, dst) in enumerate(plan):
            sent = gather(a.descriptor(gid, src), a.buffers)
            got = gather(b.descriptor(gid, dst), b.buffers)
            assert torch.equal(sent, got)
        assert int(b_buf.count_nonzero()) <= sum(g.used_block_bytes for g in layout.groups)
        del a, b, a_buf, b_buf, sent, got
        gc.collect()
    finally:
        a_shm.close()
        b_shm.close()
        a_shm.unlink()
        b_shm.unlink()


def test_descriptor_matches_layout_json_round_trip() -> None:
    layout = build("uniform", mixed_groups())
    again = MemoryLayout.from_dict(json.loads(json.dumps(layout.to_dict())))
    assert KVCacheStorage(again).descriptor(1, [2]) == KVCacheStorage(layout).descriptor(1, [2])


@pytest.mark.parametrize("extra", [0, 32])
@pytest.mark.parametrize("kind", [LayoutKind.PER_LAYER, LayoutKind.CROSS_LAYER])
def test_row_copies_equal_the_copy_per_range(
    kind: LayoutKind, extra: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The row path (indexed copies per buffer, CUDA's for descriptors of many ranges) packs
    and unpacks exactly the bytes the copy per range does, in the same order; forced on the
    CPU here with every threshold lowered.  Padded pools (``extra``) make rows that do not
    divide a buffer: those descriptors fall back to the copy per range."""
    layout = pools_layout(mixed_groups(), num_blocks=8, extra=extra)
    a = KVCacheStorage(layout, kind=kind)
    b = KVCacheStorage(layout, kind=kind)
    gen = torch.Generator().manual_seed(11)
    for x, y in zip(a.buffers, b.buffers, strict=True):
        x.copy_(torch.randint(0, 256, x.shape, generator=gen, dtype=torch.uint8))
        y.copy_(x)
    planned = 0
    for gid in range(len(layout.groups)):
        ids, other = [5, 1, 2], [7, 3, 4]  # out of order: the stream follows the descriptor
        desc = a.descriptor(gid, ids)
        want = gather(desc, a.buffers)
        scatter(a.descriptor(gid, other), a.buffers, want)
        with monkeypatch.context() as m:
            m.setattr(transfer, "ROW_COPY_DEVICES", ("cpu", "cuda"))
            m.setattr(transfer, "ROW_COPY_MIN_RANGES", 1)
            m.setattr(transfer, "ROW_COPY_MIN_BYTES", 1)
            planned += transfer._row_plan(desc, b.buffers) is not None
            got = gather(desc, b.buffers)
            assert torch.equal(got, want)
            scatter(b.descriptor(gid, other), b.buffers, got)
        for x, y in zip(a.buffers, b.buffers, strict=True):
            assert torch.equal(x, y)
    assert planned >= (len(layout.groups) if extra == 0 else 1)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@settings(max_examples=60, deadline=None)
@given(
    moves=hst.lists(
        hst.tuples(hst.integers(0, 5), hst.integers(1, 7), hst.integers(1, 7)).filter(
            lambda m: m[1] != m[2]
        ),
        max_size=12,
    ),
    kind=hst.sampled_from([LayoutKind.PER_LAYER, LayoutKind.CROSS_LAYER]),
    run_bytes=hst.sampled_from([1, 1024, 32 << 20]),
)
def test_move_blocks_equals_the_moves_one_by_one(
    device: str, moves: list[tuple[int, int, int]], kind: LayoutKind, run_bytes: int
) -> None:
    """Compaction's moves as runs (on the CPU one copy per coalesced range, on CUDA one
    gather and one scatter) leave the storage as copying each block in turn does: chains (a
    block moved on), a block read twice and a block written twice included, and runs cut
    by size (a run of one block, or of a few)."""
    layout = pools_layout(mixed_groups(), num_blocks=8)
    a = KVCacheStorage(layout, kind=kind, device=device)
    gen = torch.Generator().manual_seed(5)
    for x in a.buffers:
        x.copy_(torch.randint(0, 256, x.shape, generator=gen, dtype=torch.uint8).to(device))
    want = [x.clone() for x in a.buffers]
    total = 0
    for g, src, dst in moves:
        total += copy_blocks(a.descriptor(g, [src]), want, a.descriptor(g, [dst]), want)
    storage_module.MOVE_RUN_BYTES = run_bytes
    try:
        assert a.move_blocks(moves) == total
    finally:
        storage_module.MOVE_RUN_BYTES = 32 << 20
    for x, y in zip(a.buffers, want, strict=True):
        assert torch.equal(x, y)


def test_move_blocks_cuts_runs_at_a_repeated_block_and_at_the_size_cap(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    storage = _full()  # 512-byte blocks, one group
    calls: list[tuple[int, ...]] = []
    real = storage_module.copy_blocks

    def spy(src: Any, *rest: Any, **kw: Any) -> int:
        calls.append(tuple(src.block_ids))
        return int(real(src, *rest, **kw))

    monkeypatch.setattr(storage_module, "copy_blocks", spy)
    moves = [(0, 1, 5), (0, 2, 6), (0, 5, 7), (0, 3, 8), (0, 4, 9)]
    assert storage.move_blocks(moves) == 5 * 512
    assert calls == [(1, 2), (5, 3, 4)]  # 5 was written: the third move starts a run
    calls.clear()
    monkeypatch.setattr(storage_module, "MOVE_RUN_BYTES", 1024)  # two blocks a run
    storage.move_blocks(moves)
    assert calls == [(1, 2), (5, 3), (4,)]
    with pytest.raises(StorageError, match="group_id"):
        storage.move_blocks([(0, 1, 2), (7, 1, 2)])


def test_move_blocks_refuses_a_block_out_of_range_and_copies_nothing() -> None:
    storage = _full()
    storage.buffers[0].copy_(torch.arange(storage.buffers[0].numel()) % 251)
    before = storage.buffers[0].clone()
    with pytest.raises(BlockRangeError, match=r"\b10\b"):
        storage.move_blocks([(0, 1, 2), (0, 3, 10)])
    assert torch.equal(storage.buffers[0], before)
