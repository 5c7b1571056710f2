"""State checkpoint admission by measured yield (hybridkv.cache.admission)."""

from __future__ import annotations

import pytest

from hybridkv.cache import KVCacheManager, Request
from hybridkv.cache.admission import (
    BEFORE_END,
    CHUNK,
    DECODE,
    JUNCTION,
    PROMPT_END,
    CheckpointAdmission,
)
from hybridkv.cache.types import StateCopy
from hybridkv.errors import PlanError
from test_cache_factories import full, groups, pools, state, step, tokens, uniform


def test_every_reason_is_admitted_until_it_has_checkpoints_on_record() -> None:
    adm = CheckpointAdmission(10_000)
    adm.published(1_000)
    adm.hit(50)
    for reason in (JUNCTION, PROMPT_END, CHUNK, DECODE, BEFORE_END):
        assert adm.admits(reason, 17)


def test_a_reason_below_the_average_yield_is_rejected_except_explored_hashes() -> None:
    adm = CheckpointAdmission(10_000, min_checkpoints=2, explore=16)
    adm.warm = True  # as after the first turnover
    for _ in range(2):  # two decode checkpoints of 100 bytes, never hit
        adm.published(100)
        adm.checkpoint_published(DECODE, 100)
    for _ in range(2):  # two prompt-end checkpoints of 100 bytes, hit for 30 tokens
        adm.published(100)
        adm.checkpoint_published(PROMPT_END, 100)
    adm.published(600)  # attention blocks: 1000 bytes in all
    adm.hit(30)
    adm.checkpoint_hit(PROMPT_END, 30)
    # average 30 / 1000; prompt end 30 / 200: admitted; decode 0 / 200: rejected
    assert adm.admits(PROMPT_END, 17)
    assert not adm.admits(DECODE, 17)
    assert adm.admits(DECODE, 32)  # a multiple of explore keeps the yield measured
    assert adm.admits(CHUNK, 17)  # nothing on record yet
    report = adm.report()
    assert report["decode"] == {
        "checkpoints": 2.0,
        "bytes": 200.0,
        "hit_tokens": 0.0,
        "relative_yield": 0.0,
        "admitted": False,
    }
    assert report["prompt_end"]["relative_yield"] == pytest.approx(5.0)
    assert report["prompt_end"]["admitted"] is True


def test_a_yield_equal_to_the_average_is_admitted() -> None:
    adm = CheckpointAdmission(10_000, min_checkpoints=1)
    adm.warm = True
    adm.published(100)
    adm.checkpoint_published(CHUNK, 100)
    adm.hit(10)
    adm.checkpoint_hit(CHUNK, 10)
    assert adm.admits(CHUNK, 1)


def test_nothing_is_judged_before_the_first_turnover_then_counters_halve_each_one() -> None:
    adm = CheckpointAdmission(1_000, min_checkpoints=1, explore=1 << 60)
    for _ in range(2):
        adm.published(200)
        adm.checkpoint_published(DECODE, 200)
    adm.hit(8)
    adm.published(599)
    assert adm.total_bytes == 999 and adm.checkpoints[DECODE] == 2
    assert adm.admits(DECODE, 3)  # no hit could have come back yet: not judged
    assert adm.report()["decode"]["admitted"] is True
    adm.published(1)  # 1000 bytes since the start: every counter halves once
    assert adm.warm and adm.since_decay == 0
    assert adm.total_bytes == 500 and adm.total_hits == 4
    assert adm.checkpoints[DECODE] == 1 and adm.checkpoint_bytes[DECODE] == 200
    assert not adm.admits(DECODE, 3)  # 0 hit tokens per byte against 4 / 500
    assert adm.report()["decode"]["admitted"] is False
    adm.published(1_000)  # a second turnover: the ratio, and so the decision, stays
    assert adm.checkpoints[DECODE] == 0.5
    assert adm.admits(DECODE, 3)  # half a checkpoint on record: below min_checkpoints again


