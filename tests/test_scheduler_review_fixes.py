"""Regression tests of an outside review of the scheduler: whole-prompt re-admission,
blocks held by finished requests, retry flags, ``protect_as``, all-or-nothing updates,
imports, configuration checks and aborts."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import torch

from hybridkv.cache import KVCacheManager
from hybridkv.cache.errors import UnknownRequestError
from hybridkv.models import resolve_model
from hybridkv.scheduler import (
    FinishReason,
    Scheduler,
    SchedulerConfig,
    SchedulerError,
    SchedulerOutput,
)
from hybridkv.scheduler import scheduler as scheduler_module
from hybridkv.sim import ModelProfile, SimConfig, load_model_config
from hybridkv.sim.disagg import PDResult, simulate_pd
from hybridkv.workloads import SyntheticOptions, Workload, WorkloadRequest, synthetic_workload
from test_scheduler import FULL, _layout


def _sched(num_blocks: int = 32, max_model_len: int = 64, **config: Any) -> Scheduler:
    """A full-attention cache of 4-token blocks (``num_blocks - 1`` usable)."""
    mgr = KVCacheManager(_layout([(FULL, 4)], num_blocks), max_model_len=max_model_len)
    return Scheduler(mgr, SchedulerConfig(**config), max_model_len=max_model_len)


def _step(sched: Scheduler, token: int = 7) -> tuple[list[tuple[str, int, int]], list[str]]:
    out = sched.schedule()
    sched.update(out, {s.request_id: token for s in out.scheduled if s.samples})
    sched.manager.check_invariants()
    return [(s.request_id, s.start, s.num_new_tokens) for s in out.scheduled], list(out.preempted)


def _state(sched: Scheduler) -> dict[str, tuple[int, int, list[int], int, bool, bool]]:
    """Everything update() or a retry could change about each request."""
    return {
        rid: (
            q.request.num_computed_tokens,
            q.num_output_tokens,
            list(q.request.token_ids),
            q.chunk_cap,
            q.no_reserve,
            q.no_hit,
        )
        for rid, q in sched.seqs.items()
    }


class _Proxy:
    """A manager whose allocations can be refused (the compiled manager's methods cannot be
    patched)."""

    def __init__(self, manager: KVCacheManager) -> None:
        self._manager = manager
        self.refuse_all = False
        self.refuse_reserve = False
        self.most_tokens: int | None = None
        self.reserved: list[int] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._manager, name)

    def allocate_slots(self, request: Any, num_new_tokens: int, **kw: Any) -> Any:
        if kw.get("num_reserved_tokens"):
            self.reserved.append(kw["num_reserved_tokens"])
            if self.refuse_reserve:
                return None
        if self.refuse_all or (self.most_tokens is not None and num_new_tokens > self.most_tokens):
            return None
        return self._manager.allocate_slots(request, num_new_tokens, **kw)


def _proxied(num_blocks: int = 32, **config: Any) -> tuple[Scheduler, _Proxy]:
    proxy = _Proxy(KVCacheManager(_layout([(FULL, 4)], num_blocks), max_model_len=64))
    sched = Scheduler(proxy, SchedulerConfig(**config), max_model_len=64)  # type: ignore[arg-type]
    return sched, proxy


# -- 1: whole_prefill re-admits a preempted request that outgrew the budget ------------------


def test_whole_prefill_resumes_a_request_past_the_budget_alone() -> None:
    # 8 usable blocks (32 tokens).  b (16 tokens) is preempted at 20 tokens; it can only
    # resume from token 0, and 21 tokens are past the 20-token budget: it waits until a
    # finishes, then runs alone (found by review: it was never admitted again).
    sched = _sched(9, token_budget=20, whole_prefill=True)
    sched.add_request("a", [1, 2, 3, 4], max_tokens=8)
    sched.add_request("b", list(range(200, 216)), max_tokens=12)
    steps = []
    while sched.has_unfinished():
        steps.append(_step(sched))
        assert len(steps) < 40
    assert steps == [
        ([("a", 0, 4), ("b", 0, 16)], []),
        *[([("a", 4 + i, 1), ("b", 16 + i, 1)], []) for i in range(4)],
        ([("a", 8, 1)], ["b"]),
        ([("a", 9, 1)], []),
        ([("a", 10, 1)], []),  # a finishes; b (21 tokens) waited: a ran in the step
        ([("b", 0, 21)], []),  # alone, past the budget
        *[([("b", 21 + i, 1)], []) for i in range(6)],
    ]
    # a fresh prompt past the budget is still refused up front
    with pytest.raises(SchedulerError, match=r"prompt has 21 tokens; whole_prefill"):
        sched.add_request("c", list(range(21)), max_tokens=1)


def test_jamba_engine_resumes_a_preempted_request_that_outgrew_the_budget() -> None:
    from hybridkv.engine import CacheConfig, LLMEngine, reference_copy, verify_completions
    from hybridkv.engine.models import load_model

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = load_model("jamba")
        ref = reference_copy(model)
        cache = CacheConfig(num_blocks=8, block_size=4, max_model_len=32, strategy="pools")
        engine = LLMEngine(model, cache=cache, scheduler=SchedulerConfig(token_budget=20))
        assert engine.scheduler.config.whole_prefill
        engine.add_request("a", [1, 2, 3, 4], max_tokens=20)
        engine.add_request("b", list(range(10, 26)), max_tokens=14)
        engine.add_request("c", [5, 6, 7], max_tokens=2)
        engine.run()  # raised "nothing could be scheduled" before the fix
        done = [engine.completions[r] for r in ("a", "b", "c")]
        assert [len(c.token_ids) for c in done] == [20, 14, 2]
        assert done[1].num_preemptions == 1
        assert verify_completions(ref, done).ok
    finally:
        torch.set_num_threads(before)


# -- 2: blocks held by finished requests are not an empty cache -----------------------------


def _hold(sched: Scheduler, n: int) -> None:
    sched.add_request("h", list(range(500, 500 + n)), max_tokens=1, hold=True)
    while sched.has_unfinished():
        _step(sched)
    assert list(sched.held) == ["h"]


def test_a_waiting_request_waits_unchanged_for_held_blocks() -> None:
    # h's 40 tokens hold all 10 blocks: y waits (found by review: "not even one token does
    # fit in an empty cache", with its chunk cap cut to 1 and no_reserve set for good)
    sched = _sched(11, max_model_len=200, token_budget=64)
    _hold(sched, 39)
    sched.add_request("y", list(range(100, 120)), max_tokens=1)
    before = _state(sched)
    assert _step(sched) == ([], [])
    assert _state(sched) == before and [q.request_id for q in sched.waiting] == ["y"]
    sched.release("h")
    assert _step(sched) == ([("y", 0, 20)], [])  # the whole prompt in one step


def test_a_prompt_beside_held_blocks_takes_what_fits_and_no_cap_for_good() -> None:
    # h holds 8 of 10 blocks; x's 32-token prompt takes the 2 free blocks, waits, then runs
    # the rest in one chunk (found by review: a chunk cap of 8 learned beside h slowed it
    # for life)
    sched = _sched(11, max_model_len=200, token_budget=64)
    _hold(sched, 29)
    sched.add_request("x", list(range(100, 132)), max_tokens=1)
    assert _step(sched) == ([("x", 0, 8)], [])
    assert sched.seqs["x"].chunk_cap == 0
    assert _step(sched) == ([], [])
    sched.release("h")
    assert _step(sched) == ([("x", 8, 24)], [])
    assert not sched.has_unfinished() and sched.num_preemptions == 0


def test_a_running_prompt_beside_held_blocks_takes_a_smaller_chunk_in_place() -> None:
    # h holds 5 of 10 blocks: x's second 16-token chunk does not fit the one free block; a
    # 4-token chunk runs in its place (found by review: x preempted itself and kept a chunk
    # cap of 8 for good), then x waits for the release and takes whole chunks again
    sched = _sched(11, max_model_len=200, token_budget=16, admission="greedy")
    _hold(sched, 19)
    sched.add_request("x", list(range(100, 140)), max_tokens=1)
    steps = [_step(sched) for _ in range(3)]
    assert steps == [([("x", 0, 16)], []), ([("x", 16, 4)], []), ([], [])]
    assert sched.seqs["x"].chunk_cap == 0 and sched.num_preemptions == 0
    sched.release("h")
    assert [_step(sched), _step(sched)] == [([("x", 20, 16)], []), ([("x", 36, 4)], [])]


def test_a_running_request_alone_waits_for_held_blocks() -> None:
    # h holds 8 of 10 blocks; x's decode past token 8 needs a third block: it waits, still
    # running (found by review: "cannot hold it past 8 tokens even alone")
    sched = _sched(11, max_model_len=200, token_budget=64)
    _hold(sched, 31)
    sched.add_request("x", list(range(100, 107)), max_tokens=4)
    assert _step(sched) == ([("x", 0, 7)], [])
    assert _step(sched) == ([("x", 7, 1)], [])
    before = _state(sched)
    sched.add_request("z", [1], max_tokens=1)  # nothing is admitted past the stalled one
    assert _step(sched) == ([], [])
    assert [q.request_id for q in sched.running] == ["x"] and sched.num_preemptions == 0
    assert {k: v for k, v in _state(sched).items() if k == "x"} == before
    sched.release("h")
    assert _step(sched) == ([("x", 8, 1), ("z", 0, 1)], [])


def _simulate_pd(
    work: Workload, pre: SimConfig, dec: SimConfig, watch: Callable[[Scheduler, Any], None]
) -> PDResult:
    """:func:`simulate_pd` of gpt-oss-20b, ``watch(scheduler, output)`` after each step."""
    schedule = scheduler_module.Scheduler.schedule

    def watched(self: Scheduler, *args: Any) -> SchedulerOutput:
        out = schedule(self, *args)
        watch(self, out)
        return out

    model = resolve_model("gpt-oss-20b")
    profile = ModelProfile.from_config(load_model_config("gpt-oss-20b"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(scheduler_module.Scheduler, "schedule", watched)
        return simulate_pd(model, profile, work, pre, dec)


CHAT = synthetic_workload("chat", SyntheticOptions(num_requests=40, seed=5))


def test_simulated_prefill_instance_waits_for_its_handovers() -> None:
    # found by review: the prefill instance's held handovers made it raise "cannot hold it
    # ... even alone" (or cut chunk caps for good) at 0.5 GiB; it now waits for them
    cfg = SimConfig(memory_bytes=1 << 29, max_model_len=16384, use_arrivals=False)
    caps: list[int] = []

    def watch(sched: Scheduler, out: Any) -> None:
        caps.extend(q.chunk_cap for q in [*sched.waiting, *sched.running] if q.chunk_cap)

    res = _simulate_pd(CHAT, cfg, cfg, watch)
    assert res.finished == 40 and res.prefill_steps == 146 and caps == []


# -- 3: retry flags are not sticky --------------------------------------------------------


def test_a_raise_leaves_the_request_as_it_was() -> None:
    sched, proxy = _proxied()
    sched.add_request("a", list(range(100, 120)), max_tokens=1)
    proxy.refuse_all = True
    before = _state(sched)
    with pytest.raises(SchedulerError, match="not even one token does fit in an empty cache"):
        sched.schedule()
    assert _state(sched) == before == {"a": (0, 0, list(range(100, 120)), 0, False, False)}
    proxy.refuse_all = False
    assert _step(sched) == ([("a", 0, 20)], [])


def test_a_chunk_cap_lasts_for_its_prefill_only() -> None:
    # a cache that takes at most 4 tokens a step: the cap is learned alone and kept for the
    # rest of that prefill (no preemption per chunk), then cleared
    sched, proxy = _proxied(token_budget=16, admission="greedy")
    proxy.most_tokens = 4
    sched.add_request("a", list(range(100, 116)), max_tokens=2)
    assert _step(sched) == ([("a", 0, 4)], [])
    assert sched.seqs["a"].chunk_cap == 4
    assert [_step(sched) for _ in range(3)] == [([("a", s, 4)], []) for s in (4, 8, 12)]
    assert sched.seqs["a"].chunk_cap == 0 and sched.num_preemptions == 0


def test_a_request_admitted_without_reserving_tries_again_next_time() -> None:
    sched, proxy = _proxied(token_budget=8)
    sched.add_request("a", list(range(100, 120)), max_tokens=2)
    proxy.refuse_reserve = True
    assert _step(sched) == ([("a", 0, 8)], [])
    assert sched.seqs["a"].no_reserve  # this admission went chunk by chunk
    proxy.refuse_reserve = False
    sched._preempt_newest()
    proxy.reserved.clear()
    assert _step(sched) == ([("a", 8, 8)], [])  # its 8 cached tokens hit
    assert proxy.reserved == [4] and not sched.seqs["a"].no_reserve


# -- 4: protect_as is checked when the request is added ------------------------------------


@pytest.mark.parametrize("bad", ["", 5, b"s"])
def test_a_bad_protect_as_is_refused_when_added(bad: Any) -> None:
    sched = _sched()
    with pytest.raises(SchedulerError, match=r"request 'a': protect_as must be None or a non-"):
        sched.add_request("a", [1, 2, 3], max_tokens=1, protect_as=bad)
    assert not sched.seqs and not sched.waiting
    sched.add_request("a", [1, 2, 3], max_tokens=1, protect_as="s")  # the id is free
    assert _step(sched) == ([("a", 0, 3)], [])


def test_a_protect_that_raises_leaves_the_request_running() -> None:
    class Refusing(_Proxy):
        def protect(self, request_id: str, session: str) -> int:
            raise RuntimeError("tier failure")

    mgr = Refusing(KVCacheManager(_layout([(FULL, 4)], 32), max_model_len=64))
    sched = Scheduler(mgr, SchedulerConfig(), max_model_len=64)  # type: ignore[arg-type]
    sched.add_request("a", [1, 2, 3], max_tokens=1, protect_as="s")
    out = sched.schedule()
    with pytest.raises(RuntimeError, match="tier failure"):
        sched.update(out, {"a": 7})
    assert [q.request_id for q in sched.running] == ["a"] and "a" in sched.seqs
    assert sched.seqs["a"].finish_reason is None and mgr.get_block_ids("a") == ([1],)


def test_engine_refuses_a_bad_protect_as_when_added() -> None:
    from hybridkv.engine import CacheConfig, LLMEngine

    cache = CacheConfig(block_size=4, max_model_len=64, host_memory_bytes=1 << 20)
    engine = LLMEngine("llama", cache=cache)
    with pytest.raises(SchedulerError, match="protect_as must be None or a non-empty str"):
        engine.add_request("a", [1, 2, 3], max_tokens=1, protect_as="")
    assert not engine.scheduler.seqs and not engine._live
    engine.add_request("a", [1, 2, 3], max_tokens=1, protect_as="s")
    engine.run()
    assert list(engine.completions) == ["a"]
    engine.check_invariants()
    engine.close()


# -- 5: update() checks every token before it changes anything -----------------------------


def test_a_bad_token_changes_nothing_and_the_retry_applies_once() -> None:
    sched = _sched()
    sched.add_request("a", [1, 2, 3], max_tokens=3)
    sched.add_request("b", [4, 5, 6], max_tokens=3)
    out = sched.schedule()
    before = _state(sched)
    with pytest.raises(SchedulerError, match=r"update: request 'b'.*got -5"):
        sched.update(out, {"a": 7, "b": -5})
    assert _state(sched) == before
    sched.update(out, {"a": 7, "b": 8})
    assert _state(sched) == {
        "a": (3, 1, [1, 2, 3, 7], 0, False, False),
        "b": (3, 1, [4, 5, 6, 8], 0, False, False),
    }
    with pytest.raises(SchedulerError, match=r"request 'a' of step 1 is not running from token 0"):
        sched.update(out, {"a": 7, "b": 8})  # the same output again
    sched.manager.check_invariants()


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (np.int64(7), 7),
        (torch.tensor(7), 7),
        (np.array([7]), 7),
        ([7], 7),
        (7.0, "7.0 (float)"),
        (None, "None (NoneType)"),
        ("7", "'7' (str)"),
        ("12", "'12' (str)"),
        (True, "True (bool)"),
        (torch.tensor(True), "tensor(True) (Tensor)"),
        (torch.tensor(7.0), "tensor(7.) (Tensor)"),
        (-5, "got -5"),
        (1 << 63, f"got {1 << 63}"),
        ([], "sampled [] for drafts []"),
    ],
)
def test_sampled_values_are_token_ids(value: Any, expected: int | str) -> None:
    sched = _sched()
    sched.add_request("a", [1, 2, 3], max_tokens=3)
    out = sched.schedule()
    before = _state(sched)
    if isinstance(expected, int):
        sched.update(out, {"a": value})
        assert sched.seqs["a"].request.token_ids == [1, 2, 3, expected]
        assert type(sched.seqs["a"].request.token_ids[-1]) is int
        return
    with pytest.raises(SchedulerError, match=r"update: request 'a'") as info:
        sched.update(out, {"a": value})
    assert expected in str(info.value)
    assert _state(sched) == before


# -- 6: imports respect max_num_seqs and the stop conditions -------------------------------


def _fill(tables: Any, hit: int, res: Any) -> None:
    pass


def test_an_import_waits_for_room_under_max_num_seqs() -> None:
    sched = _sched(max_num_seqs=1)
    assert sched.import_computed("i0", [1, 2, 3, 4], [9], max_tokens=3, fill=_fill)
    assert sched.import_computed("i1", [1, 2, 3, 5], [9], max_tokens=3, fill=_fill) is None
    assert list(sched.seqs) == ["i0"] and len(sched.running) == 1
    assert sched.manager.stats.query_tokens == 4  # i1 was not even looked up
    with pytest.raises(UnknownRequestError):
        sched.manager.get_block_ids("i1")
    while sched.has_unfinished():
        assert len(_step(sched)[0]) == 1
    assert sched.import_computed("i1", [1, 2, 3, 5], [9], max_tokens=3, fill=_fill)


@pytest.mark.parametrize(
    ("prompt", "outputs", "max_tokens", "eos", "reason"),
    [
        ([1, 2, 3], [9], 1, [], FinishReason.LENGTH),
        ([1, 2, 3], [2], 3, [2], FinishReason.STOP),
        (list(range(1, 8)), [9], 5, [], FinishReason.MAX_MODEL_LEN),
        ([1, 2, 3], [9, 2, 5], 5, [2], FinishReason.STOP),
    ],
)
def test_an_import_its_tokens_already_finish_is_refused(
    prompt: list[int], outputs: list[int], max_tokens: int, eos: list[int], reason: FinishReason
) -> None:
    sched = _sched(max_model_len=8)
    assert (
        sched.import_finish(len(prompt), outputs, max_tokens=max_tokens, eos_token_ids=eos)
        is reason
    )
    with pytest.raises(SchedulerError, match=rf"already finish it \({reason.value}"):
        sched.import_computed(
            "x", prompt, outputs, max_tokens=max_tokens, eos_token_ids=eos, fill=_fill
        )
    assert not sched.seqs and not sched.running
    assert sched.import_finish(3, [9], max_tokens=2) is None


def test_an_import_with_bad_tokens_is_refused() -> None:
    sched = _sched()
    with pytest.raises(SchedulerError, match=r"output_token_ids: a token id must be an int"):
        sched.import_computed("x", [1, 2], [1.5], max_tokens=3, fill=_fill)  # type: ignore[list-item]
    with pytest.raises(SchedulerError, match="import_finish: max_tokens: must be an int >= 1"):
        sched.import_finish(3, [9], max_tokens="2")  # type: ignore[arg-type]
    assert not sched.seqs


def test_simulated_decode_instance_keeps_max_num_seqs() -> None:
    pre = SimConfig(memory_bytes=8 << 30, max_model_len=16384, use_arrivals=False)
    most: dict[int, int] = {}

    def watch(sched: Scheduler, out: SchedulerOutput) -> None:
        key = sched.config.max_num_seqs
        most[key] = max(most.get(key, 0), len(out.scheduled))

    res = _simulate_pd(CHAT, pre, replace(pre, max_num_seqs=4), watch)
    assert res.finished == 40 and most[4] == 4 and res.link_waits > 0


def test_simulated_handover_its_first_token_finishes_is_not_imported() -> None:
    cfg = SimConfig(memory_bytes=1 << 30, max_model_len=64, use_arrivals=False)
    req = WorkloadRequest("r", 0.0, tuple(range(1, 64)), (7, 8, 9))  # 63 tokens: one more
    res = _simulate_pd(Workload("one", (req,)), cfg, cfg, lambda sched, out: None)
    assert (res.finished, res.decode_steps, res.transferred_bytes) == (1, 0, 0)
    assert res.tpot_s == [] and len(res.ttft_s) == 1


# -- 7: configuration fields are type-checked ----------------------------------------------


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("token_budget", True, "token_budget: must be an int >= 1, got True (bool)"),
        ("token_budget", 0, "token_budget: must be an int >= 1, got 0 (int)"),
        ("max_num_seqs", 2.0, "max_num_seqs: must be an int >= 1, got 2.0 (float)"),
        ("max_prefill_chunk", 2.5, "max_prefill_chunk: must be an int >= 1 or None, got 2.5"),
        ("max_prefill_chunk", "8", "max_prefill_chunk: must be an int >= 1 or None, got '8'"),
        ("num_lookahead_tokens", 1.5, "num_lookahead_tokens: must be an int >= 0, got 1.5"),
        ("num_lookahead_tokens", -1, "num_lookahead_tokens: must be an int >= 0, got -1"),
        ("whole_prefill", "no", "whole_prefill: must be a bool, got 'no' (str)"),
        ("compaction", "off", "compaction: must be a bool, got 'off' (str)"),
        ("collect_block_ids", 1, "collect_block_ids: must be a bool, got 1 (int)"),
        ("split_for_state", "yes", "split_for_state: must be a bool or None (automatic)"),
        ("checkpoint_before_end", "false", "checkpoint_before_end: must be a bool or None"),
        ("admission", ["reserve"], "admission: unknown policy ['reserve'] (list); valid"),
    ],
)
def test_config_fields_are_checked(field: str, value: Any, message: str) -> None:
    with pytest.raises(SchedulerError) as info:
        SchedulerConfig(**{field: value})
    assert str(info.value).startswith(f"SchedulerConfig.{message}")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_model_len": 10.5}, "Scheduler.max_model_len: must be an int >= 1, got 10.5"),
        ({"max_model_len": "64"}, "Scheduler.max_model_len: must be an int >= 1, got '64'"),
        ({"max_model_len": True}, "Scheduler.max_model_len: must be an int >= 1, got True"),
        ({"max_model_len": 0}, "Scheduler.max_model_len: must be an int >= 1, got 0"),
        (
            {"max_model_len": 64},
            "Scheduler.max_model_len: 64 exceeds the cache manager's max_model_len 16",
        ),
        ({"max_model_len": 8, "config": {}}, "Scheduler.config: must be a SchedulerConfig"),
        ({"max_model_len": 8, "hit_check": 3}, "Scheduler.hit_check: must be callable or None"),
    ],
)
def test_scheduler_arguments_are_checked(kwargs: dict[str, Any], message: str) -> None:
    mgr = KVCacheManager(_layout([(FULL, 4)], 32), max_model_len=16)
    with pytest.raises(SchedulerError) as info:
        Scheduler(mgr, **kwargs)
    assert str(info.value).startswith(message)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 1.0}, "request 'a': max_tokens must be >= 1, got 1.0 (float)"),
        ({"max_tokens": True}, "request 'a': max_tokens must be >= 1, got True (bool)"),
        ({"eos_token_ids": "2"}, "request 'a': eos_token_ids: must be a sequence of token ids"),
        ({"eos_token_ids": [None]}, "request 'a': eos_token_ids: a token id must be an int"),
        ({"hold": 1}, "request 'a': hold must be a bool, got 1 (int)"),
        ({"arrival": "0"}, "request 'a': arrival must be a number, got '0' (str)"),
    ],
)
def test_add_request_arguments_are_checked(kwargs: dict[str, Any], message: str) -> None:
    sched = _sched()
    with pytest.raises(SchedulerError) as info:
        sched.add_request("a", [1, 2, 3], **{"max_tokens": 2, **kwargs})
    assert str(info.value).startswith(message)
    assert not sched.seqs and not sched.waiting
    with pytest.raises(SchedulerError, match="request_id must be a non-empty str, got"):
        sched.add_request(["a"], [1], max_tokens=1)  # type: ignore[arg-type]


# -- 8: aborting a request ---------------------------------------------------------------


def test_abort_frees_a_request_wherever_it_is() -> None:
    # 8 usable blocks: held keeps 1, run and pre take 3 each; pre is preempted at 12 tokens
    sched = _sched(9, token_budget=32)
    sched.add_request("held", [4, 5, 6], max_tokens=1, hold=True)
    sched.add_request("run", list(range(100, 110)), max_tokens=8)
    sched.add_request("pre", list(range(200, 210)), max_tokens=8)
    for _ in range(4):
        _step(sched)
    sched.add_request("new", [1, 2, 3], max_tokens=2)  # waits behind pre
    assert [q.request_id for q in sched.waiting] == ["pre", "new"]
    assert [q.request_id for q in sched.running] == ["run"] and list(sched.held) == ["held"]
    assert sched.seqs["pre"].num_preemptions == 1
    seqs = {rid: sched.seqs[rid] for rid in ("run", "pre", "new")}
    for rid in ("pre", "new", "held", "run"):
        sched.abort_request(rid)
        sched.manager.check_invariants()
        with pytest.raises(UnknownRequestError):
            sched.manager.get_block_ids(rid)
    assert not sched.seqs and not sched.waiting and not sched.running and not sched.held
    assert all(seq.finish_reason is FinishReason.ABORT for seq in seqs.values())
    assert sched.manager.num_free_blocks == (8,)
    with pytest.raises(SchedulerError, match="abort_request: no waiting, running or held"):
        sched.abort_request("run")
    sched.add_request("run", [1, 2], max_tokens=1)  # the id is free again
    assert _step(sched) == ([("run", 0, 2)], [])


def test_an_abort_between_schedule_and_update_is_skipped() -> None:
    sched = _sched()
    sched.add_request("a", [1, 2, 3], max_tokens=2)
    sched.add_request("b", [4, 5, 6], max_tokens=2)
    out = sched.schedule()
    sched.abort_request("a")
    results = sched.update(out, {"b": 8})  # a's token is not needed any more
    assert [(r.request_id, r.new_token_ids) for r in results] == [("b", (8,))]
    assert _step(sched) == ([("b", 3, 1)], [])
    sched.manager.check_invariants()


def test_engine_abort_completes_the_request_as_aborted() -> None:
    from hybridkv.engine import CacheConfig, LLMEngine

    engine = LLMEngine("llama", cache=CacheConfig(block_size=4, max_model_len=64))
    engine.add_request("a", [1, 2, 3], max_tokens=10)
    engine.add_request("b", [4, 5, 6], max_tokens=3)
    engine.add_request("w", [7, 8], max_tokens=3)
    engine.step()
    engine.step()
    engine.abort_request("a")
    done = engine.completions["a"]
    assert done.finish_reason is FinishReason.ABORT and len(done.token_ids) == 2
    engine.run()
    assert sorted(engine.completions) == ["a", "b", "w"]
    assert engine.completions["b"].finish_reason is FinishReason.LENGTH
    assert not engine._live
    with pytest.raises(SchedulerError, match="no waiting, running or held request has id 'a'"):
        engine.abort_request("a")
    engine.check_invariants()


def test_an_admission_that_raises_takes_back_the_step_s_earlier_admissions() -> None:
    """Suspected by the review, confirmed here: when ``hit_check`` raised for a later waiting
    request, the requests admitted earlier in that schedule() stayed running, their
    allocation (and the checkpoint restore it carries) lost with the output; the next step
    computed them on a running state nobody restored. Now they go back to the queue, as they
    were, and the next schedule() admits them again with the restore."""
    from test_scheduler import STATE

    mgr = KVCacheManager(_layout([(STATE, 4), (FULL, 4)], 32), max_model_len=64)
    failing = {"c"}

    def check(req: Any, hit: Any) -> Any:
        if req.request_id in failing:
            raise RuntimeError("disk tier: read failed")
        return hit

    sched = Scheduler(mgr, SchedulerConfig(), max_model_len=64, hit_check=check)
    sched.add_request("a", list(range(1, 13)), max_tokens=1)
    while sched.has_unfinished():
        _step(sched)
    sched.add_request("b", [*range(1, 9), 50, 51, 52], max_tokens=1)
    sched.add_request("c", [*range(1, 9), 60, 61, 62], max_tokens=1)
    with pytest.raises(RuntimeError, match="read failed"):
        sched.schedule()
    assert [q.request_id for q in sched.waiting] == ["b", "c"] and not sched.running
    assert not mgr.has_blocks("b") and sched.seqs["b"].request.num_computed_tokens == 0
    mgr.check_invariants()
    failing.clear()
    out = sched.schedule()
    b = next(s for s in out.scheduled if s.request_id == "b")
    assert (b.start, b.num_cached_tokens) == (8, 8)
    assert b.allocation.copies_before  # the checkpoint at 8 is restored before the step
