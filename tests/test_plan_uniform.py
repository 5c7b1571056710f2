"""The uniform strategy reproduces vLLM's rules: equal pages, equal layer counts, one pool."""

from __future__ import annotations

import pytest

from hybridkv.errors import PlanError
from hybridkv.plan import make_plan
from hybridkv.plan.uniform import uniform_group_size
from test_plan_factories import full, gemma_like, mamba_like, model, sliding, state


def test_gemma_like_5_to_1_splits_and_pads_layers() -> None:
    # 13 layers: sliding 0..4, 6..10, 12 (11 entries); full 5, 11 (2). group_size = 2.
    plan = make_plan(
        gemma_like(), memory_bytes=17384, max_model_len=32, block_size=4, strategy="uniform"
    )
    groups = plan.layout.groups
    assert [g.members for g in groups] == [
        ((0, 0), (1, 0)),
        ((2, 0), (3, 0)),
        ((4, 0), (6, 0)),
        ((7, 0), (8, 0)),
        ((9, 0), (10, 0)),
        ((12, 0),),
        ((5, 0), (11, 0)),
    ]
    assert [g.padded_members for g in groups] == [0, 0, 0, 0, 0, 1, 0]
    assert {(g.block_size, g.page_bytes, g.block_bytes) for g in groups} == {(4, 128, 256)}
    (pool,) = plan.layout.pools
    assert (pool.group_ids, pool.block_bytes, pool.num_blocks) == (tuple(range(7)), 256, 67)
    # Six sliding groups need 4 blocks each, full attention 8: 32 per request; 66 // 32 = 2.
    assert plan.capacity.blocks_per_request == (4, 4, 4, 4, 4, 4, 8)
    assert plan.capacity.max_concurrent_requests == 2
    assert plan.capacity.pool_blocks == (67,)
    # The padded slot of group 5 is one 128-byte page in each of its 2 * 4 held blocks.
    assert plan.waste.padded_layers == 2 * 4 * 128
    assert plan.waste.padded_pages == 0
    assert plan.waste.reserved == 256
    assert plan.waste.chunk_tails == 17384 - 67 * 256
    assert plan.allocated_bytes == 15360
    assert plan.free_bytes == (66 - 64) * 256


def test_mamba_pads_state_pages_and_raises_attention_blocks() -> None:
    # State 352 B > attention page 4 * 32 = 128 B: vLLM raises the attention block to the
    # smallest multiple of 16 tokens holding the state (16 -> 512 B) and pads the state to it.
    plan = make_plan(
        mamba_like(), memory_bytes=100000, max_model_len=64, block_size=4, strategy="uniform"
    )
    groups = plan.layout.groups
    # 7 state entries and 3 attention: group_size = 3; states split 3, 3, 1 (+2 padded).
    assert [g.members for g in groups] == [
        ((0, 0), (1, 0), (3, 0)),
        ((4, 0), (6, 0), (7, 0)),
        ((9, 0),),
        ((2, 0), (5, 0), (8, 0)),
    ]
    assert [g.spec.kind.value for g in groups] == ["state", "state", "state", "full_attention"]
    assert [g.padded_members for g in groups] == [0, 0, 2, 0]
    # Align mode: states checkpoint at the attention block size.
    assert [(g.block_size, g.kernel_block_size, g.page_bytes) for g in groups] == [
        (16, 16, 512)
    ] * 4
    (pool,) = plan.layout.pools
    assert (pool.block_bytes, pool.num_blocks) == (1536, 65)
    assert plan.capacity.blocks_per_request == (1, 1, 1, 4)
    assert plan.capacity.max_concurrent_requests == 9  # 64 // 7
    assert plan.waste.padded_pages == 9 * 7 * (512 - 352)
    assert plan.waste.padded_layers == 9 * 2 * 512
    assert plan.waste.chunk_tails == 100000 - 65 * 1536
    assert plan.waste.reserved == 1536


def test_explicit_state_block_size_is_kept() -> None:
    plan = make_plan(
        mamba_like(),
        memory_bytes=100000,
        max_model_len=64,
        block_size=4,
        state_block_size=32,
        strategy="uniform",
    )
    assert [g.block_size for g in plan.layout.groups] == [32, 32, 32, 16]


