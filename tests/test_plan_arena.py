"""The arena strategy: chunk sizing, page padding search and capacity (exact numbers)."""

from __future__ import annotations

import pytest

from hybridkv.errors import PlanError
from hybridkv.models import spec_from_config
from hybridkv.plan import Strategy, make_plan
from hybridkv.plan.arena import state_page_candidates
from hybridkv.plan.layout import ArenaPlan
from test_plan_factories import full, model, sliding, state, swa_full_model


def test_two_groups_exact_chunk() -> None:
    # Blocks of 4 tokens: 128-byte pages, 2 members -> 256-byte blocks; chunk = lcm(1024, 256).
    plan = make_plan(
        swa_full_model(), memory_bytes=17384, max_model_len=32, block_size=4, chunk_alignment=1024
    )
    layout = plan.layout
    assert plan.strategy is Strategy.ARENA
    assert layout.arena is not None
    assert (layout.arena.chunk_bytes, layout.arena.num_chunks) == (1024, 16)
    assert [(g.block_size, g.page_bytes, g.block_bytes) for g in layout.groups] == [
        (4, 128, 256),
        (4, 128, 256),
    ]
    cap = plan.capacity
    # Sliding window 8 needs 4 blocks, full attention 8; group 0 also holds the 3 blocks of
    # chunk 0 past the null region and the 3 past chunk 15 (below): N = 5 takes
    # ceil((20 - 6) / 4) + 10 = 14 usable chunks, N = 6 would take 17.
    assert cap.blocks_per_request == (4, 8)
    assert cap.blocks_per_chunk == (4, 4)
    assert cap.max_concurrent_requests == 5
    assert cap.max_resident_tokens == 160
    assert cap.chunks_in_use == (4, 10)
    assert cap.num_chunks == 16
    # Chunk 0: the null region is one 256-byte block; its other 3 blocks are lent to group 0.
    assert layout.null_host == (0, 1, 4)
    # The 1000 bytes past chunk 15 hold blocks 64..66 of either group (768 B): group 0 gets
    # them for good (the lowest id of a tie), the arena ends at their end.
    assert layout.tail_host == (0, 64, 67)
    assert layout.arena.tail_bytes == 768 and layout.total_bytes == 16 * 1024 + 768
    assert plan.waste.reserved == 256
    assert plan.waste.chunk_tails == 1000 - 768
    assert plan.waste.padded_pages == plan.waste.padded_layers == 0
    assert plan.allocated_bytes == 5 * (4 + 8) * 256
    assert plan.free_bytes == 2 * 256 + 1024  # 2 blocks of group 0's chunks, a whole chunk
    # Sliding layers read 8 tokens, full layers 32, at 32 bytes per token.
    assert plan.physical_need.per_layer == (1280, 5120, 1280, 5120)
    assert plan.physical_need.total == 12800
    assert plan.utilisation == 12800 / 17384


def test_hash_and_schedule_granularity() -> None:
    plan = make_plan(
        model([full(), state((25,))]),
        memory_bytes=1 << 20,
        max_model_len=64,
        block_size=4,
        state_block_size=12,
        chunk_alignment=64,
    )
    assert plan.layout.hash_block_size == 4
    assert plan.layout.schedule_alignment == 12


def test_exact_lcm_kept_when_it_meets_the_aim() -> None:
    # Page 128 (full) and 100 (state): lcm(64, 128, 100) = 3200 bytes, 1000 chunks, 0.1% waste.
    plan = make_plan(
        model([full(), state((25,))]),
        memory_bytes=3_200_000,
        max_model_len=32,
        block_size=4,
        chunk_alignment=64,
    )
    assert plan.layout.arena is not None
    assert plan.layout.arena.chunk_bytes == 3200
    assert [g.page_bytes for g in plan.layout.groups] == [128, 100]
    # ceil((8N - 24) / 25) + ceil(N / 32) <= 999 (chunk 0 lends 24 blocks, below)
    assert plan.capacity.max_concurrent_requests == 2846
    # only chunk 0's first 128 bytes: the full-attention group (25 blocks per chunk) hosts
    # its other 24
    assert plan.waste.total == 128


