"""Exactness through the whole engine: real scheduler, cache manager, storage and runner.

Every scenario runs :class:`LLMEngine` (continuous batching, chunked prefill, prefix hits,
preemption by recompute) over storage whose bytes start as NaN (``0xFF``), so a read of memory
no step wrote poisons the logits, and compares every request with transformers' own greedy
``generate`` on that prompt alone: generated tokens identical, and the logits each token was
chosen from within ``ATOL``.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from hybridkv.cache import KVCacheManager
from hybridkv.engine.generate import Generation
from hybridkv.engine.llm_engine import CacheConfig, Completion, LLMEngine
from hybridkv.engine.models import load_model, reference_copy
from hybridkv.plan import GroupPlan, MemoryLayout, PoolPlan, Strategy
from hybridkv.scheduler import Scheduler, SchedulerConfig, SchedulerError
from hybridkv.specs import CacheKind, DType, FullAttentionSpec, StateMixer, StateSpec, StateTensor
from test_engine_tiers import conversations

from support.reference import reference_generate

MODELS = [
    "deepseek_v3",
    "gemma3_text",
    "gpt_oss",
    "granitemoehybrid",
    "lfm2",
    "lfm3",
    "llama",
    "qwen3_next",
]
WINDOWED = ["gemma3_text", "gpt_oss", "lfm3"]
STATEFUL = {"granitemoehybrid", "lfm2", "lfm3", "qwen3_next"}
ATOL = 1e-4
#: transformers' own gated DeltaNet is not batch-invariant at 1e-4: its greedy ``generate`` on
#: three copies of one prompt drifts from the same prompt alone by 1.2e-4 within 8 tokens
#: (measured; lfm3 1.3e-5, llama 8e-6).  Batched with other requests, the engine sees the same
#: drift; alone it matches within ATOL (``test_qwen3_next_alone_is_within_atol``).
BATCHED_ATOL = {"qwen3_next": 5e-4}
WINDOW_KINDS = (CacheKind.SLIDING, CacheKind.CHUNKED)


pytestmark = pytest.mark.usefixtures("one_thread")


@functools.cache
def _models(name: str) -> tuple[Any, Any]:
    model = load_model(name)
    return model, reference_copy(model)  # the engine switches `model` to paged attention


@functools.cache
def _reference(name: str, prompt: tuple[int, ...], num_tokens: int) -> Generation:
    return reference_generate(_models(name)[1], prompt, num_tokens)


def prompt(seed: int, length: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return [int(t) for t in torch.randint(0, 256, (length,), generator=gen)]


def engine(name: str, cache: CacheConfig | None = None, **scheduler: Any) -> LLMEngine:
    """An engine over model ``name`` (4-token blocks, 8-token state checkpoints, 1 MiB, 64-token
    requests) with NaN-poisoned storage, keeping logits."""
    eng = LLMEngine(
        _models(name)[0],
        cache=cache
        or CacheConfig(block_size=4, state_block_size=8, memory_bytes=1 << 20, max_model_len=64),
        scheduler=SchedulerConfig(**scheduler),
        keep_logits=True,
    )
    for buffer in eng.storage.buffers:
        buffer.fill_(0xFF)
    return eng


def check(name: str, completions: list[Completion], atol: float = ATOL) -> float:
    """Tokens equal to transformers' greedy ``generate``; logits within ``atol``."""
    diff = 0.0
    for c in completions:
        want = _reference(name, c.prompt_token_ids, len(c.token_ids))
        assert list(c.token_ids) == want.tokens, c.request_id
        for got, ref in zip(c.logits, want.logits, strict=True):
            diff = max(diff, float((got - ref).abs().max()))
    assert diff < atol, f"{name}: max |logit diff| {diff:.2e}"
    return diff


def tolerance(name: str) -> float:
    return BATCHED_ATOL.get(name, ATOL)


def groups_of(eng: LLMEngine, *kinds: CacheKind) -> list[int]:
    return [g.group_id for g in eng.layout.groups if g.spec.kind in kinds]


