"""Views: zero-copy, exact offsets, every spec kind x layout kind x strategy round trip."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from hybridkv.errors import StorageError
from hybridkv.plan import MemoryLayout
from hybridkv.specs import FullAttentionSpec, StateMixer, StateSpec, StateTensor
from hybridkv.storage import (
    BlockRangeError,
    KVCacheStorage,
    LayoutKind,
    LayoutUnsupportedError,
    UnknownLayerError,
    ViewKindError,
    gather,
    scatter,
)
from test_storage_factories import (
    KINDS,
    SPECS,
    STRATEGIES,
    arena_layout,
    build,
    group,
    mixed_groups,
    owned_ids,
    pools_layout,
    uniform_layout,
)

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Same-size integer reinterpretation (works on strided views)."""
    return t.view(_BITS[t.element_size()])


def _nonzero_pattern(shape: tuple[int, ...], itemsize: int, gen: torch.Generator) -> torch.Tensor:
    """Random bit patterns whose every byte is non-zero."""
    raw = torch.randint(1, 256, (*shape, itemsize), generator=gen, dtype=torch.uint8)
    return raw.view(_BITS[itemsize]).squeeze(-1)


def _write_blocks(storage: KVCacheStorage, gid: int, blocks: list[int], seed: int) -> int:
    """Write non-zero bytes into every segment of ``blocks``; return the bytes written."""
    gen = torch.Generator().manual_seed(seed)
    written = 0
    for member in storage.placement.groups[gid].members:
        for seg in member.segments:
            view = storage.segment_view(member.layer, member.slot, name=seg.segment.name)
            for b in blocks:
                pattern = _nonzero_pattern(seg.segment.shape, seg.segment.dtype.itemsize, gen)
                _bits(view[b]).copy_(pattern)
                written += seg.segment.nbytes
    return written


def _nonzero_bytes(storage: KVCacheStorage) -> int:
    return sum(int((b != 0).sum()) for b in storage.buffers)


CASES = (
    [(s, k, "nhd") for s in STRATEGIES for k in KINDS]
    + [(s, LayoutKind.CROSS_LAYER, "hnd") for s in STRATEGIES]
    + [(s, LayoutKind.PER_LAYER, "hnd") for s in STRATEGIES]
)


@pytest.mark.parametrize(("strategy", "kind", "order"), CASES)
def test_view_write_descriptor_read_round_trip(strategy: str, kind: LayoutKind, order: str) -> None:
    groups = mixed_groups()
    layout = build(strategy, groups, num_chunks=2 + 2 * len(groups))
    if strategy == "uniform":
        layout = uniform_layout(groups, num_blocks=1 + 2 * 2 * len(groups))
    src = KVCacheStorage(layout, kind=kind, page_order=order)
    dst = KVCacheStorage(layout, kind=kind, page_order=order)
    src.check_invariants()
    rng = random.Random(7)
    total_written = 0
    for gid in range(len(groups)):
        blocks = rng.sample(owned_ids(layout, gid, 0), k=2)
        targets = rng.sample(owned_ids(layout, gid, 1), k=2)
        before = _nonzero_bytes(src)
        written = _write_blocks(src, gid, blocks, seed=gid)
        # views never overlap each other, nor another group's blocks, nor padding
        assert _nonzero_bytes(src) - before == written
        total_written += written
        desc = src.descriptor(gid, blocks)
        packed = gather(desc, src.buffers)
        # the stream is exactly the written bytes: no padding, nothing missing
        assert desc.total_bytes == written == len(blocks) * layout.groups[gid].used_block_bytes
        assert int((packed == 0).sum()) == 0
        # scatter into other block ids of a second storage; read back through its views
        scatter(dst.descriptor(gid, targets), dst.buffers, packed)
        for member in src.placement.groups[gid].members:
            for seg in member.segments:
                name = seg.segment.name
                a = src.segment_view(member.layer, member.slot, name=name)
                b = dst.segment_view(member.layer, member.slot, name=name)
                for s_blk, d_blk in zip(blocks, targets, strict=True):
                    assert torch.equal(_bits(a[s_blk]), _bits(b[d_blk]))
    assert _nonzero_bytes(dst) == total_written


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_views_share_storage_and_pointer_arithmetic(strategy: str, kind: LayoutKind) -> None:
    storage = KVCacheStorage(build(strategy, mixed_groups()), kind=kind)
    for gp in storage.placement.groups:
        buf = storage.buffers[gp.buffer_id]
        last = gp.num_blocks - 1
        for member in gp.members:
            for seg in member.segments:
                view = storage.segment_view(member.layer, member.slot, name=seg.segment.name)
                assert view.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
                assert tuple(view.shape) == (gp.num_blocks, *seg.segment.shape)
                corner = tuple(d - 1 for d in seg.segment.shape)
                expected = buf.data_ptr() + seg.byte_offset(last, corner)
                assert view[(last, *corner)].data_ptr() == expected
                assert view[(1,) + (0,) * len(corner)].data_ptr() == (
                    buf.data_ptr() + seg.offset + seg.block_stride
                )


