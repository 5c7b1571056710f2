"""Speculative decoding: drafts verified in one pass, recurrent states rolled back, exact.

The engine tests use an oracle proposer that knows plain greedy decoding's output and drafts
it, corrupting one draft of every third proposal (a forced rejection at a varying position),
so steps accept all, some or none of their drafts.  Outputs must equal plain greedy decoding
(and transformers' own ``generate``), and the prefix cache after speculation must serve the
same hits as after plain decoding.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.cache import AllocationResult, KVCacheManager
from hybridkv.engine import CacheConfig, LLMEngine, verify_completions
from hybridkv.engine.errors import BatchError, SpeculativeConfigError
from hybridkv.engine.models import load_model
from hybridkv.engine.speculative import NgramProposer, SpeculativeConfig, accept_greedy
from hybridkv.scheduler import FinishReason, Scheduler, SchedulerConfig, SchedulerError
from hybridkv.specs import CacheSpec
from test_scheduler import FULL, STATE, _layout

CACHE = CacheConfig(block_size=4, state_block_size=8)
PROMPTS = {"a": [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4, 5, 6, 7] * 2, "b": [9, 8, 7, 6, 5] * 2}
MAX_TOKENS = 24
STATE_MODELS = ["qwen3_next", "lfm2", "granitemoehybrid", "falcon_h1", "zamba2"]
ATTENTION_MODELS = ["gpt_oss", "llama", "deepseek_v3"]


pytestmark = pytest.mark.usefixtures("one_thread")


class Oracle:
    """Drafts the reference continuation; every third proposal has one wrong draft."""

    def __init__(self, refs: dict[str, list[int]], vocab_size: int) -> None:
        self.refs = {tuple(r[:8]): r for r in refs.values()}
        self.vocab_size = vocab_size
        self.calls = 0

    def propose(self, request_id: str, token_ids: Sequence[int], num_tokens: int) -> list[int]:
        ref = self.refs[tuple(token_ids[:8])]
        assert list(token_ids) == ref[: len(token_ids)], "the engine appended a wrong token"
        draft = list(ref[len(token_ids) : len(token_ids) + num_tokens])
        self.calls += 1
        if draft and self.calls % 3 == 1:
            j = self.calls % len(draft)
            draft[j] = (draft[j] + 1) % self.vocab_size
        return draft


@functools.cache
def _plain(name: str) -> tuple[dict[str, list[int]], list[int]]:
    """Plain greedy outputs (prompt + output per request) and the follow-ups' hits."""
    engine = LLMEngine(name, cache=CACHE)
    done = engine.generate(PROMPTS, max_tokens=MAX_TOKENS)
    refs = {c.request_id: [*c.prompt_token_ids, *c.token_ids] for c in done}
    return refs, _follow_up_hits(engine, refs)


def _follow_up_hits(engine: LLMEngine, refs: dict[str, list[int]]) -> list[int]:
    """Hits of the next turn of each conversation (its whole history plus new tokens)."""
    follow = {"a2": [*refs["a"], 3, 4], "b2": [*refs["b"], 5]}
    return [c.num_cached_tokens for c in engine.generate(follow, max_tokens=2)]


def _speculative(name: str, k: int = 4, **kw: Any) -> tuple[LLMEngine, Oracle]:
    refs, _ = _plain(name)
    probe = LLMEngine(name, cache=CACHE)
    oracle = Oracle(refs, probe.vocab_size)
    engine = LLMEngine(name, cache=CACHE, speculative=SpeculativeConfig(oracle, k), **kw)
    return engine, oracle