@pytest.mark.parametrize("name", MODELS)
def test_mixed_length_batch(name: str) -> None:
    eng = engine(name)
    prompts = [prompt(1, 5), prompt(2, 11), prompt(3, 17)]
    done = eng.generate(prompts, max_tokens=6)
    check(name, done, tolerance(name))
    stats = eng.stats()
    assert stats.max_batch_requests == 3  # all three in every step: one prefill, five decodes
    # State layouts split prefills at the 8-token alignment and one unit before the last
    # aligned boundary (11 -> 8+3, 17 -> 8+8+1): two more steps; attention-only models run
    # each step as one packed pass.
    assert stats.steps == (8 if name in STATEFUL else 6)
    if name not in STATEFUL:
        assert stats.forward_passes == stats.steps
    assert stats.generated_tokens == 18 and stats.preemptions == 0
    assert [c.finish_reason.value for c in done] == ["length"] * 3
    eng.manager.check_invariants()
    assert eng.manager.usage == 0.0


@pytest.mark.parametrize("name", MODELS)
def test_shared_prefix_served_from_the_cache(name: str) -> None:
    eng = engine(name)
    shared = prompt(20, 16)
    first = eng.generate([shared + prompt(21, 3)], max_tokens=6)
    second = eng.generate([shared + prompt(22, 5), shared + prompt(23, 2)], max_tokens=6)
    check(name, first + second, tolerance(name))
    assert [c.num_cached_tokens for c in first + second] == [0, 16, 16]
    stats = eng.stats()
    # the scheduler admitted two 16-token hits; every group alone could serve both
    assert stats.prefix_hit_tokens == 32
    assert stats.group_hit_tokens == (32,) * len(eng.layout.groups)
    assert stats.computed_tokens == 19 + (21 - 16) + (18 - 16) + 3 * 5  # prefills + decodes
    eng.manager.check_invariants()