def test_an_unknown_policy_is_refused_with_the_valid_ones() -> None:
    with pytest.raises(PlanError, match=r"checkpoint_admission: unknown policy 'some'.*yield, all"):
        KVCacheManager(uniform(groups(full(), state()), 20), checkpoint_admission="some")


def test_layouts_without_state_groups_have_no_admission() -> None:
    mgr = KVCacheManager(uniform(groups(full()), 20))
    assert mgr.checkpoint_admission_report() is None
    mgr = KVCacheManager(uniform(groups(full(), state()), 20), checkpoint_admission="all")
    assert mgr.checkpoint_admission_report() is None


def _manager(policy: str) -> KVCacheManager:
    # dead tails kept: a freed request's blocks past its last checkpoint mark the junction a
    # later request branches at (test_cache_dead_tails.py shows what dropping them costs)
    mgr = KVCacheManager(
        uniform(groups(full(), state()), 60),
        hasher="builtin",
        checkpoint_admission=policy,
        dead_tails="keep",
    )
    adm = mgr._coord.admission
    if adm is not None:  # decide at once, never explore
        adm.min_checkpoints, adm.explore, adm.warm = 1, 1 << 60, True
    return mgr


def _prefill(mgr: KVCacheManager, req: Request, chunks: list[int]) -> list[tuple[StateCopy, ...]]:
    """Admit ``req`` and prefill it in ``chunks``; the copies_after of each step."""
    hit = mgr.get_computed_blocks(req)
    out = []
    for i, n in enumerate(chunks):
        if i == 0:
            res = mgr.allocate_slots(
                req, n, num_new_computed_tokens=hit.num_computed_tokens, new_computed_blocks=hit
            )
            req.num_computed_tokens += hit.num_computed_tokens
        else:
            res = mgr.allocate_slots(req, n)
        assert res is not None
        out.append(res.copies_after)
        step(req, n)
    return out


def _decode(mgr: KVCacheManager, req: Request, outputs: list[int]) -> list[tuple[StateCopy, ...]]:
    out = []
    for t in outputs:
        req.append_token_ids([t])
        res = mgr.allocate_slots(req, 1)
        assert res is not None
        out.append(res.copies_after)
        step(req, 1)
    return out


@pytest.mark.parametrize("policy", ["yield", "all"])
def test_decode_checkpoints_stop_once_they_return_less_than_the_average(policy: str) -> None:
    mgr = _manager(policy)  # alignment 4: checkpoints at multiples of 4 tokens
    # A: 10-token prompt prefilled as 8 + 2 (8 is its prompt end), decoded to 12 (a decode
    # checkpoint at 12); both published at the free.
    a = mgr.make_request("a", tokens(10))
    assert [len(c) for c in _prefill(mgr, a, [8, 2])] == [1, 0]
    assert [len(c) for c in _decode(mgr, a, [90, 91])] == [0, 1]
    mgr.free("a")
    # B shares A's first 8 tokens: a hit of 8 on A's prompt-end checkpoint.
    b = mgr.make_request("b", [*tokens(8), 70, 71, 72])
    assert mgr.get_computed_blocks(b).num_computed_tokens == 8
    _prefill(mgr, b, [3])
    mgr.free("b")
    # C: a fresh 14-token prompt, 8 (a chunk end) + 4 (its prompt end, 12) + 2, decoded to 16.
    c = mgr.make_request("c", tokens(14, start=200))
    assert [len(x) for x in _prefill(mgr, c, [8, 4, 2])] == [1, 1, 0]
    decode = _decode(mgr, c, [93, 94])
    if policy == "all":
        assert [len(x) for x in decode] == [0, 1]
        return
    assert decode == [(), ()]  # decode: 1 checkpoint, 0 hit tokens, below the average
    report = mgr.checkpoint_admission_report()
    assert report is not None
    assert report["decode"]["checkpoints"] == 1 and report["decode"]["admitted"] is False
    assert report["prompt_end"]["hit_tokens"] == 8 and report["prompt_end"]["admitted"] is True
    assert report["junction"]["checkpoints"] == 0
    mgr.free("c")
    mgr._coord.check_invariants()