def test_bounded_chunks_beat_state_page_padding_when_the_lcm_is_too_coarse() -> None:
    # With 60 000 bytes the exact 3200-byte chunk gives only 18 chunks and 46 requests;
    # padding the 100-byte state page to 112 makes 896-byte chunks and 50 requests, to 128
    # 128-byte chunks and 51 but pads every state page (1428 bytes); bounded 1536-byte chunks
    # (12 full-attention blocks, 14 of the 15.36 state slots) also hold 51 and lose 640 bytes
    # of chunk tails instead.  Counting the 41 full-attention blocks chunk 0 lends past the
    # null region, bounded 5376-byte chunks (42 full-attention blocks, 52 state slots) hold
    # 52 and lose 240 bytes of chunk tails; the 800 bytes past the 11th chunk lend the state
    # group 8 slots.
    m = model([full(), state((25,))])
    plan = make_plan(m, memory_bytes=60000, max_model_len=32, block_size=4, chunk_alignment=64)
    assert plan.layout.arena is not None
    assert (plan.layout.arena.chunk_bytes, plan.layout.arena.num_chunks) == (5376, 11)
    assert plan.layout.null_host == (0, 1, 42)
    assert plan.layout.tail_host == (1, 592, 600)
    assert [g.page_bytes for g in plan.layout.groups] == [128, 100]
    assert plan.capacity.max_concurrent_requests == 52
    assert plan.capacity.blocks_per_chunk == (42, 52)
    assert plan.waste.padded_pages == 0
    assert plan.waste.reserved == 128
    assert plan.waste.chunk_tails == 240
    assert plan.allocated_bytes == 52 * (8 * 128 + 100)
    assert plan.free_bytes == 60000 - 240 - 128 - 52 * (8 * 128 + 100)


def test_state_page_candidates() -> None:
    assert state_page_candidates(100) == [100, 102, 104, 105, 108, 112, 120, 128, 144, 160, 192]
    assert state_page_candidates(1) == [1, 2]


def test_budget_too_small_names_the_need() -> None:
    # One request: the null chunk + 1 sliding chunk + 2 full chunks = 4 KiB.
    with pytest.raises(PlanError, match=r"one request needs 4 KiB \(4096 B\)") as err:
        make_plan(
            swa_full_model(),
            memory_bytes=4095,
            max_model_len=32,
            block_size=4,
            chunk_alignment=1024,
        )
    assert str(err.value).startswith("memory_bytes: ")
    assert "max_model_len 32" in str(err.value)
    assert "cache data alone is 2560 B" in str(err.value)
    plan = make_plan(
        swa_full_model(), memory_bytes=4096, max_model_len=32, block_size=4, chunk_alignment=1024
    )
    assert plan.capacity.max_concurrent_requests == 1


def test_many_window_sizes_and_no_full_attention() -> None:
    m = model([sliding(8), sliding(16), sliding(8), sliding(32)])
    plan = make_plan(m, memory_bytes=1 << 16, max_model_len=64, block_size=4, chunk_alignment=256)
    assert [g.members for g in plan.layout.groups] == [((0, 0), (2, 0)), ((1, 0),), ((3, 0),)]
    assert plan.capacity.blocks_per_request == (4, 6, 10)
    assert plan.layout.arena is not None
    # Blocks of 256, 128 and 128 bytes in 256-byte chunks: 4N + 3N + 5N <= 255.
    assert plan.capacity.blocks_per_chunk == (1, 2, 2)
    assert plan.capacity.max_concurrent_requests == 21


