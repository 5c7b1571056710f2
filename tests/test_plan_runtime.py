"""A plan's capacity is real: the cache manager built from an arena plan holds that many
max-length requests at once, grown token by token (hypothesis over random small models and
budgets, windowed groups included), counting the blocks chunk 0 lends its host group.  The
plan does not count a prefill chunk's transient window blocks per request, so requests
prefilled side by side in chunks can need more (under `uniform` too); that spreading a
window's transient blocks never changes what a call gets is
``test_cache_pools_arena.test_spreading_never_changes_what_a_call_gets_or_evicts``."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridkv.cache import KVCacheManager
from hybridkv.cache.request import Request
from hybridkv.errors import PlanError
from hybridkv.plan import Plan, Strategy, make_plan
from hybridkv.specs import ModelSpec
from hybridkv.units import parse_bytes
from test_plan_factories import full, model, state
from test_plan_properties import models


def _hold_all(plan: Plan, *, chunk: int | None = None) -> None:
    """Run ``capacity`` requests of ``max_model_len`` tokens side by side, every step of each
    getting its slots: in lockstep, ``chunk`` tokens a step (None: the prompt, one short of
    the length, in one step), then one decoded token."""
    layout, length = plan.layout, plan.max_model_len
    manager = KVCacheManager(layout, max_model_len=length)
    n = plan.capacity.max_concurrent_requests
    requests = [
        Request(
            f"r{i}",
            [1000 * (i + 1) + t for t in range(length - 1)],  # no prefix shared
            hash_block_size=layout.hash_block_size,
        )
        for i in range(n)
    ]
    step = chunk or length - 1
    done = 0
    while done < length - 1:
        take = min(step, length - 1 - done)
        for r in requests:
            assert manager.allocate_slots(r, take) is not None, f"{r.request_id} at {done}"
            r.num_computed_tokens = done + take
        done += take
    for r in requests:
        r.append_token_ids([7])
        assert manager.allocate_slots(r, 1) is not None, f"decode of {r.request_id}"
        r.num_computed_tokens = length
    manager.check_invariants()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(
    m=models(),
    memory=st.integers(256, 1 << 13),
    seq_len=st.integers(2, 40),
    block_size=st.sampled_from([1, 2, 4, 8]),
    alignment=st.sampled_from([32, 64, 256]),
)
def test_an_arena_holds_its_capacity_of_max_length_requests(
    m: ModelSpec, memory: int, seq_len: int, block_size: int, alignment: int
) -> None:
    try:
        plan = make_plan(
            m,
            memory_bytes=memory,
            max_model_len=seq_len,
            strategy=Strategy.ARENA,
            block_size=block_size,
            chunk_alignment=alignment,
        )
    except PlanError:
        return
    _hold_all(plan, chunk=1)  # the need is the peak of a request growing token by token


def test_qwen3_next_fits_one_request_with_chunk_zero_lent() -> None:
    """At 3220 MiB the arena used to plan no request where ``uniform`` plans one: chunk 0's
    197 attention blocks past the null region now count (42 usable chunks: 2 state, 41
    attention for the other 7,995 blocks)."""
    from hybridkv.models import resolve_model

    plan = make_plan(
        resolve_model("Qwen3-Next-80B-A3B"),
        memory_bytes=parse_bytes("3220MiB"),
        max_model_len=131072,
        strategy=Strategy.ARENA,
        state_split=1,  # "auto" cuts it in four: one request too, in 168 one-slot chunks
    )
    assert plan.capacity.max_concurrent_requests == 1
    assert plan.layout.null_loan_blocks == [0, 197]
    assert plan.capacity.chunks_in_use == (1, 41)
    _hold_all(plan)


def test_the_blocks_past_the_last_chunk_count_toward_the_arenas_capacity() -> None:
    """Found by review: the arena planned 178 requests where ``uniform`` plans 179, because
    its capacity left out the 15 blocks past the last chunk that the pool lends its tail
    host for good; counted, it plans 179, and the manager holds them all."""
    from hybridkv.models import resolve_model

    model = resolve_model("DeepSeek-V3", tp_size=8, kv_cache_dtype="fp8")
    kw = {"memory_bytes": parse_bytes("24GiB"), "max_model_len": 4096}
    plan = make_plan(model, strategy=Strategy.ARENA, **kw)  # type: ignore[arg-type]
    uniform = make_plan(model, strategy=Strategy.UNIFORM, **kw)  # type: ignore[arg-type]
    host = plan.layout.tail_host
    assert host is not None and (host.group_id, host.end - host.first) == (0, 15)
    assert plan.layout.loaned_blocks == [plan.layout.null_loan_blocks[0] + 15]
    assert plan.capacity.max_concurrent_requests == uniform.capacity.max_concurrent_requests
    assert plan.capacity.max_concurrent_requests == 179
    _hold_all(plan)


def test_a_finer_alignment_is_taken_when_it_holds_more_requests() -> None:
    """Found by a review's sweep: Kimi-Linear-48B-A3B at 141 GiB and tp 8 planned 141
    requests where ``uniform`` plans 142. Its 64 KiB-aligned common multiple (1.29 GiB chunks)
    met the waste aim, so no finer alignment was tried, but rounding the state group and the
    MLA group to whole chunks that coarse left one request out; the 16 KiB-aligned common
    multiple (330 MiB) holds 142, and the note says why the chunks are not 64 KiB-aligned."""
    from hybridkv.models import resolve_model

    model = resolve_model("Kimi-Linear-48B-A3B", tp_size=8)
    kw = {"memory_bytes": parse_bytes("141GiB"), "max_model_len": 131072}
    plan = make_plan(model, strategy=Strategy.ARENA, **kw)  # type: ignore[arg-type]
    uniform = make_plan(model, strategy=Strategy.UNIFORM, **kw)  # type: ignore[arg-type]
    assert plan.capacity.max_concurrent_requests == 142
    assert uniform.capacity.max_concurrent_requests == 142
    assert plan.layout.arena is not None
    assert plan.layout.arena.chunk_bytes == 345_784_320  # lcm of 129,024 and 5,488,640 B
    assert any(
        "a 65536 B aligned chunk would hold 141 max-length requests, not 142" in note
        for note in plan.notes
    )


def test_a_finer_alignment_plans_only_what_the_manager_holds() -> None:
    """The same rule at a size the manager can run side by side: Nemotron-H-8B at tp 8 with
    an fp8 cache in 2 GiB planned 100 requests of 8,192 tokens (0.69% of the budget lost)
    and now plans 101 with 32 KiB-aligned chunks, every one of them held."""
    from hybridkv.models import resolve_model

    plan = make_plan(
        resolve_model("Nemotron-H-8B", tp_size=8, kv_cache_dtype="fp8"),
        memory_bytes=parse_bytes("2GiB"),
        max_model_len=8192,
        strategy=Strategy.ARENA,
    )
    assert plan.capacity.max_concurrent_requests == 101
    assert plan.layout.arena is not None and plan.layout.arena.chunk_bytes % 65536
    _hold_all(plan)


@pytest.mark.parametrize(("name", "memory", "length"), [("gemma-3-27b", "4GiB", 4096)])
def test_a_windowed_model_holds_its_planned_requests_decoding_side_by_side(
    name: str, memory: str, length: int
) -> None:
    """gemma-3-27b's sliding-window group (5 blocks a chunk) used to take a whole free chunk
    for every new block while free chunks lasted, stranding the chunks full attention needs:
    5 planned requests grown side by side token by token failed the first at 416 tokens."""
    from hybridkv.models import resolve_model

    plan = make_plan(
        resolve_model(name),
        memory_bytes=parse_bytes(memory),
        max_model_len=length,
        strategy=Strategy.ARENA,
    )
    assert plan.capacity.max_concurrent_requests == 5
    assert plan.capacity.blocks_per_chunk == (5, 26)
    _hold_all(plan, chunk=1)


@pytest.mark.parametrize("when_full", ["refuse", "skip_minor", "skip"])
def test_a_request_alone_runs_without_the_checkpoint_it_has_no_room_for(when_full: str) -> None:
    """A plan counts one state slot per request; a step that would also save a checkpoint
    and finds no room for it skips the checkpoint when its request is the only one (nothing
    could be preempted to make room), under every ``checkpoint_when_full`` mode: at a
    ``uniform`` plan's capacity of one, ``refuse`` used to fail the decode step for good."""
    m = model([state((3,)), full(kv=1, hd=2, dtype="bf16")])
    plan = make_plan(m, memory_bytes=384, max_model_len=16, strategy=Strategy.UNIFORM, block_size=1)
    assert plan.capacity.max_concurrent_requests == 1
    manager = KVCacheManager(plan.layout, max_model_len=16, checkpoint_when_full=when_full)
    request = Request("r", list(range(100, 115)), hash_block_size=plan.layout.hash_block_size)
    assert manager.allocate_slots(request, 15) is not None
    request.num_computed_tokens = 15
    request.append_token_ids([7])
    assert manager.allocate_slots(request, 1) is not None
    manager.check_invariants()
