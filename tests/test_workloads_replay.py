"""Fixed-capacity replays of a workload's prefix hits: LRU, 2Q and Belady's rule."""

from __future__ import annotations

from typing import NamedTuple

import pytest
from hypothesis import given
from hypothesis import strategies as hst

from hybridkv.workloads import (
    ConversationConfig,
    WorkloadError,
    arrival_order,
    conversation_workload,
    ideal_hit_tokens,
    replay_hit_tokens,
)


class _R(NamedTuple):
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...] = ()


def test_lru_forgets_what_belady_keeps() -> None:
    # block size 1: r0 caches [1], [1 2]; r1 caches [3], [3 4]; r2 wants [1 2] again.
    reqs = [_R((1, 2, 9)), _R((3, 4, 9)), _R((1, 2, 8))]
    # two blocks: LRU evicts r0's blocks for r1's, Belady evicts r1's (never used again)
    assert replay_hit_tokens(reqs, 1, [2, 3, 4], "lru") == [0, 0, 2]
    assert replay_hit_tokens(reqs, 1, [2, 3, 4], "belady") == [2, 2, 2]
    assert ideal_hit_tokens(reqs, 1) == 2


def test_two_q_keeps_a_prefix_that_came_back() -> None:
    """A prefix used, evicted by two others, then used again (its keys back from the ghost
    list) joins 2Q's main LRU and survives three more: its third use hits where LRU's
    misses."""
    a = _R((1, 2, 9))
    noise = [_R((10 + i, 20 + i, 9)) for i in range(5)]
    reqs = [a, noise[0], noise[1], a, noise[2], noise[3], noise[4], a]
    assert replay_hit_tokens(reqs, 1, [4, 6, 8], "lru") == [0, 2, 4]
    assert replay_hit_tokens(reqs, 1, [4, 6, 8], "2q") == [2, 4, 4]
    assert replay_hit_tokens(reqs, 1, [4, 6, 8], "belady") == [4, 4, 4]


def test_the_replay_runs_the_pools_2q_parameters() -> None:
    from hybridkv.cache import pool_base
    from hybridkv.workloads import ideal

    assert ideal._PROBATION_SHARE == pool_base.PROBATION_SHARE
    assert ideal._GHOST_PER_BLOCK == pool_base.GHOST_PER_BLOCK


def test_hits_stop_at_the_first_missing_block_and_keep_the_last_prompt_token() -> None:
    # block size 2: r0 caches [5 6] [7 8] (its output token 0 is never fed back)
    reqs = [_R((5, 6, 7, 8), (0,)), _R((5, 6, 7, 8, 1)), _R((5, 6, 7, 8))]
    # r1 hits both blocks (4 of 5 tokens); r2 (4 tokens) at most (4 - 1) // 2 = 1 block
    assert replay_hit_tokens(reqs, 2, [10], "lru") == [4 + 2]
    # one block: the cache keeps [5 6 7 8] but not [5 6] before it, so nothing hits
    assert replay_hit_tokens(reqs, 2, [1, 2], "lru") == [0, 6]


def test_bad_arguments_name_the_field() -> None:
    with pytest.raises(WorkloadError, match="block_size must be >= 1, got 0"):
        replay_hit_tokens([], 0, [1])
    with pytest.raises(WorkloadError, match="policy 'fifo' is unknown; valid: lru, belady, 2q"):
        replay_hit_tokens([], 4, [1], "fifo")
    with pytest.raises(WorkloadError, match="capacities must be >= 1 blocks, got 0"):
        replay_hit_tokens([], 4, [0])


def test_conversations_unbounded_replay_is_the_ideal() -> None:
    reqs = arrival_order(conversation_workload(ConversationConfig(num_requests=40, seed=2)))
    ideal = ideal_hit_tokens(reqs, 16)
    assert ideal > 0
    lru = replay_hit_tokens(reqs, 16, [8, 64, 10**6], "lru")
    belady = replay_hit_tokens(reqs, 16, [8, 64, 10**6], "belady")
    assert lru[-1] == belady[-1] == ideal
    assert lru == sorted(lru)


@given(
    prompts=hst.lists(
        hst.lists(hst.integers(0, 3), min_size=1, max_size=12), min_size=1, max_size=12
    ),
    block=hst.sampled_from([1, 2, 3]),
)
def test_lru_hits_grow_with_capacity_up_to_the_ideal(prompts: list[list[int]], block: int) -> None:
    reqs = [_R(tuple(p)) for p in prompts]
    caps = [1, 2, 3, 5, 8, 200]
    lru = replay_hit_tokens(reqs, block, caps, "lru")
    assert lru == sorted(lru)  # LRU's inclusion property: a larger cache holds a smaller one
    ideal = ideal_hit_tokens(reqs, block)
    assert lru[-1] == ideal
    assert replay_hit_tokens(reqs, block, [200], "belady") == [ideal]
