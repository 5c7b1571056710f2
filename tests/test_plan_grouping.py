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
    # one 36-layer slot a chunk; split in four, 9-layer slots would share a chunk two by two,
    # so their pages are padded by 3.0% to fill one chunk each (plan.arena: one slot a chunk)
    assert one.arena.chunk_bytes == 77856768
    assert four.arena.chunk_bytes == 20054016 == 17 * 3 * 393216  # 17 x lcm(9, 384 KiB)
    state_groups = [g for g in four.groups if g.spec.kind.value == "state"]
    assert all(g.block_bytes == four.arena.chunk_bytes for g in state_groups)
    assert all(g.page_bytes == 20054016 // 9 for g in state_groups)
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


def test_auto_state_split_cuts_under_pressure_or_whole_chunk_slots_in_small_arenas() -> None:
    from hybridkv.models import resolve_model
    from hybridkv.plan import Plan, make_plan
    from hybridkv.plan.planner import (
        AUTO_SPLIT_CAPACITY,
        AUTO_SPLIT_MAX_CHUNKS,
        auto_state_split,
    )

    def plan(name: str, gib: int, max_model_len: int = 131072, **kw: object) -> Plan:
        return make_plan(
            resolve_model(name),
            memory_bytes=gib << 30,
            max_model_len=max_model_len,
            **kw,  # type: ignore[arg-type]
        )

    # (model, GiB, max_model_len) -> the split "auto" uses, the unsplit arena's chunk count
    # and how many max_model_len requests it fits: it cuts where fewer than 16 fit (running
    # requests hold the budget), or where a >= 32 MiB slot takes a whole chunk of an arena
    # under 512 chunks (Qwen3-Next-80B-A3B: 74.2 MiB slots, one a chunk; Nemotron-H-8B: 98
    # MiB slots, one a chunk, padded by 0.4% from 16 GiB, where two would share a chunk
    # unpadded; Jamba-v0.1: 15.8 MiB slots).
    expected = {
        ("Qwen3-Next-80B-A3B", 8, 131072): (4, 110, 2),
        ("Qwen3-Next-80B-A3B", 32, 131072): (4, 441, 10),
        ("Qwen3-Next-80B-A3B", 64, 131072): (1, 882, 20),
        ("Qwen3-Next-80B-A3B", 8, 4096): (4, 110, 48),  # many fit, but whole-chunk slots
        ("Nemotron-H-8B", 8, 131072): (4, 83, 3),
        ("Nemotron-H-8B", 16, 131072): (4, 166, 7),
        ("Nemotron-H-8B", 64, 131072): (1, 667, 30),
        ("Nemotron-H-8B", 16, 8192): (4, 166, 72),  # many fit, but whole-chunk slots
        ("Jamba-v0.1", 8, 131072): (4, 520, 3),
        ("Jamba-v0.1", 16, 131072): (4, 1040, 7),
        ("Jamba-v0.1", 32, 131072): (4, 2080, 15),
        ("Jamba-v0.1", 64, 131072): (1, 4161, 31),
    }
    for (name, gib, length), (split, chunks, fit) in expected.items():
        key = (name, gib, length)
        unsplit = plan(name, gib, length, state_split=1)
        assert unsplit.layout.arena is not None
        assert unsplit.layout.arena.num_chunks == chunks, key
        assert unsplit.capacity.max_concurrent_requests == fit, key
        assert auto_state_split(unsplit.layout, fit) == split, key
        auto = plan(name, gib, length)
        assert auto.options.state_split == split, key
        assert auto.layout == plan(name, gib, length, state_split=split).layout
    assert auto_state_split(plan("Jamba-v0.1", 16, state_split=1).layout) == 1  # not judged
    # The rule cuts Nemotron-H-8B at 8 GiB and 8,192 tokens (its 98 MiB slot takes a whole
    # chunk of 83); cut in four it plans 36 too, counting the blocks past its last chunk
    # (35 before they were counted, and a split that plans fewer requests, or wastes more
    # than 1%, is not kept).
    whole = plan("Nemotron-H-8B", 8, 8192, state_split=1)
    assert auto_state_split(whole.layout, whole.capacity.max_concurrent_requests) == 4
    assert plan("Nemotron-H-8B", 8, 8192, state_split=4).capacity.max_concurrent_requests == 36
    auto = plan("Nemotron-H-8B", 8, 8192)
    assert auto.options.state_split == 4 and auto.capacity.max_concurrent_requests == 36
    # the plan's notes say what "auto" chose and why
    assert auto.notes[-1] == (
        "state_split auto: 4 (group 0's 98.2 MiB state slot takes a whole chunk of an arena of "
        "83 chunks)"
    )
    kept_whole = plan("Nemotron-H-8B", 10, 4096)  # where the cut plans fewer: not kept
    assert kept_whole.options.state_split == 1
    assert kept_whole.notes[-1] == (
        "state_split auto: 1 (cut in 4 it would plan 62 requests and waste 70 MiB, whole 63 "
        "and 23.9 MiB)"
    )
    assert plan("Jamba-v0.1", 16).notes[-1] == (
        "state_split auto: 4 (7 requests of max_model_len fit the arena, fewer than 16: "
        "running requests would pin the chunks a whole state slot needs)"
    )
    assert plan("Qwen3-Next-80B-A3B", 8, 4096).notes[-1] == (
        "state_split auto: 4 (group 0's 74.2 MiB state slot takes a whole chunk of an arena of "
        "110 chunks)"
    )
    assert not any("state_split" in n for n in plan("Jamba-v0.1", 64).notes)
    assert 441 < AUTO_SPLIT_MAX_CHUNKS <= 520
    assert 15 < AUTO_SPLIT_CAPACITY <= 20
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


def test_auto_cuts_where_no_request_fits_whole() -> None:
    from hybridkv.models import resolve_model
    from hybridkv.plan import Plan, make_plan

    qwen = resolve_model("Qwen3-Next-80B-A3B")

    def at(mib: int, split: int | str = "auto") -> Plan:
        return make_plan(qwen, memory_bytes=mib << 20, max_model_len=4096, state_split=split)

    with pytest.raises(PlanError, match="holds no request of max_model_len 4096"):
        at(190, 1)  # whole state groups need 203 MiB here
    p = at(190)
    assert p.options.state_split == 4 and p.capacity.max_concurrent_requests == 1
    assert p.notes[-1] == "state_split auto: 4 (no request of max_model_len fits whole)"
    assert p.layout == at(190, 4).layout
    # Where the cut holds none either, the error is the whole plan's, as before.
    with pytest.raises(PlanError, match=r"memory_bytes: 180 MiB .* holds no request"):
        at(180)