def test_alignment_is_lowered_only_when_the_aligned_chunk_wastes_too_much() -> None:
    from hybridkv.models import resolve_model

    two_mib = 2 << 20
    gpt_model = resolve_model("gpt-oss-20b")
    # default 64 KiB alignment: one 384 KiB block of either group per chunk
    gpt = make_plan(gpt_model, memory_bytes=40 << 30, max_model_len=131072)
    assert gpt.layout.arena is not None
    assert gpt.layout.arena.chunk_bytes == 384 << 10
    # a 2 MiB (CUDA VMM) alignment: 6 MiB chunks of 16 blocks meet the aim
    gpt2 = make_plan(
        gpt_model, memory_bytes=40 << 30, max_model_len=131072, chunk_alignment=two_mib
    )
    assert gpt2.layout.arena is not None
    assert gpt2.layout.arena.chunk_bytes == 6 << 20
    # DeepSeek-V3: 61 MLA layers x 18432 B pages; any 2 MiB-aligned chunk is 61 * 9 * 2 MiB
    ds = make_plan(
        resolve_model("DeepSeek-V3"),
        memory_bytes=40 << 30,
        max_model_len=131072,
        chunk_alignment=two_mib,
    )
    assert ds.layout.arena is not None
    chunk = ds.layout.arena.chunk_bytes
    assert chunk % (61 * 18432) == 0 and chunk % 4096 == 0
    assert chunk % two_mib != 0
    assert chunk < 61 * 9 * two_mib
    assert ds.waste.total <= 0.01 * (40 << 30)
    assert any("not multiples of the 2097152 B chunk alignment" in n for n in ds.notes)


def _zamba2_7b_shaped() -> dict[str, object]:
    """A Zamba2-7B-shaped config: 81 Mamba2 layers, every sixth also attention (13)."""
    hybrid = set(range(5, 81, 6))
    return {
        "model_type": "zamba2",
        "hidden_size": 3584,
        "num_hidden_layers": 81,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "mamba_d_state": 64,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
        "mamba_headdim": 64,
        "mamba_ngroups": 2,
        "n_mamba_heads": 112,
        "max_position_embeddings": 4096,
        "layers_block_type": ["hybrid" if i in hybrid else "mamba" for i in range(81)],
    }


def test_bounded_chunks_when_the_common_multiple_is_huge() -> None:
    # 146 MiB state blocks and 5.7 MiB attention blocks: their common multiple (even with the
    # state page padded) is a 2.25 GiB chunk, 3 chunks in 8 GiB, one request.  Bounded chunks
    # hold as many requests as uniform; with only chunk 0's null region reserved (not a whole
    # chunk), six state blocks per chunk lose the least at that capacity.
    spec = spec_from_config(_zamba2_7b_shaped())
    plans = {
        s: make_plan(spec, memory_bytes=8 << 30, max_model_len=4096, strategy=s)
        for s in ("arena", "uniform")
    }
    arena = plans["arena"]
    assert arena.layout.arena is not None
    # 4 requests fit, so "auto" tries the state group cut in four, which wastes 3.17%: kept
    # whole (0.80%)
    assert arena.options.state_split == 1
    cut = make_plan(spec, memory_bytes=8 << 30, max_model_len=4096, state_split=4)
    assert cut.waste.total > (8 << 30) // 100
    state_block = arena.layout.groups[0].block_bytes
    assert state_block == 81 * 1894400
    assert arena.layout.arena.chunk_bytes == 6 * state_block  # lcm with the 4 KiB alignment
    assert arena.capacity.blocks_per_chunk == (6, 153)  # 154.4 attention blocks: 153 lent
    assert arena.capacity.max_concurrent_requests == 4
    assert plans["uniform"].capacity.max_concurrent_requests == 4
    assert any("bounded chunks of 920678400 B" in n for n in arena.notes)
    # 9 chunks leave 290 MiB: the attention group gets its 50 whole blocks there for good.
    # Without that tail the plan lost 4.37% of the budget; with it, 0.90%; with the blocks
    # chunk 0 lends the attention group holding requests' blocks, 0.80%.
    assert arena.layout.arena.num_chunks == 9
    assert arena.layout.tail_host == (1, 1390, 1440)
    assert arena.layout.arena.tail_bytes == 1440 * 5963776 - 9 * 920678400
    assert arena.waste.total == 54964224 + 14184448 <= (8 << 30) // 100
    big = make_plan(spec, memory_bytes=40 << 30, max_model_len=4096, strategy="arena")
    # of the chunk sizes that plan 24 without the tail, one plans 25 with it (uniform: 24)
    assert big.capacity.max_concurrent_requests == 25
    assert big.waste.total <= (40 << 30) // 100  # 0.25%


