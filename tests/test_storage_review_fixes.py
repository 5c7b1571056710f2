"""Regressions from the storage review: wrong bytes moved without an error (tensor-parallel
state sizes, KV-head counts, descriptors of other dtypes or shapes, a plan copying onto the
bytes it reads), pages the storage cannot view, untyped device errors, int32 overflow of
kernel block ids and a few unchecked inputs.  Each test fails on the code before the fix."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridkv.errors import StorageError
from hybridkv.plan import MemoryLayout, make_plan
from hybridkv.plan.arena import state_page_candidates
from hybridkv.plan.grouping import element_alignment
from hybridkv.specs import (
    CacheSpec,
    FullAttentionSpec,
    LayerSpec,
    MLASpec,
    ModelSpec,
    StateMixer,
    StateSpec,
    StateTensor,
)
from hybridkv.storage import (
    BlockRangeError,
    BlockTable,
    KernelBlockSizeError,
    KVCacheStorage,
    StorageAllocationError,
    TransferError,
    batch_kernel_table,
    kernel_ratio,
)
from hybridkv.storage.connector import register, register_storage
from hybridkv.storage.cp import CPSlotMapper
from hybridkv.storage.storage import allocate_bytes
from hybridkv.storage.transfer import copy_blocks
from hybridkv.storage.transfer_plan import plan_transfer
from test_storage_factories import arena_layout, group, pools_layout

I32_MAX = int(np.iinfo(np.int32).max)


def _one_group(spec: CacheSpec, block_size: int = 4, *, pad: int = 0) -> MemoryLayout:
    g = group(0, spec, (0,), block_size=block_size)
    if pad:
        g = group(0, spec, (0,), block_size=block_size, page_bytes=g.page_bytes + pad)
    return pools_layout((g,), num_blocks=5)


def _attn(heads: int, dtype: str = "fp16", head_dim: int = 16) -> FullAttentionSpec:
    return FullAttentionSpec(num_kv_heads=heads, head_dim=head_dim, dtype=dtype)


def _conv(rows: int) -> StateSpec:
    return StateSpec(
        mixer=StateMixer.MAMBA2, tensors=(StateTensor(name="conv", shape=(rows, 4), dtype="bf16"),)
    )


# ------------------------------------------------------------------ 1. TP state sizes


def test_plan_refuses_a_state_whose_rank_rows_do_not_split_the_tp1_state() -> None:
    # Nemotron-H-8B at tp 16 in small: the tp 1 conv has 10 rows, a tp 4 rank 4 (its groups
    # are replicated, so 4 * 4 is not 10).  Before: ranks 0-1 got rows 0..7 and 8..9, ranks
    # 2-3 nothing, with no error.
    whole = KVCacheStorage(_one_group(_conv(10), 1))
    src = register_storage(whole)
    for rank in range(4):
        part = KVCacheStorage(_one_group(_conv(4), 1))
        dst = register_storage(part, tp_rank=rank, tp_size=4)
        assert dst.segments[0].shard_total == 16  # the convention's size (4 rows x 4 ranks)
        with pytest.raises(
            TransferError,
            match=(
                r"^layer 0 slot 0 'conv': axis 0 has 10 entries in all on the source \(shape "
                rf"\(10, 4\), not split\), 16 on the destination \(entries {4 * rank}\.\."
                rf"{4 * rank + 3} of shard_total 16\); both sides must hold one array"
            ),
        ):
            plan_transfer(src, {0: [1]}, dst, {0: [1]}, tokens=(0, 0))
        with pytest.raises(TransferError, match=r"axis 0 has 16 entries in all on the source"):
            plan_transfer(dst, {0: [1]}, src, {0: [1]}, tokens=(0, 0))


def test_register_refuses_state_rows_its_split_cannot_hold() -> None:
    part = KVCacheStorage(_one_group(_conv(4), 1)).placement
    with pytest.raises(
        StorageError,
        match=(
            r"^state_rows: 'conv' has 10 rows before the split, layer 0 holds 4 on each of 4 "
            r"ranks \(16 in all\): not a contiguous split"
        ),
    ):
        register(part, tp_rank=1, tp_size=4, state_rows={"conv": 10})
    ok = register(part, tp_rank=1, tp_size=4, state_rows={"conv": 16})
    assert (ok.segments[0].shard_first, ok.segments[0].shard_total) == (4, 16)
    with pytest.raises(StorageError, match=r"^state_rows: 'conv': 0 \(int\); need a tensor"):
        register(part, tp_rank=1, tp_size=4, state_rows={"conv": 0})
    with pytest.raises(StorageError, match=r"^state_rows: need a mapping"):
        register(part, tp_rank=1, tp_size=4, state_rows=[10])  # type: ignore[arg-type]


def test_a_contiguous_state_split_still_moves_every_row() -> None:
    whole = KVCacheStorage(_one_group(_conv(8), 1))
    whole.buffers[0].copy_(torch.arange(whole.buffers[0].numel()).to(torch.uint8))
    src = register_storage(whole)
    moved = 0
    for rank in range(2):
        part = KVCacheStorage(_one_group(_conv(4), 1))
        dst = register_storage(part, tp_rank=rank, tp_size=2, state_rows={"conv": 8})
        plan = plan_transfer(src, {0: [1]}, dst, {0: [1]}, tokens=(0, 0))
        moved += plan.copy(whole.buffers, part.buffers)
        got = part.state_views(0)["conv"][1]
        assert torch.equal(got, whole.state_views(0)["conv"][1][4 * rank : 4 * rank + 4])
    assert moved == 8 * 4 * 2


# ------------------------------------------------------------------ 2. KV-head counts


def test_plan_refuses_other_kv_head_counts_at_tp1_both_ways() -> None:
    # Before: 8 heads into 4 moved 1024 of 2048 bytes (heads 4..7 dropped); 4 into 8 left
    # heads 4..7 of the destination unwritten.
    eight = register_storage(KVCacheStorage(_one_group(_attn(8))), instance="p")
    four = register_storage(KVCacheStorage(_one_group(_attn(4))), instance="d")
    with pytest.raises(
        TransferError,
        match=(
            r"^layer 0 slot 0 'k': axis 1 has 8 entries in all on the source \(entries 0\.\.7 "
            r"of shard_total 8\), 4 on the destination \(entries 0\.\.3 of shard_total 4\)"
        ),
    ):
        plan_transfer(eight, {0: [1]}, four, {0: [1]}, tokens=(0, 4))
    with pytest.raises(TransferError, match=r"axis 1 has 4 entries in all on the source"):
        plan_transfer(four, {0: [1]}, eight, {0: [1]}, tokens=(0, 4))


def test_plan_refuses_a_replicated_split_registered_without_kv_heads() -> None:
    # 2 KV heads over 4 ranks: without kv_heads a rank claims 1 head of 4, not of 2.
    whole = register_storage(KVCacheStorage(_one_group(_attn(2))))
    rank = KVCacheStorage(_one_group(_attn(1)))
    with pytest.raises(TransferError, match=r"axis 1 has 2 entries in all on the source"):
        plan_transfer(
            whole,
            {0: [1]},
            register_storage(rank, tp_rank=3, tp_size=4),
            {0: [1]},
            tokens=(0, 4),
        )
    right = register_storage(rank, tp_rank=3, tp_size=4, kv_heads=2)
    plan = plan_transfer(whole, {0: [1]}, right, {0: [1]}, tokens=(0, 4))
    assert plan.total_bytes == 2 * 4 * 16 * 2  # k and v, 4 tokens, 1 head of 16 fp16


# ------------------------------------------------------------------ 3. descriptor meaning


@pytest.mark.parametrize(
    ("src_spec", "dst_spec", "src_bs", "dst_bs", "shown"),
    [
        (
            _attn(2),
            _attn(2, "bf16"),
            8,
            8,
            r"'k' is float16 \[8, 2, 16\] on the source, 'k' bfloat16 \[8, 2, 16\]",
        ),
        (
            _attn(2),
            _attn(1),
            8,
            16,
            r"'k' is float16 \[8, 2, 16\] on the source, 'k' float16 \[16, 1, 16\]",
        ),
    ],
)
def test_copy_blocks_refuses_descriptors_of_other_dtypes_or_shapes(
    src_spec: CacheSpec, dst_spec: CacheSpec, src_bs: int, dst_bs: int, shown: str
) -> None:
    a = KVCacheStorage(_one_group(src_spec, src_bs))
    b = KVCacheStorage(_one_group(dst_spec, dst_bs))
    a.kv_view(0).key[1].fill_(1.0)
    da, db = a.descriptor(0, [1]), b.descriptor(0, [1])
    assert da.total_bytes == db.total_bytes == 1024  # same bytes, other meaning
    assert not da.matches(db)
    with pytest.raises(
        TransferError, match=r"^descriptors: .* differ in what their bytes are: layer 0 slot 0 "
    ) as info:
        copy_blocks(da, a.buffers, db, b.buffers)
    assert info.match(shown)
    assert not b.buffers[0].any()
    with pytest.raises(TransferError, match=r"^layer 0 slot 0 'k': "):
        plan_transfer(register_storage(a), {0: [1]}, register_storage(b), {0: [1]}, tokens=(0, 8))


# ------------------------------------------------------------------ 4. plan onto itself


@pytest.mark.parametrize("pad", [0, 16])  # one coalesced run / a run per block
def test_plan_copy_refuses_runs_that_read_what_they_write(pad: int) -> None:
    # Before: torch's RuntimeError without padding, silently [1, 1, 1] (not [1, 1, 2]) with.
    storage = KVCacheStorage(_one_group(_attn(1, head_dim=4), 2, pad=pad))
    key = storage.kv_view(0).key
    for b in range(1, 4):
        key[b].fill_(float(b))
    before = [x.clone() for x in storage.buffers]
    reg = register_storage(storage)
    plan = plan_transfer(reg, {0: [1, 2]}, reg, {0: [2, 3]}, tokens=(0, 4))
    with pytest.raises(
        TransferError,
        match=r"^plan: source and destination ranges overlap in memory .* \(pack, then unpack\)",
    ):
        plan.copy(storage.buffers, storage.buffers)
    assert all(torch.equal(x, y) for x, y in zip(before, storage.buffers, strict=True))
    # through a stream that shares nothing: the intended result
    plan.unpack(plan.pack(storage.buffers), storage.buffers)
    assert [key[b].flatten()[0].item() for b in (1, 2, 3)] == [1.0, 1.0, 2.0]
    # a stream inside the cache buffer is refused too
    inside = storage.buffers[0][: plan.total_bytes]
    with pytest.raises(TransferError, match=r"^out: source and destination ranges overlap"):
        plan.pack(storage.buffers, inside)
    with pytest.raises(TransferError, match=r"^packed: source and destination ranges overlap"):
        plan.unpack(storage.buffers[0][90:], storage.buffers)
    # disjoint blocks of one buffer, and a copy onto itself, stay allowed
    apart = plan_transfer(reg, {0: [1]}, reg, {0: [4]}, tokens=(0, 2))
    assert apart.copy(storage.buffers, storage.buffers) == apart.total_bytes
    same = plan_transfer(reg, {0: [2]}, reg, {0: [2]}, tokens=(0, 2))
    assert same.copy(storage.buffers, storage.buffers) == same.total_bytes


# ------------------------------------------------------------------ 5. page alignment


def _odd_model(*, with_attention: bool) -> ModelSpec:
    state = StateSpec(
        mixer=StateMixer.MAMBA2,
        tensors=(
            StateTensor(name="ssm", shape=(1,), dtype="fp32"),
            StateTensor(name="conv", shape=(3,), dtype="fp8"),
        ),
    )
    caches: list[CacheSpec] = [state, state]
    if with_attention:
        caches += [
            FullAttentionSpec(num_kv_heads=1, head_dim=3, dtype="fp8"),
            MLASpec(kv_lora_rank=3, qk_rope_head_dim=2, dtype="fp32"),
        ]
    return ModelSpec(
        name="odd",
        model_type="x",
        layers=tuple(
            LayerSpec(index=i, layer_type=c.kind.value, caches=(c,)) for i, c in enumerate(caches)
        ),
    )


def test_element_alignment_is_the_largest_element_size() -> None:
    state = _odd_model(with_attention=False).layers[0].caches[0]
    assert element_alignment(state) == 4
    assert element_alignment(_attn(1, "fp8")) == 1
    assert element_alignment(MLASpec(kv_lora_rank=3, qk_rope_head_dim=2, dtype="bf16")) == 2
    assert state_page_candidates(8, 4) == [8, 12, 16]
    assert all(p % 4 == 0 for p in state_page_candidates(4 * 131, 4))


@pytest.mark.parametrize("strategy", ["arena", "uniform", "pools"])
@pytest.mark.parametrize("block_size", [1, 3, 16])
@pytest.mark.parametrize("with_attention", [False, True])
def test_planned_pages_are_whole_elements_and_the_storage_views_them(
    strategy: str, block_size: int, with_attention: bool
) -> None:
    # fp32 [1] + fp8 [3] is a 7-byte state: before, 7-byte pages (a view error at storage).
    layout = make_plan(
        _odd_model(with_attention=with_attention),
        memory_bytes=1 << 16,
        max_model_len=16,
        strategy=strategy,
        block_size=block_size,
    ).layout
    for g in layout.groups:
        assert g.page_bytes % element_alignment(g.spec) == 0, (g.spec.kind, g.page_bytes)
        if strategy != "uniform" and g.spec.kind.value == "state":
            assert g.page_bytes == 8
    storage = KVCacheStorage(layout)
    for g in layout.groups:
        for layer, slot in g.members:
            _, member = storage.placement.member(layer, slot)
            for sp in member.segments:
                view = storage.segment_view(layer, slot, name=sp.segment.name)
                assert view.dtype.itemsize == sp.segment.dtype.itemsize


# ------------------------------------------------------------------ 6. devices


@pytest.mark.skipif(torch.cuda.is_available(), reason="this torch has CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_cuda_without_cuda_is_a_typed_error(device: str) -> None:
    layout = _one_group(_attn(1, head_dim=4), 2)
    with pytest.raises(
        StorageError,
        match=(
            rf"^device: '{device}' is not available: torch \S+ "
            r"(was built without CUDA|sees no CUDA device); valid here: cpu$"
        ),
    ):
        KVCacheStorage(layout, device=device)
    arena = arena_layout((group(0, _attn(1, head_dim=4), (0,), block_size=2),))
    with pytest.raises(StorageError, match=rf"^device: '{device}' is not available"):
        KVCacheStorage.on_demand(arena, device=device)
    with pytest.raises(
        StorageAllocationError, match=r"^memory_bytes: cannot allocate 96 B on cuda"
    ):
        allocate_bytes([96], torch.device(device), False, "memory_bytes")


@pytest.mark.skipif(torch.backends.mps.is_available(), reason="this machine has MPS")
def test_mps_without_mps_says_so() -> None:
    # Before: "cannot allocate 96 B on mps (not enough memory there)".
    with pytest.raises(StorageError, match=r"^device: 'mps' is not available: .* no usable MPS"):
        KVCacheStorage(_one_group(_attn(1, head_dim=4), 2), device="mps")


# ------------------------------------------------------------------ 7. int32 kernel ids


def test_block_table_bound_keeps_kernel_ids_in_int32_for_any_ratio() -> None:
    # ratio 3: before, num_blocks up to I32_MAX // 3 + 1 was accepted and id I32_MAX // 3
    # gave kernel ids [2147483646, 2147483647, -2147483648].
    top = (I32_MAX + 1) // 3  # 715827882
    with pytest.raises(
        BlockRangeError, match=rf"^num_blocks: must be in \[1, {top}\] for ratio 3, got {top + 1}$"
    ):
        BlockTable(3, num_blocks=top + 1)
    for table in (BlockTable(3), BlockTable(3, num_blocks=top)):
        with pytest.raises(BlockRangeError, match=rf"valid manager ids are \[0, {top}\)$"):
            table.append(top)
        table.append(top - 1)
        assert table.kernel_ids.tolist() == [I32_MAX - 4, I32_MAX - 3, I32_MAX - 2]
        table.check_invariants()
        assert batch_kernel_table([table]).tolist() == [[I32_MAX - 4, I32_MAX - 3, I32_MAX - 2]]
    # a power-of-two ratio keeps its bound: the last kernel id is I32_MAX
    last = BlockTable(4, block_ids=[(I32_MAX + 1) // 4 - 1])
    assert int(last.kernel_ids[-1]) == I32_MAX
    with pytest.raises(BlockRangeError):
        last.append((I32_MAX + 1) // 4)


# ------------------------------------------------------------------ minor inputs


def test_kernel_ratio_takes_numpy_integers() -> None:
    g = group(0, _attn(1), (0,), block_size=8)
    assert kernel_ratio(g, np.int64(4)) == 2  # 8-token blocks of 4-token kernel blocks
    assert type(kernel_ratio(g, np.int64(4))) is int
    storage = KVCacheStorage(pools_layout((g,), num_blocks=3))
    assert storage.block_table(0, kernel_block_size=np.int32(2)).ratio == 4
    with pytest.raises(KernelBlockSizeError, match=r"^kernel_block_size: np.int64\(3\) does not"):
        kernel_ratio(g, np.int64(3))


def test_plan_checks_a_token_range_against_the_tables_before_making_it() -> None:
    # Before: numpy's MemoryError building 10**11 positions.
    reg = register_storage(KVCacheStorage(_one_group(_attn(1), 8)))
    with pytest.raises(
        TransferError,
        match=(
            r"^tokens: end 100000000000 lies past what the destination table of group 0 "
            r"covers \(1 blocks of 8 tokens = 8\); valid: end <= 8"
        ),
    ):
        plan_transfer(reg, {0: [1]}, reg, {0: [2]}, tokens=(0, 10**11))
    assert plan_transfer(reg, {0: [1]}, reg, {0: [2]}, tokens=(0, 8)).total_bytes == 2 * 8 * 32


def test_cp_slot_mapping_refuses_null_negative_and_non_integer_blocks() -> None:
    m = CPSlotMapper(8, 2)  # rank 0 holds 4 tokens: 2 blocks of 2
    with pytest.raises(
        StorageError,
        match=r"^table: entry 0 is block 0, where rank 0's tokens 0 \.\. 1 live; valid: block ids",
    ):
        m.slot_mapping(0, [0, 3], 2)
    with pytest.raises(StorageError, match=r"^table: entry 1 is block -3, where rank 0's tokens 2"):
        m.slot_mapping(0, [1, -3], 2)
    with pytest.raises(StorageError, match=r"^table: need a 1-D sequence of integer block ids"):
        m.slot_mapping(0, [1.0, 2.0], 2)
    with pytest.raises(StorageError, match=r"^block_size: need a positive integer, got 0"):
        m.slot_mapping(0, [1, 2], 0)
    assert m.slot_mapping(0, [5, 3, 0], 2).tolist() == [10, 11, 6, 7]  # unused tail: not read
