"""The workload of ``hybridkv run``: shared-prefix prompts admitted in waves."""

from __future__ import annotations

import pytest

from hybridkv.engine import CacheConfig, LLMEngine, PromptError
from hybridkv.engine.demo import run_in_waves, shared_prefix_prompts

pytestmark = pytest.mark.usefixtures("one_thread")


def test_shared_prefix_prompts() -> None:
    prompts = shared_prefix_prompts(6, vocab_size=50, shared_prefix=8, seed=3)
    assert [len(p) for p in prompts] == [12, 15, 18, 21, 12, 15]
    assert all(p[:8] == prompts[0][:8] for p in prompts)
    assert len({tuple(p[8:]) for p in prompts}) == 6
    assert all(0 <= t < 50 for p in prompts for t in p)
    assert prompts == shared_prefix_prompts(6, vocab_size=50, shared_prefix=8, seed=3)
    with pytest.raises(PromptError, match="num_requests must be >= 1"):
        shared_prefix_prompts(0, vocab_size=50)


def test_waves_admit_after_the_first_tokens_and_hit_the_cache() -> None:
    engine = LLMEngine("lfm3", cache=CacheConfig(block_size=4, state_block_size=8))
    prompts = shared_prefix_prompts(5, vocab_size=engine.vocab_size, shared_prefix=16)
    seen: list[tuple[int, int]] = []
    done = run_in_waves(
        engine, prompts, max_tokens=3, waves=2, progress=lambda d, t: seen.append((d, t))
    )
    assert [c.request_id for c in done] == ["r0", "r1", "r2", "r3", "r4"]
    # waves of 3 and 2: the second finds the 16 shared tokens cached in every group
    assert [c.num_cached_tokens for c in done] == [0, 0, 0, 16, 16]
    assert seen[-1] == (15, 15) and all(t == 15 for _, t in seen)
    assert engine.stats().max_batch_requests == 5  # wave 2 prefills while wave 1 decodes


@pytest.mark.parametrize(
    ("n", "waves", "sizes"),
    [(8, 5, [2, 2, 1, 2, 1]), (8, 7, [2, 1, 1, 1, 1, 1, 1]), (5, 4, [2, 1, 1, 1]), (3, 9, [1] * 3)],
)
def test_as_many_waves_as_asked(n: int, waves: int, sizes: list[int]) -> None:
    """Exactly ``waves`` waves (at most one per prompt): 8 prompts in 5 waves ran in 4 before
    (found by review)."""
    engine = LLMEngine("llama", cache=CacheConfig(block_size=4))
    prompts = shared_prefix_prompts(n, vocab_size=engine.vocab_size, shared_prefix=4)
    added: list[int] = []
    add = engine.add_request

    def counting(*args: object, **kwargs: object) -> None:
        added.append(engine.stats().steps)
        add(*args, **kwargs)  # type: ignore[arg-type]

    engine.add_request = counting  # type: ignore[method-assign]
    run_in_waves(engine, prompts, max_tokens=2, waves=waves)
    assert [added.count(step) for step in sorted(set(added))] == sizes


def test_bad_prompts_are_refused_before_anything_runs() -> None:
    engine = LLMEngine("llama", cache=CacheConfig(block_size=4, max_model_len=16))
    with pytest.raises(PromptError, match="'r1': the prompt has 16 tokens"):
        run_in_waves(engine, [[1, 2], list(range(16))], max_tokens=2)
    assert not engine.has_unfinished() and engine.stats().steps == 0
    with pytest.raises(PromptError, match="waves and max_tokens must be >= 1"):
        run_in_waves(engine, [[1]], max_tokens=2, waves=0)


def test_progress_counts_what_max_model_len_lets_each_request_make() -> None:
    """--max-tokens above what max_model_len leaves: the bar's total is what the requests can
    make, and it ends full (found by a review: 0/200000 for a run of a few hundred tokens)."""
    engine = LLMEngine("llama", cache=CacheConfig(block_size=4, max_model_len=16))
    seen: list[tuple[int, int]] = []
    done = run_in_waves(
        engine, [[1, 2, 3], [4] * 10], max_tokens=100, progress=lambda d, t: seen.append((d, t))
    )
    assert [c.finish_reason.value for c in done] == ["max_model_len", "max_model_len"]
    assert [len(c.token_ids) for c in done] == [13, 6]
    assert seen[-1] == (19, 19) and all(t == 19 for _, t in seen)