@pytest.mark.parametrize("name", STATE_MODELS + ATTENTION_MODELS)
def test_speculation_with_forced_rejections_equals_greedy(name: str) -> None:
    refs, plain_hits = _plain(name)
    engine, _ = _speculative(name)
    done = engine.generate(PROMPTS, max_tokens=MAX_TOKENS)
    for c in done:
        assert [*c.prompt_token_ids, *c.token_ids] == refs[c.request_id]
    stats = engine.stats()
    assert stats.generated_tokens == 2 * MAX_TOKENS
    assert 0 < stats.accepted_draft_tokens < stats.draft_tokens  # accepted and rejected
    if name in STATE_MODELS:
        # Drafts stop before each 8-token checkpoint boundary; one in three proposals has a
        # rejected draft, and each rejection rolls the state back with one pass.
        # (The prefill also stops one alignment unit before the prompt's last aligned
        # boundary: one more step than without that split, and 34 drafts instead of 31.)
        assert (stats.draft_tokens, stats.accepted_draft_tokens) == (34, 25)
        assert stats.rollback_passes == 4
        assert stats.steps == 14
    else:
        assert (stats.draft_tokens, stats.accepted_draft_tokens) == (44, 34)
        assert stats.rollback_passes == 0  # K/V past the accepted tokens is never read
        assert stats.steps == 7
    # The next turn hits exactly what it hits after plain decoding: state checkpoints at the
    # same boundaries, no block published with a rejected draft.
    hits = _follow_up_hits(engine, refs)
    assert hits == plain_hits
    assert hits == ([48, 32] if name in STATE_MODELS else [52, 32])
    engine.manager.check_invariants()


@pytest.mark.parametrize("name", ["qwen3_next", "lfm2", "gpt_oss"])
@pytest.mark.parametrize("k", [2, 3])
def test_speculation_matches_transformers(name: str, k: int) -> None:
    engine, _ = _speculative(name, k, keep_logits=True)
    done = engine.generate(PROMPTS, max_tokens=MAX_TOKENS)
    result = verify_completions(load_model(name), done)
    assert result.ok, result.mismatches
    assert result.max_logit_diff is not None and result.max_logit_diff < 1e-3
    assert all(len(c.logits) == len(c.token_ids) for c in done)
    assert engine.stats().rollback_passes > 0 or name == "gpt_oss"


def test_speculation_under_preemption_is_exact() -> None:
    refs, _ = _plain("qwen3_next")
    oracle = Oracle(refs, LLMEngine("qwen3_next", cache=CACHE).vocab_size)
    small = CacheConfig(
        block_size=4, state_block_size=8, strategy="pools", num_blocks=16, max_model_len=64
    )
    engine = LLMEngine("qwen3_next", cache=small, speculative=SpeculativeConfig(oracle, 4))
    done = engine.generate(PROMPTS, max_tokens=MAX_TOKENS)
    assert engine.stats().preemptions > 0
    for c in done:
        assert [*c.prompt_token_ids, *c.token_ids] == refs[c.request_id]
    engine.manager.check_invariants()


def test_eos_inside_accepted_drafts_ends_the_request() -> None:
    refs, _ = _plain("lfm2")
    out = refs["a"][len(PROMPTS["a"]) :]
    eos = out[10]
    first = out.index(eos)  # the first time the EOS token appears
    engine, _ = _speculative("lfm2")
    [done] = engine.generate({"a": PROMPTS["a"]}, max_tokens=MAX_TOKENS, eos_token_ids=[eos])
    assert done.token_ids == tuple(out[: first + 1])
    assert done.finish_reason is FinishReason.STOP
    engine.manager.check_invariants()


def test_jamba_refuses_speculation() -> None:
    with pytest.raises(SpeculativeConfigError, match="Mamba1"):
        LLMEngine("jamba", cache=CACHE, speculative=SpeculativeConfig(NgramProposer(), 2))


def test_a_draft_outside_the_vocabulary_is_refused() -> None:
    class Bad:
        def propose(self, request_id: str, token_ids: Sequence[int], n: int) -> list[int]:
            return [10**9]

    engine = LLMEngine("llama", cache=CACHE, speculative=SpeculativeConfig(Bad(), 2))
    engine.add_request("r", [1, 2, 3], max_tokens=4)
    engine.step()  # prefill: nothing to draft yet
    with pytest.raises(SpeculativeConfigError, match="outside the vocabulary"):
        engine.step()


# ----------------------------------------------------------------------- pieces


def test_accept_greedy() -> None:
    assert accept_greedy((4, 9, 2), (4, 9, 7, 1)) == (4, 9, 7)
    assert accept_greedy((4, 9, 2), (4, 9, 2, 1)) == (4, 9, 2, 1)
    assert accept_greedy((4, 9, 2), (5, 9, 2, 1)) == (5,)
    assert accept_greedy((), (3,)) == (3,)
    with pytest.raises(Exception, match="2 greedy tokens for 3 drafts"):
        accept_greedy((1, 2, 3), (1, 2))


