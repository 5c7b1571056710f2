from __future__ import annotations

from typing import Any

import pytest

from hybridkv.cache import KVCacheManager
from hybridkv.plan import GroupPlan, MemoryLayout, PoolPlan, Strategy
from hybridkv.scheduler import FinishReason, Scheduler, SchedulerConfig, SchedulerError
from hybridkv.specs import (
    CacheSpec,
    DType,
    FullAttentionSpec,
    SlidingWindowSpec,
    StateSpec,
    StateTensor,
)

FULL = FullAttentionSpec(num_kv_heads=1, head_dim=8, dtype=DType.FP16)
SWA = SlidingWindowSpec(num_kv_heads=1, head_dim=8, dtype=DType.FP16, window=8)
STATE = StateSpec(
    mixer="mamba2", tensors=(StateTensor(name="ssm", shape=(4, 4), dtype=DType.FP32),)
)


def _layout(specs: list[tuple[CacheSpec, int]], num_blocks: int) -> MemoryLayout:
    groups = tuple(
        GroupPlan(
            group_id=i,
            spec=spec,
            members=((i, 0),),
            block_size=bs,
            kernel_block_size=bs,
            page_bytes=spec.bytes_per_block(bs),
        )
        for i, (spec, bs) in enumerate(specs)
    )
    pools = tuple(
        PoolPlan(pool_id=i, group_ids=(i,), block_bytes=g.block_bytes, num_blocks=num_blocks)
        for i, g in enumerate(groups)
    )
    return MemoryLayout(strategy=Strategy.POOLS, groups=groups, pools=pools)


def _run(sched: Scheduler, token: int = 7) -> list[list[tuple[str, int, int, int]]]:
    steps = []
    while sched.has_unfinished():
        out = sched.schedule()
        steps.append(
            [(s.request_id, s.start, s.num_new_tokens, s.num_cached_tokens) for s in out.scheduled]
        )
        sched.update(out, {s.request_id: token for s in out.scheduled if s.samples})
        sched.manager.check_invariants()
        assert len(steps) < 500
    return steps


def test_chunked_prefill_then_decode_exact_steps() -> None:
    mgr = KVCacheManager(_layout([(FULL, 4)], 64))
    sched = Scheduler(mgr, SchedulerConfig(token_budget=8), max_model_len=64)
    sched.add_request("a", list(range(100, 118)), max_tokens=2)
    assert _run(sched) == [
        [("a", 0, 8, 0)],
        [("a", 8, 8, 0)],
        [("a", 16, 2, 0)],
        [("a", 18, 1, 0)],
    ]


def test_state_layout_splits_at_alignment_and_junction() -> None:
    # alignment = lcm(4, 4, 8) = 8; shared prefix 30 tokens -> junction 28, aligned 24
    # every window block cached, so r1 hits r0's first chunk (with the default tail
    # retention r0 keeps only the window before its prompt's end: r1 would start from 0)
    layout = _layout([(FULL, 4), (SWA, 4), (STATE, 8)], 40)
    mgr = KVCacheManager(layout, window_retention="all")
    config = SchedulerConfig(token_budget=16, checkpoint_before_end=False)
    sched = Scheduler(mgr, config, max_model_len=100)
    prefix = list(range(100, 130))
    for i in range(4):
        sched.add_request(f"r{i}", [*prefix, i, i, i, i, i], max_tokens=6)
    steps = _run(sched)
    assert steps[:7] == [
        [("r0", 0, 16, 0)],
        [("r0", 16, 16, 0)],
        [("r0", 32, 3, 0), ("r1", 16, 8, 16)],  # r1 stops at the junction (24)
        [("r0", 35, 1, 0), ("r1", 24, 8, 0)],
        [("r0", 36, 1, 0), ("r1", 32, 3, 0), ("r2", 24, 8, 24)],  # r2 resumes at 24
        [("r0", 37, 1, 0), ("r1", 35, 1, 0), ("r2", 32, 3, 0), ("r3", 24, 8, 24)],
        [("r0", 38, 1, 0), ("r1", 36, 1, 0), ("r2", 35, 1, 0), ("r3", 32, 3, 0)],
    ]


def test_no_split_without_state_groups() -> None:
    mgr = KVCacheManager(_layout([(FULL, 4), (SWA, 4)], 64))
    sched = Scheduler(mgr, SchedulerConfig(token_budget=16), max_model_len=100)
    assert not sched.split_for_state
    sched.add_request("a", list(range(100, 121)), max_tokens=1)
    assert _run(sched) == [[("a", 0, 16, 0)], [("a", 16, 5, 0)]]


def test_preemption_by_recompute_when_blocks_run_out() -> None:
    # 6 usable blocks of 4 tokens: two 10-token prompts fit, their decodes do not
    mgr = KVCacheManager(_layout([(FULL, 4)], 7))
    sched = Scheduler(mgr, SchedulerConfig(token_budget=32), max_model_len=64)
    sched.add_request("a", list(range(100, 110)), max_tokens=8)
    sched.add_request("b", list(range(200, 210)), max_tokens=8)
    steps = _run(sched)
    assert sched.num_preemptions >= 1
    flat = [item for step in steps for item in step]
    # every request produced all its tokens in the end
    assert sum(1 for rid, *_ in flat if rid == "a") >= 8
    assert not sched.seqs