def test_arena_plan_tail_bytes_are_checked_and_round_trip() -> None:
    plan = ArenaPlan(chunk_bytes=1024, num_chunks=4, tail_bytes=768)
    assert plan.total_bytes == 4 * 1024 + 768
    assert ArenaPlan.from_dict(plan.to_dict()) == plan
    assert ArenaPlan.from_dict({"chunk_bytes": 1024, "num_chunks": 4}).tail_bytes == 0
    for bad in (-1, 1024):
        with pytest.raises(
            PlanError,
            match=rf"^ArenaPlan.tail_bytes: must be in \[0, chunk_bytes 1024\), got {bad}",
        ):
            ArenaPlan(chunk_bytes=1024, num_chunks=4, tail_bytes=bad)


def test_one_state_slot_per_chunk_where_padding_is_small() -> None:
    """Nemotron-H-8B at 16 GiB (split 4, 6-layer state groups of 4,276,224-byte pages): the
    common multiple with the 256 KiB attention block is 196 MiB, 8 slots a chunk; pages
    padded by 1.15% to 4,325,376 B make a 24.75 MiB chunk of one slot (and 99 attention
    blocks), at the same capacity.  ``one_slot_chunks=False`` keeps the common multiple; a
    slot needing more than 5% (Jamba-v0.1: 33%) is never padded for it."""
    from hybridkv.models import resolve_model
    from hybridkv.plan import PlanOptions, make_plan
    from hybridkv.plan.arena import ONE_SLOT_MAX_PADDING

    model = resolve_model("Nemotron-H-8B")
    kw: dict[str, object] = {"memory_bytes": 16 << 30, "max_model_len": 131072}
    one = make_plan(model, **kw)  # type: ignore[arg-type]
    shared = make_plan(model, one_slot_chunks=False, **kw)  # type: ignore[arg-type]
    assert one.layout.arena is not None and shared.layout.arena is not None
    assert (one.layout.arena.chunk_bytes, one.layout.arena.num_chunks) == (25952256, 661)
    assert (shared.layout.arena.chunk_bytes, shared.layout.arena.num_chunks) == (205258752, 83)
    bpc = [one.layout.blocks_per_chunk(g.group_id) for g in one.layout.groups]
    assert bpc == [1, 1, 1, 1, 99]
    assert [shared.layout.blocks_per_chunk(g.group_id) for g in shared.layout.groups] == [
        8,
        8,
        8,
        8,
        783,
    ]
    states = [g for g in one.layout.groups if g.spec.kind.value == "state"]
    assert {g.page_bytes for g in states} == {4325376}
    assert one.capacity.max_concurrent_requests == shared.capacity.max_concurrent_requests == 7
    assert one.options.one_slot_chunks and not shared.options.one_slot_chunks
    assert one.notes[0] == (
        "arena: state pages of groups 0, 1, 2, 3 padded from 4276224 B to 4325376 B (+1.15%; "
        "chunks of 25952256 B instead of 205258752 B) (one state slot per chunk)"
    )
    assert PlanOptions.from_dict(shared.options.to_dict()) == shared.options
    with pytest.raises(PlanError, match="one_slot_chunks: must be True or False, got 1"):
        PlanOptions(one_slot_chunks=1)  # type: ignore[arg-type]
    jamba = make_plan(resolve_model("Jamba-v0.1"), **kw)  # type: ignore[arg-type]
    assert jamba.layout.arena is not None and jamba.layout.arena.chunk_bytes == 16515072
    assert [jamba.layout.blocks_per_chunk(g.group_id) for g in jamba.layout.groups] == [
        4,
        4,
        4,
        4,
        63,
    ]
    assert ONE_SLOT_MAX_PADDING == 0.05