def test_reasons_of_aligned_step_ends() -> None:
    mgr = _manager("yield")
    sm = mgr._coord.managers[1]
    req = mgr.make_request("r", tokens(14))
    reason = sm.reason  # type: ignore[attr-defined]
    assert reason(req, 8, (4, 9)) == JUNCTION  # the junction 9, aligned down
    assert reason(req, 4, (4,)) == JUNCTION
    assert reason(req, 12, ()) == PROMPT_END  # (14 - 1) // 4 * 4
    assert reason(req, 8, ()) == BEFORE_END  # the aligned boundary before it
    assert reason(req, 4, ()) == CHUNK
    req.append_token_ids([1, 2])
    assert reason(req, 16, ()) == DECODE


@pytest.mark.parametrize("policy", ["yield", "all"])
def test_a_checkpoint_that_does_not_fit_its_own_pool_is_dropped_not_the_step(policy: str) -> None:
    # State pool: 2 usable slots, both held as running slots by two requests.
    mgr = KVCacheManager(
        pools(groups(full(), state()), [40, 3]), hasher="builtin", checkpoint_admission=policy
    )
    reqs = [mgr.make_request(r, tokens(10, start=100 * i)) for i, r in enumerate("ab")]
    for req in reqs:
        assert [len(c) for c in _prefill(mgr, req, [3])] == [0]
    assert mgr.num_free_blocks[1] == 0
    for req in reqs:  # each step ends at 4, an aligned boundary: a checkpoint is due
        res = mgr.allocate_slots(req, 1)
        assert res is not None and res.copies_after == ()
        step(req, 1)
    mgr._coord.check_invariants()
    mgr.free("a")  # a slot comes back: the next due checkpoint (at 8) is saved
    res = mgr.allocate_slots(reqs[1], 4)
    assert res is not None and len(res.copies_after) == 1


def test_in_a_shared_pool_a_checkpoint_that_does_not_fit_refuses_the_step() -> None:
    mgr = KVCacheManager(uniform(groups(full(), state()), 7), hasher="builtin")
    req = mgr.make_request("a", tokens(16))
    _prefill(mgr, req, [3])  # 1 attention block + the running slot
    other = mgr.make_request("b", tokens(16, start=50))
    _prefill(mgr, other, [11])  # 3 blocks + a running slot: the pool's 6 usable are held
    assert mgr.num_free_blocks[0] == 0
    assert mgr.allocate_slots(req, 1) is None  # ends at 4: block free, checkpoint does not fit


def test_a_junction_checkpoint_is_tagged_and_credited_with_the_hits_it_serves() -> None:
    mgr = _manager("yield")
    # A: 14 tokens in one step (ends at 14, unaligned: no checkpoint), then freed.
    a = mgr.make_request("a", tokens(14))
    assert _prefill(mgr, a, [14]) == [()]
    mgr.free("a")
    # B shares A's first 8 tokens: attention caches them, no state does: junction 8.
    b = mgr.make_request("b", [*tokens(8), 50, 51, 52, 53, 54])
    hit = mgr.get_computed_blocks(b)
    assert (hit.num_computed_tokens, hit.junction_tokens) == (0, 8)
    res = mgr.allocate_slots(b, 8, new_computed_blocks=hit)  # the scheduler stops there
    assert res is not None and len(res.copies_after) == 1
    step(b, 8)
    assert mgr.allocate_slots(b, 5) is not None  # publishes the junction checkpoint
    step(b, 5)
    mgr.free("b")
    # C shares the same 8 tokens: hits B's junction checkpoint.
    c = mgr.make_request("c", [*tokens(8), 60, 61])
    assert mgr.get_computed_blocks(c).num_computed_tokens == 8
    _prefill(mgr, c, [2])
    report = mgr.checkpoint_admission_report()
    assert report is not None
    assert report["junction"]["checkpoints"] == 1 and report["junction"]["hit_tokens"] == 8
    assert report["prompt_end"]["checkpoints"] == 0 and report["chunk"]["checkpoints"] == 0