def _worked_example() -> MemoryLayout:
    spec = FullAttentionSpec(num_kv_heads=1, head_dim=4, dtype="fp16")
    return pools_layout((group(0, spec, (0, 1), block_size=2),), num_blocks=4)


def test_worked_example_cross_layer_offsets() -> None:
    storage = KVCacheStorage(_worked_example())
    buf = storage.buffers[0]
    value = storage.kv_view(1).value
    assert tuple(value.shape) == (4, 2, 1, 4)
    assert value.stride() == (32, 4, 4, 1)  # elements: block 64 B, token 8 B
    assert value[3, 1, 0, 2].data_ptr() - buf.data_ptr() == 252
    hnd = storage.kv_view(1, order="hnd").key
    assert tuple(hnd.shape) == (4, 1, 2, 4)
    assert hnd[3, 0, 1, 2].data_ptr() - buf.data_ptr() == 3 * 64 + 32 + 8 + 4


def test_head_major_offsets() -> None:
    spec = FullAttentionSpec(num_kv_heads=2, head_dim=4, dtype="fp16")
    layout = pools_layout((group(0, spec, (0, 1), block_size=2),), num_blocks=3)
    storage = KVCacheStorage(layout, kind=LayoutKind.CROSS_LAYER_HEAD_MAJOR)
    buf = storage.buffers[0]
    # page 64 B -> head page 32 B = K_h [2, 4] fp16 (16 B) then V_h (16 B); block 128 B
    key, value = storage.kv_view(1, order="hnd")
    assert key[2, 1, 0, 0].data_ptr() - buf.data_ptr() == 2 * 128 + (1 * 2 + 1) * 32
    assert value[2, 1, 1, 3].data_ptr() - buf.data_ptr() == 2 * 128 + 3 * 32 + 16 + 8 + 6
    # a tensor-parallel rank's head 1 of block 2 is one contiguous 64-byte range
    piece = storage.placement.groups[0].pieces
    assert piece == ((0, 128, 128),)


def test_per_layer_split_offsets_and_slabs() -> None:
    spec = FullAttentionSpec(num_kv_heads=1, head_dim=4, dtype="fp16")
    layout = pools_layout((group(0, spec, (0, 1), block_size=2),), num_blocks=4)
    storage = KVCacheStorage(layout, kind=LayoutKind.PER_LAYER)
    buf = storage.buffers[0]
    key, value = storage.kv_view(1)
    # slab 1 starts at 1 * 4 blocks * 32 B = 128; K sub-slab [4, 16 B], V sub-slab after it
    assert key[3, 0, 0, 0].data_ptr() - buf.data_ptr() == 128 + 3 * 16
    assert value[0, 0, 0, 0].data_ptr() - buf.data_ptr() == 128 + 4 * 16
    assert key.stride() == (8, 4, 4, 1)


def test_state_views_dtypes_alignment_and_packing() -> None:
    spec = StateSpec(
        mixer=StateMixer.MAMBA2,
        tensors=(
            StateTensor(name="conv", shape=(3, 4), dtype="bf16"),
            StateTensor(name="ssm", shape=(2, 4), dtype="fp32"),
        ),
    )
    exact = spec.bytes_per_block(1)  # 24 + 32 = 56
    for page, ssm_off, conv_off in ((exact, 0, 32), (128, 0, 64)):
        layout = pools_layout((group(0, spec, (5,), page_bytes=page),), num_blocks=3)
        storage = KVCacheStorage(layout)
        views = storage.state_views(5)
        assert {k: v.dtype for k, v in views.items()} == {
            "ssm": torch.float32,
            "conv": torch.bfloat16,
        }
        assert tuple(views["conv"].shape) == (3, 3, 4)
        base = storage.buffers[0].data_ptr()
        assert views["ssm"][2].data_ptr() - base == 2 * page + ssm_off
        assert views["conv"][2].data_ptr() - base == 2 * page + conv_off