@pytest.mark.parametrize("name", MODELS)
def test_chunked_prefill_under_a_small_token_budget(name: str) -> None:
    # A budget of 6 tokens is below the 8-token alignment of state layouts: their chunks end
    # unaligned where no boundary is in reach, and realign after.
    eng = engine(name, token_budget=6)
    done = eng.generate([prompt(4, 13), prompt(5, 9), prompt(6, 7)], max_tokens=6)
    check(name, done, tolerance(name))
    stats = eng.stats()
    assert stats.max_step_tokens == 6
    assert stats.computed_tokens == 13 + 9 + 7 + 3 * 5
    assert stats.steps >= -(-stats.computed_tokens // 6)


@pytest.mark.parametrize("name", WINDOWED)
def test_sliding_window_blocks_are_freed(name: str) -> None:
    eng = engine(name)
    done = eng.generate([prompt(7, 19), prompt(8, 7)], max_tokens=8)
    check(name, done, tolerance(name))
    stats = eng.stats()
    windowed = groups_of(eng, *WINDOW_KINDS)
    (full,) = groups_of(eng, CacheKind.FULL)
    assert windowed
    for gid in range(len(eng.layout.groups)):
        # a null entry replaced a real block in every sliding group's table, and only there
        assert (stats.window_blocks_released[gid] > 0) == (gid in windowed)
    for gid in windowed:
        assert stats.peak_blocks[gid] < stats.peak_blocks[full]


@pytest.mark.parametrize("name", MODELS)
def test_preemption_and_resume_with_a_small_pool(name: str) -> None:
    # Pools of 8 blocks per group (7 usable, 28 tokens): four requests growing to ~21 tokens
    # each cannot all run; the newest is preempted and recomputed, mostly from the cache.
    cache = CacheConfig(
        strategy="pools", block_size=4, state_block_size=8, num_blocks=7, max_model_len=24
    )
    eng = engine(name, cache)
    assert [p.num_blocks for p in eng.layout.pools] == [8] * len(eng.layout.groups)
    prompts = [prompt(9, 10), prompt(10, 12), prompt(11, 9), prompt(12, 11)]
    done = eng.generate(prompts, max_tokens=10)
    check(name, done, tolerance(name))
    stats = eng.stats()
    assert stats.preemptions > 0
    assert sum(c.num_preemptions for c in done) == stats.preemptions
    assert all(len(c.token_ids) == 10 for c in done)
    # hits count each request's first admission once (a re-admission mostly hits itself)
    assert stats.admitted_tokens == sum(len(p) for p in prompts)
    assert stats.prefix_hit_tokens == sum(c.num_cached_tokens for c in done)
    assert max(stats.peak_blocks) <= 7
    eng.manager.check_invariants()


def test_compaction_moves_blocks_instead_of_preempting_and_stays_exact() -> None:
    # gemma3_text's arena: 5 KiB sliding-window blocks (4 a chunk) and 1 KiB full-attention
    # blocks (20 a chunk) share 20 KiB chunks; at 80 KiB, four growing requests strand the
    # window group's chunks.  With compaction a refused step moves referenced blocks (copied
    # before the pass: the NaN-poisoned storage would show a stale table) before anyone is
    # preempted.
    cache = CacheConfig(block_size=4, state_block_size=8, memory_bytes=80 << 10, max_model_len=64)
    prompts = [prompt(20 + i, 25 + 3 * i) for i in range(4)]
    stats = {}
    for on in (True, False):
        eng = engine("gemma3_text", cache, token_budget=16, compaction=on)
        schedule, steps_with_moves = eng.scheduler.schedule, []

        def checked(
            *args: Any,
            _eng: LLMEngine = eng,
            _schedule: Any = schedule,
            steps_with_moves: list[int] = steps_with_moves,
        ) -> Any:
            out = _schedule(*args)
            if out.moves:
                steps_with_moves.append(out.step)
            for item in out.scheduled:  # tables and new ids name where the data is now
                tables = _eng.manager.get_block_ids(item.request_id)
                assert list(item.block_ids) == list(tables)
                for g, ids in enumerate(item.allocation.new_block_ids):
                    assert set(ids) <= set(tables[g])
            return out

        eng.scheduler.schedule = checked  # type: ignore[method-assign]
        done = eng.generate(prompts, max_tokens=24)
        check("gemma3_text", done)
        stats[on] = eng.stats()
        assert stats[on].moved_blocks == eng.manager.stats.moved_blocks
        assert bool(steps_with_moves) == on
        eng.manager.check_invariants()
    assert (stats[True].moved_blocks, stats[True].preemptions) == (19, 1)
    assert (stats[False].moved_blocks, stats[False].preemptions) == (0, 3)


#: gemma3_text's cache at 72 KiB over a 1 MiB host tier: with a token budget of 16,
#: :func:`serve_three_at_a_time` makes compaction move blocks beside the tier's stores.
TIERED_COMPACTION = CacheConfig(
    block_size=4,
    state_block_size=8,
    memory_bytes=72 << 10,
    max_model_len=64,
    host_memory_bytes=1 << 20,
)


def serve_three_at_a_time(eng: LLMEngine) -> list[Completion]:
    """Six conversations of three turns, three conversations at a time, 16 tokens each."""
    turns = conversations(3, n_conv=6, turns=3, first=16, step=6)
    done: list[Completion] = []
    for i in range(0, len(turns), 3):
        done += eng.generate({f"r{i + j}": p for j, p in enumerate(turns[i : i + 3])}, 16)
    return done


def test_compaction_beside_a_host_tier_moves_blocks_in_the_tier_stream() -> None:
    # With lower tiers the moves are ``relocate`` operations of the tier stream: a block
    # compaction evicts is stored to the host before another block moves into its place, and
    # copying the moves first (the stream reordered) gives wrong tokens on this workload.
    eng = engine("gemma3_text", TIERED_COMPACTION, token_budget=16)
    store = eng._tier_store
    assert store is not None
    apply, refilled = store.apply, []

    def watched(ops: Any, _apply: Any = apply) -> None:
        ops, stored = list(ops), set()
        for op in ops:
            if op.op == "store":
                stored.add((op.group_id, op.block))
            elif op.op == "relocate" and (op.group_id, op.block) in stored:
                refilled.append(op.block)
        _apply(ops)

    store.apply = watched  # type: ignore[method-assign]
    check("gemma3_text", serve_three_at_a_time(eng))
    stats = eng.stats()
    assert (stats.moved_blocks, store.relocated, len(refilled)) == (8, 8, 4)
    assert (stats.host_hit_tokens, stats.prefix_hit_tokens, stats.preemptions) == (216, 216, 4)
    eng.check_invariants()


def test_moves_of_a_step_that_runs_nothing_are_copied() -> None:
    # Compaction moves blocks, yet the step is refused and preempts its only request: the
    # step runs nothing, and the moves must still be copied before the request resumes
    # (found by review: the engine returned before copying; the request read NaN blocks).
    cache = CacheConfig(block_size=4, state_block_size=8, memory_bytes=72 << 10, max_model_len=64)
    eng = engine("gemma3_text", cache, token_budget=64)
    schedule, empty_with_moves = eng.scheduler.schedule, []

    def watched(*args: Any) -> Any:
        out = schedule(*args)
        if out.moves and out.is_empty:
            empty_with_moves.append(out.step)
        return out

    eng.scheduler.schedule = watched  # type: ignore[method-assign]
    done = eng.generate([prompt(40, 23), prompt(48, 56)], max_tokens=4)
    assert empty_with_moves == [6]
    check("gemma3_text", done)
    eng.manager.check_invariants()


def test_a_request_refused_alone_beside_its_own_hit_recomputes_it() -> None:
    # 68 KiB of gemma3_text (3 chunks and a tail) holds one 64-token request.  A 58-token
    # prompt preempts itself halfway; readmitted alone, its own 32-token hit pins the chunks
    # the rest needs, and not even one more token fits beside it.  The scheduler then starts
    # it afresh instead of giving up (found by review: "not even one token does fit in an
    # empty cache").
    cache = CacheConfig(block_size=4, state_block_size=8, memory_bytes=68 << 10, max_model_len=64)
    eng = engine("gemma3_text", cache, token_budget=32)
    assert eng.plan.capacity.max_concurrent_requests == 1
    done = eng.generate([prompt(70, 30), prompt(67, 20)], max_tokens=4)
    done += eng.generate([prompt(98, 58)], max_tokens=4)
    check("gemma3_text", done)
    assert eng.stats().preemptions >= 1
    eng.manager.check_invariants()


@pytest.mark.parametrize("name", MODELS)
def test_kernel_block_smaller_than_the_manager_block(name: str) -> None:
    cache = CacheConfig(
        block_size=8,
        kernel_block_size=2,
        state_block_size=8,
        memory_bytes=1 << 20,
        max_model_len=64,
    )
    eng = engine(name, cache)
    for g in eng.layout.groups:
        if g.spec.kind is not CacheKind.STATE:
            assert (g.kernel_block_size, g.kernel_blocks_per_block) == (2, 4)
    done = eng.generate([prompt(13, 19), prompt(14, 6)], max_tokens=6)
    check(name, done, tolerance(name))


def test_qwen3_next_alone_is_within_atol() -> None:
    # One request per step: no batch composition differs from transformers' batch of one.
    eng = engine("qwen3_next", max_num_seqs=1)
    shared = prompt(20, 16)
    done = eng.generate([prompt(9, 10), shared + prompt(22, 5), shared + prompt(23, 2)], 8)
    check("qwen3_next", done, ATOL)
    assert eng.stats().max_batch_requests == 1
    assert [c.num_cached_tokens for c in done] == [0, 0, 16]


def _state_layout(state_slots: int, *, shared: int = 0) -> MemoryLayout:
    """Full attention (4-token blocks) + a state group (8-token alignment): a pool each, or
    with ``shared`` one uniform pool of that many blocks."""
    full = FullAttentionSpec(num_kv_heads=1, head_dim=8, dtype=DType.FP16)
    state = StateSpec(
        mixer=StateMixer.MAMBA2,
        tensors=(StateTensor(name="ssm", shape=(4, 4), dtype=DType.FP32),),
    )
    groups = tuple(
        GroupPlan(
            group_id=i,
            spec=spec,
            members=((i, 0),),
            block_size=bs,
            kernel_block_size=bs,
            page_bytes=spec.bytes_per_block(bs),
        )
        for i, (spec, bs) in enumerate([(full, 4), (state, 8)])
    )
    if shared:
        bb = max(g.block_bytes for g in groups)
        pool = PoolPlan(pool_id=0, group_ids=(0, 1), block_bytes=bb, num_blocks=shared)
        return MemoryLayout(strategy=Strategy.UNIFORM, groups=groups, pools=(pool,))
    pools = tuple(
        PoolPlan(pool_id=i, group_ids=(i,), block_bytes=g.block_bytes, num_blocks=n)
        for i, (g, n) in enumerate(zip(groups, (32, state_slots), strict=True))
    )
    return MemoryLayout(strategy=Strategy.POOLS, groups=groups, pools=pools)


def test_a_checkpoint_its_own_state_pool_cannot_hold_is_skipped() -> None:
    # One usable state slot: the running state fits, its checkpoints never do; they are
    # dropped (an optimisation) and the request runs to its end without a preemption.
    manager = KVCacheManager(_state_layout(2))
    sched = Scheduler(manager, SchedulerConfig(token_budget=4), max_model_len=64)
    sched.add_request("a", list(range(10, 30)), max_tokens=2)
    chunks: list[tuple[int, int]] = []
    while sched.has_unfinished():
        out = sched.schedule()
        chunks += [(s.start, s.num_new_tokens) for s in out.scheduled]
        assert all(not s.allocation.copies_after for s in out.scheduled)
        sched.update(out, {s.request_id: 7 for s in out.scheduled if s.samples})
    assert chunks == [(0, 4), (4, 4), (8, 4), (12, 4), (16, 4), (20, 1)]
    assert sched.num_preemptions == 0


def test_scheduler_refuses_a_request_that_cannot_progress_even_alone() -> None:
    # One shared pool of 3 usable blocks: 2 attention blocks and the running state fit, the
    # checkpoint at token 8 never does (alone, the request runs without it) and neither
    # does the third attention block past token 8.  Preempting and recomputing would loop
    # forever; the scheduler says so instead.
    manager = KVCacheManager(_state_layout(0, shared=4))
    sched = Scheduler(manager, SchedulerConfig(token_budget=4), max_model_len=64)
    sched.add_request("a", list(range(10, 30)), max_tokens=2)
    chunks: list[tuple[int, int]] = []
    with pytest.raises(SchedulerError, match="cannot hold it past 8 tokens even alone"):
        for _ in range(20):
            before = manager.snapshot()
            out = sched.schedule()
            chunks += [(s.start, s.num_new_tokens) for s in out.scheduled]
            sched.update(out, {})
    # the refusing call changed nothing; before it, halving chunks tried to fit
    assert manager.snapshot() == before
    assert chunks[:3] == [(0, 4), (4, 4), (0, 2)] and chunks[-1] == (7, 1)
    assert sched.num_preemptions == 2


def test_scheduler_budget_below_the_alignment_still_progresses() -> None:
    manager = KVCacheManager(_state_layout(8))
    sched = Scheduler(manager, SchedulerConfig(token_budget=3), max_model_len=64)
    sched.add_request("a", list(range(10, 30)), max_tokens=1)
    chunks = []
    while sched.has_unfinished():
        out = sched.schedule()
        chunks += [(s.start, s.num_new_tokens) for s in out.scheduled]
        sched.update(out, {s.request_id: 1 for s in out.scheduled if s.samples})
    # 3-token chunks end unaligned where no multiple of 8 is in reach, else on one
    assert chunks == [(0, 3), (3, 3), (6, 2), (8, 3), (11, 3), (14, 2), (16, 3), (19, 1)]