def test_ngram_proposer() -> None:
    p = NgramProposer(max_n=2)
    assert p.propose("r", [5, 6, 7, 8, 5, 6], 3) == (7, 8, 5)
    assert p.propose("r", [5, 6, 7, 8, 5, 6], 1) == (7,)
    # The latest earlier occurrence of the longest matching suffix wins.
    assert p.propose("r", [1, 9, 2, 1, 9, 3, 1, 9], 2) == (3, 1)
    assert p.propose("r", [1, 2, 3, 4], 2) == ()
    assert p.propose("r", [7], 2) == ()
    assert NgramProposer(max_n=3, min_n=3).propose("r", [1, 2, 1, 2], 2) == ()


@pytest.mark.parametrize(
    ("kw", "field"),
    [({"max_n": 0}, "max_n"), ({"min_n": True}, "min_n"), ({"max_n": 2, "min_n": 3}, "min_n")],
)
def test_ngram_proposer_validation(kw: dict[str, Any], field: str) -> None:
    with pytest.raises(SpeculativeConfigError, match=f"NgramProposer.{field}"):
        NgramProposer(**kw)


@pytest.mark.parametrize("k", [0, 17, 2.0])
def test_speculative_config_validation(k: Any) -> None:
    with pytest.raises(SpeculativeConfigError, match="num_draft_tokens"):
        SpeculativeConfig(NgramProposer(), k)
    with pytest.raises(SpeculativeConfigError, match="proposer"):
        SpeculativeConfig(object(), 2)  # type: ignore[arg-type]


def test_rewind_errors_change_nothing() -> None:
    refs, _ = _plain("lfm2")
    engine, _ = _speculative("lfm2")
    with pytest.raises(BatchError, match="no speculative step"):
        engine.runner.rewind({"nobody": 1})
    real = engine.runner.rewind
    seen: list[dict[str, int]] = []

    def checked(kept: dict[str, int]) -> int:
        pending = dict(engine.runner._verified)
        assert set(pending) == set(kept)
        new = {rid: r.num_new for rid, (r, _) in pending.items()}
        for rid in kept:
            with pytest.raises(BatchError, match=rf"must be in \[1, {new[rid]}\], got 0"):
                real({**kept, rid: 0})
            with pytest.raises(BatchError, match="no speculative step"):
                real({**kept, "nobody": 1})
        assert engine.runner._verified == pending  # a refused rewind rewinds nothing
        seen.append(dict(kept))
        return real(kept)

    engine.runner.rewind = checked  # type: ignore[method-assign]
    done = engine.generate({"a": PROMPTS["a"]}, max_tokens=MAX_TOKENS)
    assert seen
    assert [*done[0].prompt_token_ids, *done[0].token_ids] == refs["a"]


# ----------------------------------------------------------------------- scheduler


def make_manager(*, state: bool, num_blocks: int = 32) -> KVCacheManager:
    """Full attention (4-token blocks), plus a Mamba2 state group (8-token blocks)."""
    specs: list[tuple[CacheSpec, int]] = [(FULL, 4), (STATE, 8)] if state else [(FULL, 4)]
    return KVCacheManager(_layout(specs, num_blocks))


def _scheduler(*, state: bool, budget: int = 64) -> Scheduler:
    return Scheduler(
        make_manager(state=state), SchedulerConfig(token_budget=budget), max_model_len=64
    )


def _decode(s: Scheduler, rid: str, prompt: list[int], max_tokens: int = 30) -> None:
    """Run ``rid``'s prefill (chunked at state boundaries) up to its first output token."""
    s.add_request(rid, prompt, max_tokens=max_tokens)
    while s.seqs[rid].num_output_tokens == 0:
        out = s.schedule()
        s.update(out, {i.request_id: 100 for i in out.scheduled if i.samples})


