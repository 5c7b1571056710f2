"""Grouping by spec, block sizes and kernel block sizes (hybridkv.plan.grouping/options)."""

from __future__ import annotations

import pytest

from hybridkv.errors import PlanError
from hybridkv.plan import PlanOptions, group_entries
from hybridkv.plan.grouping import base_group_plans, split_state_groups
from hybridkv.plan.options import kernel_block_size_for
from test_plan_factories import full, mla, model, sliding, state, swa_full_model


def test_groups_in_order_of_first_appearance() -> None:
    ssm = state((4,))
    m = model([full(), sliding(8), None, (sliding(8), ssm), full(), sliding(16)])
    groups = group_entries(m)
    assert [g.spec for g in groups] == [full(), sliding(8), ssm, sliding(16)]
    assert [g.members for g in groups] == [
        ((0, 0), (4, 0)),
        ((1, 0), (3, 0)),
        ((3, 1),),
        ((5, 0),),
    ]


def test_equal_specs_in_any_order_share_a_group() -> None:
    groups = group_entries(swa_full_model())
    assert [g.members for g in groups] == [((0, 0), (2, 0)), ((1, 0), (3, 0))]


def test_model_without_caching_layers_raises() -> None:
    with pytest.raises(PlanError, match=r"model: 'tiny' has no caching layers"):
        group_entries(model([None, None]))


def test_base_block_sizes_and_pages() -> None:
    ssm = state((3, 8), (2, 4, 8))  # 96 + 256 = 352 bytes
    plans = base_group_plans(group_entries(model([full(), ssm, mla()])), PlanOptions())
    assert [(p.block_size, p.kernel_block_size, p.page_bytes) for p in plans] == [
        (16, 16, 16 * 32),
        (256, 256, 352),
        (16, 16, 16 * 32),
    ]


def test_state_block_size_option() -> None:
    plans = base_group_plans(
        group_entries(model([full(), state((4,))])), PlanOptions(state_block_size=64)
    )
    assert [p.block_size for p in plans] == [16, 64]


@pytest.mark.parametrize(
    ("block_size", "requested", "expected"),
    [(16, None, 16), (8, None, 8), (5, None, 5), (64, None, 16), (24, None, 8), (64, 32, 32)],
)
def test_kernel_block_rule(block_size: int, requested: int | None, expected: int) -> None:
    assert kernel_block_size_for(full(), block_size, requested) == expected


def test_state_kernel_block_is_the_block() -> None:
    assert kernel_block_size_for(state((4,)), 256, 16) == 256