def test_stop_reasons_and_streaming() -> None:
    mgr = KVCacheManager(_layout([(FULL, 4)], 32))
    sched = Scheduler(mgr, SchedulerConfig(), max_model_len=12)
    sched.add_request("eos", [1, 2, 3], max_tokens=5, eos_token_ids=[9])
    sched.add_request("len", [1, 2, 3], max_tokens=2)
    sched.add_request("max", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], max_tokens=50)
    reasons: dict[str, FinishReason | None] = {}
    streamed: dict[str, list[int]] = {}
    tokens = iter([9, 4, 4, 4, 4, 4, 4, 4, 4])
    while sched.has_unfinished():
        out = sched.schedule()
        sampled = {s.request_id: 4 for s in out.scheduled if s.samples}
        if "eos" in sampled:
            sampled["eos"] = next(tokens)
        for res in sched.update(out, sampled):
            streamed.setdefault(res.request_id, []).extend(res.new_token_ids)
            if res.finished:
                reasons[res.request_id] = res.finish_reason
    assert reasons == {
        "eos": FinishReason.STOP,
        "len": FinishReason.LENGTH,
        "max": FinishReason.MAX_MODEL_LEN,
    }
    assert streamed == {"eos": [9], "len": [4, 4], "max": [4, 4]}


def test_bad_requests_are_refused() -> None:
    mgr = KVCacheManager(_layout([(FULL, 4)], 32))
    sched = Scheduler(mgr, SchedulerConfig(), max_model_len=8)
    with pytest.raises(SchedulerError, match="maximum model length is 8"):
        sched.add_request("long", list(range(8)), max_tokens=1)
    with pytest.raises(SchedulerError, match="max_tokens must be >= 1"):
        sched.add_request("zero", [1], max_tokens=0)
    sched.add_request("a", [1], max_tokens=1)
    with pytest.raises(SchedulerError, match="already queued"):
        sched.add_request("a", [1], max_tokens=1)
    with pytest.raises(SchedulerError, match="token_budget"):
        SchedulerConfig(token_budget=0)


def test_whole_prefill_computes_each_prompt_in_one_step_without_hits() -> None:
    mgr = KVCacheManager(_layout([(FULL, 4), (STATE, 8)], 64))
    sched = Scheduler(mgr, SchedulerConfig(token_budget=16, whole_prefill=True), max_model_len=64)
    prefix = list(range(100, 110))
    sched.add_request("a", [*prefix, 1], max_tokens=2)  # 11 tokens
    sched.add_request("b", [*prefix, 2, 2], max_tokens=2)  # 12: waits for a whole budget
    with pytest.raises(SchedulerError, match=r"prompt has 17 tokens; whole_prefill"):
        sched.add_request("c", list(range(17)), max_tokens=1)
    assert _run(sched) == [
        [("a", 0, 11, 0)],
        [("a", 11, 1, 0), ("b", 0, 12, 0)],  # a's prefix is cached, but b starts from 0
        [("b", 12, 1, 0)],
    ]


def test_state_layout_also_splits_one_unit_before_the_prompt_end() -> None:
    # alignment 8, prompt 35: the last aligned boundary is 32, the one before it 24.  With the
    # default (on at an alignment <= 512) the prefill stops at 24 and at 32, and the state
    # group saves a checkpoint at each (reasons before_end and prompt_end).
    layout = _layout([(FULL, 4), (STATE, 8)], 40)
    mgr = KVCacheManager(layout)  # "yield" admits every reason until it has 8 on record
    sched = Scheduler(mgr, SchedulerConfig(token_budget=16), max_model_len=100)
    assert sched.before_end
    sched.add_request("a", list(range(100, 135)), max_tokens=2)
    assert _run(sched) == [
        [("a", 0, 16, 0)],
        [("a", 16, 8, 0)],  # stops at 24 (before_end)
        [("a", 24, 8, 0)],  # stops at 32 (prompt_end)
        [("a", 32, 3, 0)],
        [("a", 35, 1, 0)],
    ]
    report = mgr.checkpoint_admission_report()
    assert report is not None
    assert {r: v["checkpoints"] for r, v in report.items() if v["checkpoints"]} == {
        "chunk": 1,
        "before_end": 1,
        "prompt_end": 1,
    }
    # a follow-up that differs from "a" after token 30 resumes from the checkpoint at 24
    sched.add_request("b", [*range(100, 130), 7, 7, 7, 7, 7], max_tokens=1)
    assert _run(sched)[0] == [("b", 24, 8, 24)]
    # off: no stop at 24
    off = Scheduler(
        KVCacheManager(layout, checkpoint_admission="all"),
        SchedulerConfig(token_budget=16, checkpoint_before_end=False),
        max_model_len=100,
    )
    off.add_request("a", list(range(100, 135)), max_tokens=1)
    assert _run(off)[:3] == [[("a", 0, 16, 0)], [("a", 16, 16, 0)], [("a", 32, 3, 0)]]