def test_draft_room() -> None:
    s = _scheduler(state=False)
    _decode(s, "r", list(range(10)), max_tokens=5)
    seq = s.seqs["r"]
    # 11 tokens, 10 computed, 1 output of 5: at most 3 drafts + the token after them.
    assert s.draft_room(seq) == 3
    st = _scheduler(state=True)
    _decode(st, "r", list(range(10)))
    # Alignment 8 (the state block): the step ends at 11, the next boundary is 16, so the
    # drafts may reach token 15 at most: 4 of them.
    assert st.alignment == 8
    assert st.draft_room(st.seqs["r"]) == 4


def test_update_with_drafts_advances_computed() -> None:
    s = _scheduler(state=False)
    _decode(s, "r", list(range(10)))
    out = s.schedule({"r": [7, 8, 9]})
    [item] = out.scheduled
    assert (item.start, item.num_new_tokens, item.draft_token_ids) == (10, 1, (7, 8, 9))
    assert len(s.manager.get_block_ids("r")[0]) * 4 >= 14  # lookahead slots allocated
    with pytest.raises(SchedulerError, match="expected the accepted drafts"):
        s.update(out, {"r": (7, 5, 1)})
    req = s.seqs["r"].request
    assert (req.num_tokens, req.num_computed_tokens) == (11, 10)  # unchanged
    [o] = s.update(out, {"r": (7, 8, 1)})
    assert o.new_token_ids == (7, 8, 1)
    assert (req.num_tokens, req.num_computed_tokens) == (14, 13)
    s.manager.check_invariants()


def test_drafts_are_dropped_before_anyone_is_preempted() -> None:
    mgr = make_manager(state=False, num_blocks=5)
    s = Scheduler(mgr, SchedulerConfig(token_budget=64), max_model_len=64)
    _decode(s, "r", list(range(11)))  # 12 tokens: 3 of the 4 blocks
    out = s.schedule({"r": [1, 2, 3, 4, 5, 6, 7, 8]})
    [item] = out.scheduled
    assert item.draft_token_ids == ()  # 8 lookahead slots would need 2 more blocks
    assert not out.preempted
    assert isinstance(item.allocation, AllocationResult)


@settings(max_examples=60, deadline=None)
@given(
    state=st.booleans(),
    seed=st.integers(0, 2**16),
    plan=st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6)), min_size=1, max_size=40),
)
def test_random_drafts_keep_the_manager_consistent(
    state: bool, seed: int, plan: list[tuple[int, int]]
) -> None:
    """Random draft lengths and acceptance, three requests sharing a prefix, a small cache
    (preemptions): invariants after every step, and every published block holds its own
    tokens' hash (check_invariants compares them with the requests' tokens)."""
    rng = random.Random(seed)
    s = Scheduler(
        make_manager(state=state, num_blocks=24), SchedulerConfig(token_budget=24), max_model_len=64
    )
    shared = [rng.randrange(50) for _ in range(9)]
    for n in range(3):
        s.add_request(f"r{n}", shared + [n] * (n + 1), max_tokens=rng.randrange(5, 30))
    for drafted, accepted in plan:
        if not s.has_unfinished():
            break
        drafts = {seq.request_id: [rng.randrange(50) for _ in range(drafted)] for seq in s.running}
        rooms = {seq.request_id: s.draft_room(seq) for seq in s.running}
        out = s.schedule(drafts)
        for item in out.scheduled:
            d = len(item.draft_token_ids)
            assert d <= rooms.get(item.request_id, 0)
            if d and state:  # never up to a checkpoint boundary (alignment 8)
                assert (item.start + 1) // 8 == (item.start + 1 + d) // 8
                assert (item.start + 1) % 8
        sampled: dict[str, int | tuple[int, ...]] = {}
        for item in out.scheduled:
            if item.samples:
                a = min(accepted, len(item.draft_token_ids))
                sampled[item.request_id] = (*item.draft_token_ids[:a], rng.randrange(50))
        s.update(out, sampled)
        s.manager.check_invariants()


def test_whole_prefill_the_caller_set_is_named_not_the_model() -> None:
    """lfm3 has no Mamba1 state; the refusal blamed one (found by review)."""
    with pytest.raises(SpeculativeConfigError, match=r"SchedulerConfig\(whole_prefill=True\)"):
        LLMEngine(
            "lfm3",
            scheduler=SchedulerConfig(whole_prefill=True),
            speculative=SpeculativeConfig(NgramProposer(), 2),
        )
