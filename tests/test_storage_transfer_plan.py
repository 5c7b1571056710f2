"""Transfer plans between two instances' layouts: byte-exact for every spec kind across
layout kinds, page orders, block sizes, strategies and tensor-parallel splits."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch

from hybridkv.plan import GroupPlan, MemoryLayout
from hybridkv.specs import (
    CacheSpec,
    FullAttentionSpec,
    MLASpec,
    SlidingWindowSpec,
    StateMixer,
    StateSpec,
    StateTensor,
)
from hybridkv.storage import KVCacheStorage, LayoutKind, TransferError
from hybridkv.storage.connector import register, tp_shard
from hybridkv.storage.transfer_plan import TransferPlan, plan_transfer
from test_storage_factories import build, group, owned_ids, pools_layout, uniform_layout

TOKENS = 7


def specs(tp: int, *, heads: int = 4, state: bool = True) -> dict[str, CacheSpec]:
    """One spec per kind as rank of a ``tp``-way split holds it (``heads`` KV heads total)."""
    local = max(1, heads // tp)
    out: dict[str, CacheSpec] = {
        "full": FullAttentionSpec(num_kv_heads=local, head_dim=8, dtype="bf16"),
        "swa": SlidingWindowSpec(num_kv_heads=local, head_dim=4, dtype="fp16", window=4),
        "mla": MLASpec(kv_lora_rank=12, qk_rope_head_dim=4, dtype="bf16"),
    }
    if state:
        out["state"] = StateSpec(
            mixer=StateMixer.MAMBA2,
            tensors=(
                StateTensor(name="conv", shape=(4 // tp, 8), dtype="bf16"),
                StateTensor(name="ssm", shape=(4 // tp, 4, 4), dtype="fp32"),
            ),
        )
    return out


def groups(sp: dict[str, CacheSpec], block: int) -> tuple[GroupPlan, ...]:
    layers = {"full": (0, 1), "swa": (2,), "mla": (3,), "state": (4, 5)}
    return tuple(
        group(gid, spec, layers[name], block_size=block)
        for gid, (name, spec) in enumerate(sp.items())
    )


def make(strategy: str, gs: tuple[GroupPlan, ...]) -> MemoryLayout:
    """A layout with room for two block tables per group."""
    if strategy == "uniform":
        return uniform_layout(gs, num_blocks=40)
    if strategy == "pools":
        return pools_layout(gs, num_blocks=12, extra=32)
    return build(strategy, gs, num_chunks=10)


def filled(layout: MemoryLayout, kind: LayoutKind, order: str, seed: int) -> KVCacheStorage:
    storage = KVCacheStorage(layout, kind=kind, page_order=order)
    gen = torch.Generator().manual_seed(seed)
    for buf in storage.buffers:
        buf.copy_(torch.randint(0, 256, buf.shape, generator=gen, dtype=torch.uint8))
    return storage


def tables(layout: MemoryLayout, part: int, *, window_null: bool = False) -> dict[int, list[int]]:
    """A block table per group: enough blocks for TOKENS tokens (one slot for state);
    ``window_null``: the sliding group's first block is the null block (recycled)."""
    out = {}
    for g in layout.groups:
        ids = owned_ids(layout, g.group_id, part)
        if g.spec.kind.value == "state":
            out[g.group_id] = ids[:1]
            continue
        n = -(-TOKENS // g.block_size)
        table = ids[:n]
        assert len(table) == n
        if window_null and g.spec.kind.value == "sliding_window":
            table = [0, *table[1:]]
        out[g.group_id] = table
    return out


def raw(view: torch.Tensor) -> torch.Tensor:
    return view.contiguous().view(torch.uint8)


def assert_moved(
    src: KVCacheStorage,
    st: dict[int, list[int]],
    dst: KVCacheStorage,
    dt: dict[int, list[int]],
    *,
    src_shard: tuple[int, int] = (0, 0),
    dst_shard: tuple[int, int] = (0, 0),
    kv_heads: int | None = None,
) -> int:
    """Every element both sides hold is equal (global heads / state rows); returns how
    many elements were compared.  ``*_shard``: ``(rank, tp)`` of each side (0: unsplit)."""
    compared = 0
    for gp in dst.layout.groups:
        for layer, slot in gp.members:
            sg, _ = src.placement.member(layer, slot)
            s_plan = src.layout.groups[sg.group_id]
            for seg in dst.placement.member(layer, slot)[1].segments:
                name = seg.segment.name
                sv = src.segment_view(layer, slot, name=name)
                dv = dst.segment_view(layer, slot, name=name)
                kind = gp.spec.kind.value
                if kind == "state":
                    a = sv[st[sg.group_id][0]]
                    b = dv[dt[gp.group_id][0]]
                    a, b = _common(a, b, 0, src_shard, dst_shard, len(a) * max(1, src_shard[1]))
                    assert torch.equal(raw(a), raw(b)), (layer, name)
                    compared += a.numel()
                    continue
                for t in range(TOKENS):
                    db = dt[gp.group_id][t // gp.block_size]
                    if db == 0:
                        continue
                    a = sv[st[sg.group_id][t // s_plan.block_size], t % s_plan.block_size]
                    b = dv[db, t % gp.block_size]
                    if kind in ("full_attention", "sliding_window"):
                        heads = kv_heads or a.shape[0] * max(1, src_shard[1])
                        a, b = _common(a, b, 0, src_shard, dst_shard, heads)
                    assert torch.equal(raw(a), raw(b)), (layer, name, t)
                    compared += a.numel()
    return compared


def _common(
    a: torch.Tensor,
    b: torch.Tensor,
    axis: int,
    src_shard: tuple[int, int],
    dst_shard: tuple[int, int],
    total: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The parts of ``a`` and ``b`` (split along ``axis``) covering the same global rows."""
    s0 = tp_shard(total, src_shard[1], src_shard[0])[0] if src_shard[1] else 0
    d0 = tp_shard(total, dst_shard[1], dst_shard[0])[0] if dst_shard[1] else 0
    lo, hi = max(s0, d0), min(s0 + a.shape[axis], d0 + b.shape[axis])
    return a.narrow(axis, lo - s0, hi - lo), b.narrow(axis, lo - d0, hi - lo)


LAYOUTS = [
    (strategy, kind, order)
    for strategy in ("arena", "pools", "uniform")
    for kind in LayoutKind
    for order in ("nhd", "hnd")
    if not (strategy == "arena" and kind is LayoutKind.CROSS_LAYER_HEAD_MAJOR and order == "hnd")
]


@pytest.mark.parametrize(
    ("src_cfg", "dst_cfg"),
    [
        (LAYOUTS[0], LAYOUTS[0]),
        *[(a, b) for a, b in itertools.combinations(LAYOUTS, 2) if a[0] != b[0] or a[1] != b[1]][
            ::5
        ],
    ],
)
def test_every_kind_moves_byte_exact_between_layouts(
    src_cfg: tuple[str, LayoutKind, str], dst_cfg: tuple[str, LayoutKind, str]
) -> None:
    src_layout = make(src_cfg[0], groups(specs(1), 4))
    dst_layout = make(dst_cfg[0], groups(specs(1), 8))  # another block size too
    src = filled(src_layout, src_cfg[1], src_cfg[2], 1)
    dst = filled(dst_layout, dst_cfg[1], dst_cfg[2], 2)
    st, dt = tables(src_layout, 0), tables(dst_layout, 1, window_null=True)
    plan = plan_transfer(
        register(src.placement), st, register(dst.placement), dt, tokens=(0, TOKENS)
    )
    before = [b.clone() for b in dst.buffers]
    assert plan.copy(src.buffers, dst.buffers) == plan.total_bytes
    assert assert_moved(src, st, dst, dt) > 0
    # nothing outside the runs changed
    for buf, old in zip(dst.buffers, before, strict=True):
        mask = torch.ones(buf.numel(), dtype=torch.bool)
        for _, _, db, do, n in plan.runs():
            if buf is dst.buffers[db]:
                mask[do : do + n] = False
        assert torch.equal(buf[mask], old[mask])


def test_same_cross_layer_layouts_move_one_run_per_block() -> None:
    sp = specs(1)
    layout = pools_layout(tuple(group(i, s, (2 * i, 2 * i + 1)) for i, s in enumerate(sp.values())))
    src = filled(layout, LayoutKind.CROSS_LAYER, "nhd", 1)
    dst = filled(layout, LayoutKind.CROSS_LAYER, "nhd", 2)
    st = {g.group_id: [1, 3] for g in layout.groups}
    dt = {g.group_id: [4, 2] for g in layout.groups}
    st[3], dt[3] = [1], [5]  # the state slot
    plan = plan_transfer(register(src.placement), st, register(dst.placement), dt, tokens=(0, 8))
    # 3 token groups x 2 blocks + 1 state slot; each block's page of every layer is one run
    assert plan.num_runs == 7
    plan.copy(src.buffers, dst.buffers)
    whole = {g.group_id: g.block_bytes for g in layout.groups}
    assert sorted(plan.length.tolist()) == sorted(
        [whole[0]] * 2 + [whole[1]] * 2 + [whole[2]] * 2 + [whole[3]]
    )
    # consecutive ids on both sides merge: blocks 1,2 -> 3,4
    st2 = {g.group_id: [1, 2] for g in layout.groups}
    dt2 = {g.group_id: [3, 4] for g in layout.groups}
    st2[3], dt2[3] = [1], [5]
    merged = plan_transfer(
        register(src.placement), st2, register(dst.placement), dt2, tokens=(0, 8)
    )
    assert merged.num_runs == 4


def test_a_token_range_moves_only_those_tokens() -> None:
    sp = specs(1, state=False)
    layout = pools_layout(groups(sp, 4))
    src = filled(layout, LayoutKind.CROSS_LAYER, "nhd", 1)
    dst = filled(layout, LayoutKind.PER_LAYER, "hnd", 2)
    st, dt = tables(layout, 0), tables(layout, 1)
    full = plan_transfer(register(src.placement), st, register(dst.placement), dt, tokens=(0, 7))
    tail = plan_transfer(register(src.placement), st, register(dst.placement), dt, tokens=(4, 7))
    per_token = full.total_bytes // 7
    assert tail.total_bytes == 3 * per_token  # the decode side's hit covers tokens 0..3


@pytest.mark.parametrize(("src_tp", "dst_tp"), [(1, 2), (2, 1), (2, 4), (4, 2)])
def test_tensor_parallel_splits_move_byte_exact(src_tp: int, dst_tp: int) -> None:
    state = max(src_tp, dst_tp) <= 2  # 4 state rows do not split over 4 ranks here
    heads = 2  # 2 KV heads: tp 4 replicates each over 2 ranks (GQA replication)
    src_layouts = [make("pools", groups(specs(src_tp, heads=heads, state=state), 4))] * src_tp
    dst_layout = make("arena", groups(specs(dst_tp, heads=heads, state=state), 8))
    srcs = [
        filled(layout, LayoutKind.CROSS_LAYER, "nhd", 10 + r)
        for r, layout in enumerate(src_layouts)
    ]
    for r, s in enumerate(srcs[1:], 1):  # replicated data agrees where ranks share heads
        _agree(srcs[0], s, r, src_tp, heads)
    st = tables(src_layouts[0], 0)
    for d_rank in range(dst_tp):
        dst = filled(dst_layout, LayoutKind.PER_LAYER, "hnd", 99)
        dt = tables(dst_layout, 1)
        d_reg = register(dst.placement, tp_rank=d_rank, tp_size=dst_tp, kv_heads=heads)
        moved = 0
        for s_rank, src in enumerate(srcs):
            s_reg = register(src.placement, tp_rank=s_rank, tp_size=src_tp, kv_heads=heads)
            plan = plan_transfer(s_reg, st, d_reg, dt, tokens=(0, TOKENS))
            plan.copy(src.buffers, dst.buffers)
            moved += plan.total_bytes
            if plan.total_bytes:
                assert assert_moved(
                    src,
                    st,
                    dst,
                    dt,
                    src_shard=(s_rank, src_tp),
                    dst_shard=(d_rank, dst_tp),
                    kv_heads=heads,
                )
        assert moved > 0


def _agree(a: KVCacheStorage, b: KVCacheStorage, rank: int, tp: int, heads: int) -> None:
    """Make rank ``rank``'s storage hold what a real split holds: the heads it shares with
    rank 0 (replication) equal, MLA latents (not split) equal."""
    if heads >= tp:
        for gp in a.layout.groups:
            if gp.spec.kind.value == "mla":
                for layer, slot in gp.members:
                    b.segment_view(layer, slot, name="latent").copy_(
                        a.segment_view(layer, slot, name="latent")
                    )
        return
    if tp_shard(heads, tp, rank) == tp_shard(heads, tp, 0):
        for x, y in zip(a.buffers, b.buffers, strict=True):
            y.copy_(x)


def test_plan_errors_name_the_array() -> None:
    sp = specs(1, state=False)
    layout = pools_layout(groups(sp, 4))
    src = filled(layout, LayoutKind.CROSS_LAYER, "nhd", 1)
    st, dt = tables(layout, 0), tables(layout, 1)
    reg = register(src.placement)
    holes = dict(st)
    holes[1] = [0, *st[1][1:]]
    with pytest.raises(TransferError, match=r"layer 2 slot 0 'k': the source holds no data"):
        plan_transfer(reg, holes, reg, dt, tokens=(0, TOKENS))
    fewer = pools_layout(groups(dict(list(sp.items())[:1]), 4))
    with pytest.raises(TransferError, match=r"layer 0 .*: the destination table covers"):
        plan_transfer(reg, st, reg, {**dt, 0: dt[0][:1]}, tokens=(0, TOKENS))
    small = register(filled(fewer, LayoutKind.CROSS_LAYER, "nhd", 3).placement)
    with pytest.raises(TransferError, match=r"layer 2 slot 0 'k': the source instance"):
        plan_transfer(small, st, reg, dt, tokens=(0, TOKENS))
    other = {**sp, "full": FullAttentionSpec(num_kv_heads=4, head_dim=4, dtype="bf16")}
    wide = register(
        filled(pools_layout(groups(other, 4)), LayoutKind.CROSS_LAYER, "nhd", 4).placement
    )
    with pytest.raises(
        TransferError, match=r"layer 0 slot 0 'k': axis 2 has 8 entries in all on the source"
    ):
        plan_transfer(reg, st, wide, dt, tokens=(0, TOKENS))
    with pytest.raises(TransferError, match=r"tokens: need 0 <= start <= end"):
        plan_transfer(reg, st, reg, dt, tokens=(5, 2))
    assert isinstance(plan_transfer(reg, st, reg, dt, tokens=(3, 3)), TransferPlan)


def test_skipped_tokens_are_left_out_of_their_group_only() -> None:
    """``skip``: tokens a source released (a null block) are left out of that destination
    group alone; every other group still moves them, and an unskipped hole still raises."""
    sp = specs(1, state=False)
    layout = pools_layout(groups(sp, 4))
    src = filled(layout, LayoutKind.CROSS_LAYER, "nhd", 1)
    st, dt = tables(layout, 0), tables(layout, 1)
    reg = register(src.placement)
    holes = {**st, 1: [0, *st[1][1:]]}  # group 1 released tokens 0..3
    whole = plan_transfer(reg, st, reg, dt, tokens=(0, TOKENS))
    skipped = plan_transfer(reg, holes, reg, dt, tokens=(0, TOKENS), skip={1: [(0, 4)]})
    head_all = plan_transfer(reg, st, reg, dt, tokens=(0, 4))
    head = plan_transfer(reg, st, reg, dt, tokens=(0, 4), skip={1: [(0, 4)]})
    assert 0 < head.total_bytes < head_all.total_bytes
    assert skipped.total_bytes == whole.total_bytes - (head_all.total_bytes - head.total_bytes)
    with pytest.raises(TransferError, match="the source holds no data for token 0"):
        plan_transfer(reg, holes, reg, dt, tokens=(0, TOKENS), skip={0: [(0, 4)]})
    with pytest.raises(TransferError, match=r"skip\[1\]: need \(start, end\) token ranges"):
        plan_transfer(reg, holes, reg, dt, tokens=(0, TOKENS), skip={1: [(0,)]})  # type: ignore[list-item]


def test_plan_refuses_tables_and_tokens_it_cannot_move_exactly() -> None:
    sp = specs(1)
    layout = pools_layout(tuple(group(i, s, (2 * i, 2 * i + 1)) for i, s in enumerate(sp.values())))
    src = filled(layout, LayoutKind.CROSS_LAYER, "nhd", 1)
    dst = filled(layout, LayoutKind.CROSS_LAYER, "nhd", 2)
    reg_s, reg_d = register(src.placement), register(dst.placement)
    n = layout.pools[0].num_blocks
    st = {g.group_id: [1, 3] for g in layout.groups}
    dt = {g.group_id: [4, 2] for g in layout.groups}
    st[3], dt[3] = [1], [5]
    before = [b.clone() for b in dst.buffers]
    cases: list[tuple[dict[int, list[int]], dict[int, list[int]], object, str]] = [
        ({**st, 0: [-2, 3]}, dt, (0, 8), r"source tables\[0\]: block id -2 is not a block of"),
        (st, {**dt, 0: [4, n]}, (0, 8), rf"destination tables\[0\]: block id {n} is not a "),
        (st, {**dt, 0: [4, 4]}, (0, 8), r"destination tables\[0\]: block 4 appears twice"),
        (st, {**dt, 0: [1.7, 2]}, (0, 8), r"need a 1-D sequence of integer block ids"),
        ({**st, 3: [0]}, dt, (0, 8), r"the source's state slot is the null block 0"),
        (st, {**dt, 3: [0]}, (0, 8), r"the destination's state slot is the null block 0"),
        (st, dt, (0.5, 7.9), r"tokens: need two integers \(start, end\), got \(0.5, 7.9\)"),
    ]
    for s_tab, d_tab, tokens, message in cases:
        with pytest.raises(TransferError, match=message):
            plan_transfer(reg_s, s_tab, reg_d, d_tab, tokens=tokens)  # type: ignore[arg-type]
    assert all(torch.equal(a, b) for a, b in zip(before, dst.buffers, strict=True))
    # the null block on the destination of a token array is skipped, as a window's recycled
    # block, and may repeat
    assert plan_transfer(reg_s, st, reg_d, {**dt, 0: [0, 0]}, tokens=(0, 8)).num_runs == 5


def test_plan_refuses_another_element_type_of_the_same_size() -> None:
    def reg(dtype: str) -> object:
        sp = {"full": FullAttentionSpec(num_kv_heads=2, head_dim=8, dtype=dtype)}
        return register(
            filled(pools_layout(groups(sp, 4)), LayoutKind.CROSS_LAYER, "nhd", 1).placement
        )

    t = {0: [1, 2]}
    for a, b, shown in (
        ("bf16", "fp16", "bfloat16, the destination float16"),
        ("fp8_e4m3", "fp8_e5m2", "float8_e4m3fn, the destination float8_e5m2"),
    ):
        with pytest.raises(TransferError, match=rf"layer 0 slot 0 'k': the source stores {shown}"):
            plan_transfer(reg(a), t, reg(b), t, tokens=(0, 8))  # type: ignore[arg-type]


def test_executing_a_plan_checks_every_buffer_before_copying() -> None:
    sp = specs(1, state=False)
    layout = pools_layout(groups(sp, 4))
    src = filled(layout, LayoutKind.CROSS_LAYER, "nhd", 1)
    dst = filled(layout, LayoutKind.PER_LAYER, "hnd", 2)
    st, dt = tables(layout, 0), tables(layout, 1)
    plan = plan_transfer(register(src.placement), st, register(dst.placement), dt, tokens=(0, 7))
    last = len(dst.buffers) - 1
    short = [*dst.buffers[:last], dst.buffers[last][:1].clone()]
    before = [b.clone() for b in dst.buffers]
    with pytest.raises(TransferError, match=rf"destination buffers\[{last}\]: 1 bytes, the plan"):
        plan.copy(src.buffers, [*dst.buffers[:last], short[last]])
    with pytest.raises(TransferError, match=r"source buffers: the plan uses buffer"):
        plan.copy(src.buffers[:0], dst.buffers)
    floats = [b.view(torch.float16) if b.numel() % 2 == 0 else b.float() for b in src.buffers]
    with pytest.raises(TransferError, match=r"source buffers\[0\]: need a flat contiguous uint8"):
        plan.copy(floats, dst.buffers)
    with pytest.raises(TransferError, match=r"packed: need a flat contiguous uint8 tensor"):
        plan.unpack(torch.zeros(2, plan.total_bytes, dtype=torch.uint8), dst.buffers)
    with pytest.raises(TransferError, match=r"packed: 3 bytes, the plan moves"):
        plan.pack(src.buffers, torch.zeros(3, dtype=torch.uint8))
    assert all(torch.equal(a, b) for a, b in zip(before, dst.buffers, strict=True))
    plan.unpack(plan.pack(src.buffers), dst.buffers)  # the checks pass good buffers


def test_a_malformed_plan_is_refused_before_it_touches_a_buffer() -> None:
    """A plan can arrive from a peer (``recv_object``): its own arrays are checked, so a
    negative offset cannot slice from a buffer's end."""
    sp = specs(1, state=False)
    layout = pools_layout(groups(sp, 4))
    src = filled(layout, LayoutKind.CROSS_LAYER, "nhd", 1)
    dst = filled(layout, LayoutKind.PER_LAYER, "hnd", 2)
    plan = plan_transfer(
        register(src.placement),
        tables(layout, 0),
        register(dst.placement),
        tables(layout, 1),
        tokens=(0, 7),
    )
    before = [b.clone() for b in dst.buffers]
    negative = plan.dst_offset.copy()
    negative[1] = -8
    short = plan.length[:-1].copy()
    cases = [
        (replace(plan, dst_offset=negative), r"plan.dst_offset: -8 at run 1; must be >= 0"),
        (replace(plan, length=short), rf"plan.length: {plan.num_runs - 1} entries, plan.src_"),
        (replace(plan, src_offset=plan.src_offset.astype(float)), r"plan.src_offset: need a one"),
        (replace(plan, dst_buffer=[0] * plan.num_runs), r"plan.dst_buffer: need a one-dim"),
    ]
    for bad, message in cases:
        with pytest.raises(TransferError, match=message):
            bad.copy(src.buffers, dst.buffers)
        with pytest.raises(TransferError, match=message):
            bad.check()
    assert all(torch.equal(a, b) for a, b in zip(before, dst.buffers, strict=True))