@pytest.mark.parametrize("admission", ["reserve", "greedy"])
def test_reserve_admission_waits_where_greedy_preempts(admission: str) -> None:
    # 8 usable blocks of 4 tokens; a's prompt takes 6, b's 4 (5 once it decodes)
    mgr = KVCacheManager(_layout([(FULL, 4)], 9))
    config = SchedulerConfig(token_budget=8, max_prefill_chunk=4, admission=admission)
    sched = Scheduler(mgr, config, max_model_len=64)
    sched.add_request("a", list(range(100, 124)), max_tokens=1)
    sched.add_request("b", list(range(200, 216)), max_tokens=3)
    steps = _run(sched)
    a_alone = [[("a", start, 4, 0)] for start in range(0, 24, 4)]
    if admission == "reserve":  # b waits until a's whole prompt is done
        assert sched.num_preemptions == 0
        b_alone = [[("b", start, 4, 0)] for start in range(0, 16, 4)]
        assert steps == [*a_alone, *b_alone, [("b", 16, 1, 0)], [("b", 17, 1, 0)]]
    else:  # b starts next to a; a's fifth chunk finds the cache full and preempts b
        assert sched.num_preemptions == 1
        assert steps == [
            *[[("a", start, 4, 0), ("b", start, 4, 0)] for start in range(0, 16, 4)],
            *a_alone[4:],
            [("b", 8, 4, 8)],  # b's first two blocks were still cached
            [("b", 12, 4, 0)],
            [("b", 16, 1, 0)],
            [("b", 17, 1, 0)],
        ]


def test_reserve_admission_falls_back_to_chunks_when_refused_alone() -> None:
    # A cache that refuses every reservation (as one too small for a whole prompt at once
    # would) still serves the request chunk by chunk once nothing else runs.
    mgr = KVCacheManager(_layout([(FULL, 4)], 64))
    refused: list[int] = []

    class NoReservations:  # the manager, but every reservation is refused
        def __getattr__(self, name: str) -> Any:
            return getattr(mgr, name)

        def allocate_slots(self, *args: Any, **kwargs: Any) -> Any:
            if kwargs.get("num_reserved_tokens"):
                refused.append(kwargs["num_reserved_tokens"])
                return None
            return mgr.allocate_slots(*args, **kwargs)

    sched = Scheduler(NoReservations(), SchedulerConfig(token_budget=8), max_model_len=64)  # type: ignore[arg-type]
    sched.add_request("a", list(range(100, 120)), max_tokens=1)
    assert _run(sched) == [[("a", 0, 8, 0)], [("a", 8, 8, 0)], [("a", 16, 4, 0)]]
    assert refused == [12] and sched.num_preemptions == 0


def test_admission_policy_is_checked() -> None:
    with pytest.raises(SchedulerError, match="admission: unknown policy 'lazy'; valid: reserve"):
        SchedulerConfig(admission="lazy")


class _RefusingOnce:
    """A manager that, while ``refuse`` is set, refuses every allocation and whose first
    compaction then moves one block (a proxy: the compiled manager's methods cannot be
    patched)."""

    def __init__(self, manager: KVCacheManager, move: Any) -> None:
        self._manager = manager
        self.move = move
        self.refuse = False
        self.compactions = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._manager, name)

    def allocate_slots(self, *args: Any, **kw: Any) -> Any:
        return None if self.refuse else self._manager.allocate_slots(*args, **kw)

    def compact(self, *args: Any, **kw: Any) -> tuple[Any, ...]:
        self.compactions += 1
        return (self.move,) if self.compactions == 1 else ()


def test_moves_of_a_schedule_that_raised_come_with_the_next_output() -> None:
    # Compaction moved a block (the tables name its new id), then the step was refused for
    # good and schedule() raised: the move must still reach whoever copies blocks, first in
    # the next output (found by review: it was lost with the exception).
    from hybridkv.cache.types import BlockId, BlockMove

    move = BlockMove(0, BlockId(1), BlockId(9))
    mgr = _RefusingOnce(KVCacheManager(_layout([(FULL, 4)], 64)), move)
    sched = Scheduler(mgr, SchedulerConfig(token_budget=8), max_model_len=64)  # type: ignore[arg-type]
    sched.add_request("a", list(range(3)), max_tokens=4)
    out = sched.schedule()
    sched.update(out, {"a": 7})
    mgr.refuse = True
    with pytest.raises(SchedulerError, match="even alone"):
        sched.schedule()
    assert mgr.compactions == 2
    mgr.refuse = False
    out = sched.schedule()
    assert out.moves == (move,) and [s.request_id for s in out.scheduled] == ["a"]
    assert sched.schedule().moves == ()  # reported once
