"""Typed errors for calls that do not match the request; every refused call changes nothing."""

from __future__ import annotations

import pytest

from hybridkv.cache import (
    ComputedBlocks,
    DuplicateRequestError,
    FinishedRequestError,
    KVCacheManager,
    LayoutMismatchError,
    Request,
    RequestLengthError,
    StaleComputedBlocksError,
    UnknownRequestError,
    compiled,
)
from hybridkv.errors import InvariantError, RequestError
from test_cache_factories import admit, full, groups, state, step, swa, tokens, uniform


def _mgr() -> KVCacheManager:
    return KVCacheManager(uniform(groups(full(), swa(8), (state(), 8)), 40))


def test_errors_name_the_offending_values_and_change_nothing() -> None:
    mgr = _mgr()
    r0 = mgr.make_request("r0", tokens(20))
    admit(mgr, r0, budget=16)
    step(r0, 16)
    before = mgr.snapshot()
    cases: list[tuple[type[Exception], str, object]] = [
        (RequestLengthError, "exceeds its 20 tokens", lambda: mgr.allocate_slots(r0, 5)),
        (
            RequestLengthError,
            "num_new_tokens: must be an integer >= 0, got -1",
            lambda: mgr.allocate_slots(r0, -1),
        ),
        (
            RequestLengthError,
            "only taken on a request's first allocation",
            lambda: mgr.allocate_slots(r0, 1, num_new_computed_tokens=8),
        ),
        (UnknownRequestError, "'nope'", lambda: mgr.free("nope")),
        (UnknownRequestError, "holds no blocks", lambda: mgr.preempt("nope")),
        (UnknownRequestError, "'nope'", lambda: mgr.get_block_ids("nope")),
        (DuplicateRequestError, "'r0'", lambda: mgr.allocate_slots(mgr.make_request("r0", [1]), 1)),
        (
            # the compiled build checks the argument's type at the call
            TypeError if compiled() else RequestError,
            "Request object expected" if compiled() else "expected a Request",
            lambda: mgr.get_computed_blocks("r0"),  # type: ignore[arg-type]
        ),
    ]
    if not compiled():  # the compiled build reads a bool passed for an int as 0 / 1
        cases.append(
            (
                RequestLengthError,
                "num_lookahead_tokens",
                lambda: mgr.allocate_slots(r0, 1, num_lookahead_tokens=True),
            )
        )
    for exc, msg, call in cases:
        with pytest.raises(exc, match=msg):
            call()  # type: ignore[operator]
        assert mgr.snapshot() == before
    assert mgr.allocate_slots(r0, 4) is not None  # the next step starts at 16
    before = mgr.snapshot()
    r0.num_computed_tokens = 3  # went back below where the last allocation started
    with pytest.raises(RequestLengthError, match=r"num_computed_tokens 3 must lie in \[16, 20\]"):
        mgr.allocate_slots(r0, 1)
    r0.num_computed_tokens = 21
    with pytest.raises(RequestLengthError, match=r"must lie in \[16, 20\]"):
        mgr.allocate_slots(r0, 1)
    r0.num_computed_tokens = 16
    assert mgr.snapshot() == before
    mgr.check_invariants()


def test_new_request_with_computed_tokens_or_bad_hits() -> None:
    mgr = _mgr()
    r0 = mgr.make_request("r0", tokens(24))
    admit(mgr, r0)
    step(r0, 24)
    mgr.free("r0")
    r1 = mgr.make_request("r1", [*tokens(24), 5])
    hit = mgr.get_computed_blocks(r1)
    assert hit.num_computed_tokens == 24
    before = mgr.snapshot()
    with pytest.raises(RequestLengthError, match="needs the new_computed_blocks"):
        mgr.allocate_slots(r1, 1, num_new_computed_tokens=24)
    with pytest.raises(RequestLengthError, match="covers 24 tokens"):
        mgr.allocate_slots(r1, 1, num_new_computed_tokens=16, new_computed_blocks=hit)
    wrong = ComputedBlocks(hit.blocks[:2], 24, 24)
    with pytest.raises(LayoutMismatchError, match="has 2 groups, the layout 3"):
        mgr.allocate_slots(r1, 1, num_new_computed_tokens=24, new_computed_blocks=wrong)
    forged = ComputedBlocks(((9, 9, 9, 9, 9, 9), *hit.blocks[1:]), 24, 24)
    with pytest.raises(StaleComputedBlocksError, match="group 0"):
        mgr.allocate_slots(r1, 1, num_new_computed_tokens=24, new_computed_blocks=forged)
    r1.num_computed_tokens = 4
    with pytest.raises(RequestLengthError, match="holds no blocks"):
        mgr.allocate_slots(r1, 1)
    r1.num_computed_tokens = 0
    assert mgr.snapshot() == before
    # The hit goes stale when its blocks are evicted before allocate_slots.
    hog = mgr.make_request("hog", tokens(72, start=1000))
    assert mgr.allocate_slots(hog, 72) is not None
    with pytest.raises(StaleComputedBlocksError):
        mgr.allocate_slots(r1, 1, num_new_computed_tokens=24, new_computed_blocks=hit)
    mgr.check_invariants()


def test_finished_requests_and_layout_mismatch() -> None:
    mgr = _mgr()
    r0 = mgr.make_request("r0", tokens(8))
    admit(mgr, r0)
    mgr.free("r0")
    assert r0.is_finished
    with pytest.raises(FinishedRequestError, match="'r0' was freed"):
        mgr.allocate_slots(r0, 1)
    with pytest.raises(FinishedRequestError):
        mgr.get_computed_blocks(r0)
    with pytest.raises(UnknownRequestError):
        mgr.free("r0")
    other = Request("x", tokens(8), hash_block_size=8)
    with pytest.raises(LayoutMismatchError, match="hash_block_size 8 differs from the layout's 4"):
        mgr.get_computed_blocks(other)
    foreign = KVCacheManager(mgr.layout, hasher="builtin").make_request("y", tokens(8))
    with pytest.raises(LayoutMismatchError, match="BuiltinHasher"):
        mgr.allocate_slots(foreign, 8)
    with pytest.raises(LayoutMismatchError, match="MemoryLayout"):
        KVCacheManager("layout")  # type: ignore[arg-type]


def test_preempted_requests_resume_from_zero() -> None:
    mgr = _mgr()
    r0 = mgr.make_request("r0", tokens(20))
    admit(mgr, r0, budget=16)
    step(r0, 16)
    mgr.preempt("r0")
    assert r0.num_computed_tokens == 0 and not mgr.has_blocks("r0")
    assert mgr.get_block_ids("r0") == ([], [], [])
    assert mgr.stats.preemptions == 1
    hit, res = admit(mgr, r0)  # resumes with the 16 computed tokens as a hit
    assert hit.num_computed_tokens == 16 and res is not None
    mgr.check_invariants()
    mgr.preempt("r0")
    mgr.free("r0")  # a preempted request can still be finished
    assert r0.is_finished
    mgr.check_invariants()


def test_check_invariants_detects_corruption() -> None:
    mgr = _mgr()
    r0 = mgr.make_request("r0", tokens(8))
    admit(mgr, r0)
    mgr._coord.pool.refs[0][1] += 1
    with pytest.raises(InvariantError, match="ref counts differ"):
        mgr.check_invariants()