def test_larger_block_size_is_not_lowered() -> None:
    plan = make_plan(
        mamba_like(), memory_bytes=1 << 20, max_model_len=64, block_size=32, strategy="uniform"
    )
    assert {g.page_bytes for g in plan.layout.groups} == {1024}
    assert plan.layout.groups[-1].block_size == 32


def test_kernel_alignment_follows_a_given_kernel_block() -> None:
    # With kernel blocks of 32 tokens the raised attention block is a multiple of 32.
    plan = make_plan(
        mamba_like(),
        memory_bytes=1 << 20,
        max_model_len=64,
        block_size=32,
        kernel_block_size=32,
        strategy="uniform",
    )
    assert plan.layout.groups[-1].block_size == 32
    plan = make_plan(
        model([full(), state((200,))]),  # 800-byte state, 32 bytes per token
        memory_bytes=1 << 20,
        max_model_len=64,
        block_size=8,
        kernel_block_size=8,
        strategy="uniform",
    )
    assert [(g.block_size, g.page_bytes) for g in plan.layout.groups] == [(32, 1024), (32, 1024)]


def test_smaller_attention_pages_get_larger_blocks() -> None:
    # 64 B/token sliding and 32 B/token full: the full block doubles to match 256-byte pages.
    m = model([sliding(8, kv=2), full(), sliding(8, kv=2), full()])
    plan = make_plan(m, memory_bytes=1 << 16, max_model_len=32, block_size=4, strategy="uniform")
    assert [(g.block_size, g.page_bytes) for g in plan.layout.groups] == [(4, 256), (8, 256)]
    assert plan.waste.padded_pages == 0


def test_non_integer_page_ratio_pads_the_page() -> None:
    # 96 vs 64 bytes per token: vLLM cannot scale by 1.5; the 64-byte group keeps 4 tokens
    # and its 256-byte page is padded to 384.
    m = model([full(kv=3, hd=4), sliding(8, kv=2)])
    plan = make_plan(m, memory_bytes=1 << 16, max_model_len=32, block_size=4, strategy="uniform")
    assert [(g.block_size, g.page_bytes) for g in plan.layout.groups] == [(4, 384), (4, 384)]
    n = plan.capacity.max_concurrent_requests
    assert plan.waste.padded_pages == n * 4 * (384 - 256)


def test_model_with_states_only() -> None:
    # 100-byte and 200-byte states: pages padded to 200; counts 3 and 2 -> group_size 2.
    a, b = state((25,)), state((50,))
    plan = make_plan(
        model([a, b, a, b, a]), memory_bytes=1 << 12, max_model_len=1000, strategy="uniform"
    )
    groups = plan.layout.groups
    assert [g.members for g in groups] == [((0, 0), (2, 0)), ((4, 0),), ((1, 0), (3, 0))]
    assert [(g.block_size, g.page_bytes, g.padded_members) for g in groups] == [
        (256, 200, 0),
        (256, 200, 1),
        (256, 200, 0),
    ]
    # 4096 // 400 = 10 blocks; 3 per request -> 3 requests.
    assert plan.layout.pools[0].num_blocks == 10
    assert plan.capacity.max_concurrent_requests == 3


@pytest.mark.parametrize(
    ("counts", "expected"),
    [([12, 12], 12), ([7, 5], 7), ([8, 5], 5), ([52, 10], 10), ([36, 12], 12), ([3], 3)],
)
def test_group_size_rule(counts: list[int], expected: int) -> None:
    assert uniform_group_size(counts) == expected


def test_one_and_a_half_rule_pads_the_smaller_type() -> None:
    m = model([sliding(8)] * 7 + [full()] * 5)
    plan = make_plan(m, memory_bytes=1 << 16, max_model_len=32, block_size=4, strategy="uniform")
    assert [(g.num_members, g.padded_members) for g in plan.layout.groups] == [(7, 0), (5, 2)]


def test_budget_too_small() -> None:
    # One request: null block + 6 * 4 + 8 blocks of 256 bytes.
    with pytest.raises(PlanError, match=r"one request needs 8.25 KiB \(8448 B\)"):
        make_plan(
            gemma_like(), memory_bytes=8447, max_model_len=32, block_size=4, strategy="uniform"
        )
    plan = make_plan(
        gemma_like(), memory_bytes=8448, max_model_len=32, block_size=4, strategy="uniform"
    )
    assert plan.capacity.max_concurrent_requests == 1