def test_kernel_block_must_divide_block() -> None:
    with pytest.raises(PlanError, match="kernel_block_size: 3 does not divide block_size 16"):
        kernel_block_size_for(full(), 16, 3)
    with pytest.raises(PlanError, match="kernel_block_size: 3 does not divide block_size 16"):
        PlanOptions(block_size=16, kernel_block_size=3)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"block_size": 0}, "block_size"),
        ({"block_size": True}, "block_size"),
        ({"block_size": 1 << 25}, "block_size"),
        ({"kernel_block_size": -4}, "kernel_block_size"),
        ({"state_block_size": 0}, "state_block_size"),
        ({"chunk_alignment": 0}, "chunk_alignment"),
        ({"pool_ratios": ()}, "pool_ratios"),
        ({"pool_ratios": (1.0, 0.0)}, "pool_ratios"),
        ({"pool_ratios": (1.0, float("nan"))}, "pool_ratios"),
        ({"pool_ratios": (1.0, "x")}, "pool_ratios"),
    ],
)
def test_bad_options_raise(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(PlanError, match=f"^{field}: "):
        PlanOptions(**kwargs)  # type: ignore[arg-type]


def test_options_round_trip() -> None:
    options = PlanOptions(block_size=32, kernel_block_size=8, pool_ratios=(1.0, 3.0))
    assert PlanOptions.from_dict(options.to_dict()) == options


def test_state_split_cuts_state_groups_into_consecutive_layers() -> None:
    ssm = state((4,))
    m = model([ssm, ssm, full(), ssm, ssm, ssm, full(), ssm])  # 6 state layers, 2 full
    groups = group_entries(m)
    assert [g.members for g in split_state_groups(groups, 4)] == [
        ((0, 0), (1, 0)),  # 6 = 2 + 2 + 1 + 1
        ((3, 0), (4, 0)),
        ((5, 0),),
        ((7, 0),),
        ((2, 0), (6, 0)),  # attention groups stay whole
    ]
    assert split_state_groups(groups, 1) == groups
    assert [len(g.members) for g in split_state_groups(groups, 10)] == [1] * 6 + [2]
    with pytest.raises(PlanError, match="state_split: must be"):
        PlanOptions(state_split=0)


def test_state_split_shrinks_the_arena_chunk_and_keeps_every_layer() -> None:
    from hybridkv.models import resolve_model
    from hybridkv.plan import make_plan

    qwen = resolve_model("Qwen3-Next-80B-A3B")
    plans = {
        k: make_plan(qwen, memory_bytes=32 << 30, max_model_len=131072, state_split=k)
        for k in (1, 4)
    }
    one, four = plans[1].layout, plans[4].layout
    assert one.arena is not None and four.arena is not None
    assert four.arena.chunk_bytes * 2 == one.arena.chunk_bytes  # two 9-layer slots a chunk
    state_groups = [g for g in four.groups if g.spec.kind.value == "state"]
    assert [len(g.members) for g in state_groups] == [9, 9, 9, 9]
    members = sorted(m for g in four.groups for m in g.members)
    assert members == sorted(m for g in one.groups for m in g.members)
    uniform = make_plan(
        qwen, memory_bytes=32 << 30, max_model_len=131072, strategy="uniform", state_split=4
    )
    assert (
        uniform.layout
        == make_plan(qwen, memory_bytes=32 << 30, max_model_len=131072, strategy="uniform").layout
    )  # uniform groups layers by vLLM's rule


def test_auto_state_split_cuts_only_whole_chunk_slots_in_small_arenas() -> None:
    from hybridkv.models import resolve_model
    from hybridkv.plan import Plan, make_plan
    from hybridkv.plan.planner import AUTO_SPLIT_MAX_CHUNKS, auto_state_split

    def plan(name: str, gib: int, **kw: object) -> Plan:
        return make_plan(
            resolve_model(name),
            memory_bytes=gib << 30,
            max_model_len=131072,
            **kw,  # type: ignore[arg-type]
        )

    # (model, GiB) -> the split "auto" uses and the unsplit arena's chunk count it judges by,
    # with whether a >= 32 MiB slot takes a whole chunk (Qwen3-Next-80B-A3B: 74.2 MiB slots,
    # one a chunk; Nemotron-H-8B: 98 MiB slots, one a chunk at 8 GiB, two from 16 GiB;
    # Jamba-v0.1: 15.8 MiB slots).
    expected = {
        ("Qwen3-Next-80B-A3B", 8): (4, 110),
        ("Qwen3-Next-80B-A3B", 32): (4, 441),
        ("Qwen3-Next-80B-A3B", 64): (1, 882),
        ("Nemotron-H-8B", 8): (4, 83),
        ("Nemotron-H-8B", 16): (1, 83),
        ("Jamba-v0.1", 8): (1, 520),
    }
    for (name, gib), (split, chunks) in expected.items():
        unsplit = plan(name, gib, state_split=1)
        assert unsplit.layout.arena is not None
        assert unsplit.layout.arena.num_chunks == chunks, (name, gib)
        assert auto_state_split(unsplit.layout) == split, (name, gib)
        auto = plan(name, gib)
        assert auto.options.state_split == split, (name, gib)
        assert auto.layout == plan(name, gib, state_split=split).layout
    assert 441 < AUTO_SPLIT_MAX_CHUNKS <= 520
    # Only the arena splits by itself; an explicit value is kept (uniform says 1: it keeps
    # vLLM's grouping); pools and uniform stay whole under auto.
    for strategy in ("pools", "uniform"):
        p = plan("Qwen3-Next-80B-A3B", 8, strategy=strategy)
        assert p.options.state_split == 1
        assert len(p.layout.groups) == 2 if strategy == "pools" else 4
    assert plan("Qwen3-Next-80B-A3B", 8, state_split=2).options.state_split == 2
    uniform = plan("Qwen3-Next-80B-A3B", 8, state_split=2, strategy="uniform")
    assert uniform.options.state_split == 1
    # The plan records what it used, so a stored plan replans the same.
    auto = plan("Qwen3-Next-80B-A3B", 8)
    assert PlanOptions.from_dict(auto.options.to_dict()) == auto.options
    assert PlanOptions().state_split == "auto"
    assert PlanOptions.from_dict({"block_size": 16, "state_split": "auto"}).state_split == "auto"
    with pytest.raises(PlanError, match="state_split: must be a positive integer, got 'x'"):
        PlanOptions(state_split="x")