def test_mla_view_shape() -> None:
    layout = pools_layout((group(0, SPECS["mla"], (3, 4)),), num_blocks=5)
    latent = KVCacheStorage(layout).mla_view(4)
    assert tuple(latent.shape) == (5, 4, 16)
    assert latent.dtype == torch.bfloat16


def test_unknown_layer_names_layer_and_valid_layers() -> None:
    storage = KVCacheStorage(build("pools", mixed_groups()))
    with pytest.raises(UnknownLayerError, match=r"\(42, slot 0\).*\(0, 0\), \(1, 0\)"):
        storage.kv_view(42)
    with pytest.raises(UnknownLayerError, match="slot 1"):
        storage.kv_view(0, 1)


def test_wrong_view_kind_and_segment() -> None:
    storage = KVCacheStorage(build("pools", mixed_groups()))
    mla_layer = storage.layout.groups[4].members[0][0]
    with pytest.raises(ViewKindError, match="'mla' cache; kv_view serves"):
        storage.kv_view(mla_layer)
    with pytest.raises(ViewKindError, match="no segment 'x'; valid: latent"):
        storage.segment_view(mla_layer, name="x")


def test_block_ids_out_of_range() -> None:
    storage = KVCacheStorage(build("pools", mixed_groups()))
    assert storage.block_view(0, name="k", block_id=5).shape == (4, 2, 8)
    with pytest.raises(BlockRangeError, match=r"block_id: 6 .*valid ids are \[0, 6\)"):
        storage.block_view(0, name="k", block_id=6)
    with pytest.raises(BlockRangeError, match="-1"):
        storage.block_view(0, name="k", block_id=-1)
    with pytest.raises(StorageError, match="group_id: 9"):
        storage.num_blocks(9)


def test_numpy_integers_serve_as_ids_and_bools_and_floats_do_not() -> None:
    """Block ids often come out of numpy arrays: every id parameter takes numpy integers
    (some refused them as "not an integer"), none takes a bool or a float."""
    storage = KVCacheStorage(build("pools", mixed_groups()))
    want = storage.block_view(0, name="k", block_id=5)
    assert torch.equal(storage.block_view(0, name="k", block_id=np.int64(5)), want)
    assert storage.num_blocks(np.int32(0)) == storage.num_blocks(0)
    assert storage.descriptor(np.int64(0), [1]).ranges == storage.descriptor(0, [1]).ranges
    assert storage.block_table(np.int16(0)).ratio == 1
    for bad in (True, 1.0, "1"):
        with pytest.raises(BlockRangeError, match="block_id: expected an integer"):
            storage.block_view(0, name="k", block_id=bad)  # type: ignore[arg-type]
        with pytest.raises(StorageError, match="group_id: expected an integer"):
            storage.num_blocks(bad)  # type: ignore[arg-type]


def test_misaligned_page_refuses_views_not_transfers() -> None:
    spec = StateSpec(
        mixer=StateMixer.SHORT_CONV,
        tensors=(
            StateTensor(name="a", shape=(3,), dtype="fp32"),
            StateTensor(name="b", shape=(1,), dtype="bf16"),
        ),
    )
    layout = pools_layout((group(0, spec, (0, 1)),), num_blocks=3)  # page 14 B
    storage = KVCacheStorage(layout)
    with pytest.raises(LayoutUnsupportedError, match="multiples of its element size 4"):
        storage.state_views(1)
    assert storage.descriptor(0, [1, 2]).total_bytes == 56


def test_per_layer_arena_needs_equal_slots() -> None:
    groups = (group(0, SPECS["full"], (0, 1)), group(1, SPECS["swa"], (2,)))
    layout = arena_layout(groups)
    with pytest.raises(LayoutUnsupportedError, match=r"same number of slots.*\{0: 2, 1: 1\}"):
        KVCacheStorage(layout, kind="per_layer")
    with pytest.raises(LayoutUnsupportedError, match="kind: unknown value 'diagonal'"):
        KVCacheStorage(layout, kind="diagonal")


def test_external_buffers_are_used_and_checked() -> None:
    layout = build("arena", mixed_groups())
    buf = torch.zeros(layout.total_bytes, dtype=torch.uint8)
    storage = KVCacheStorage(layout, buffers=[buf])
    storage.kv_view(0).key[1].fill_(1.0)
    assert int(buf.count_nonzero()) > 0
    with pytest.raises(StorageError, match=r"buffers\[0\]: 10 bytes"):
        KVCacheStorage(layout, buffers=[torch.zeros(10, dtype=torch.uint8)])
    with pytest.raises(StorageError, match="needs 1 buffers, got 2"):
        KVCacheStorage(layout, buffers=[buf, buf])
