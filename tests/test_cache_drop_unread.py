"""``KVCacheManager.drop_unread``: an imported prompt's window blocks before its last window
are freed unpublished, so an import never needs data the exporting side already dropped."""

from __future__ import annotations

import pytest

from hybridkv.cache import KVCacheManager
from hybridkv.cache.errors import (
    LayoutMismatchError,
    RequestLengthError,
    UnknownRequestError,
    UnwrittenTokensError,
)
from test_cache_factories import admit, cached_hashes, full, groups, step, swa, tokens, uniform


def test_an_import_frees_the_window_blocks_no_later_query_reads() -> None:
    layout = uniform(groups(full(), swa(8)), 20)
    mgr = KVCacheManager(layout, window_retention="all", publish="computed")
    r0 = mgr.make_request("r0", tokens(18))
    _, res = admit(mgr, r0)
    assert res is not None and res.new_block_ids == ((1, 2, 3, 4, 5), (6, 7, 8, 9, 10))
    free = mgr.num_free_blocks
    # queries >= 18 read tokens >= 11: window blocks 0 and 1 (6, 7) are never read here
    assert mgr.drop_unread("r0", 18) == 2
    assert mgr.get_block_ids("r0") == ([1, 2, 3, 4, 5], [0, 0, 8, 9, 10])
    assert mgr.num_free_blocks == (free[0] + 2, free[1] + 2)
    mgr.check_invariants()
    assert mgr.drop_unread("r0", 18) == 0  # nothing left to drop
    step(r0, 18)  # the import wrote what the tables hold
    r0.append_token_ids([100])
    assert mgr.allocate_slots(r0, 1) is not None
    mgr.free("r0")
    # only blocks that held data were published: the window's first two positions never
    swa_hashes = r0.block_hashes
    assert not {swa_hashes[0], swa_hashes[1]} & cached_hashes(mgr)[1]
    assert {swa_hashes[2], swa_hashes[3]} <= cached_hashes(mgr)[1]
    r1 = mgr.make_request("r1", [*tokens(18), 7, 7, 7])
    hit, res = admit(mgr, r1)
    assert hit.num_computed_tokens == 16  # full blocks 0-3 and window blocks 2-3
    assert hit.blocks == ((1, 2, 3, 4), (0, 0, 8, 9))
    assert res is not None and res.new_block_ids == ((10, 5), (7, 6))  # uncached free first
    # a hit's blocks stay: only blocks taken fresh are dropped (none before token 14 here)
    assert mgr.drop_unread("r1", 21) == 0
    assert mgr.get_block_ids("r1")[1] == [0, 0, 8, 9, 7, 6]
    mgr.check_invariants()
    # published when scheduled, the blocks hold a hash already: they are kept
    mgr = KVCacheManager(layout, window_retention="all", publish="scheduled")
    r0 = mgr.make_request("r0", tokens(18))
    admit(mgr, r0)
    assert mgr.drop_unread("r0", 18) == 0
    assert mgr.get_block_ids("r0") == ([1, 2, 3, 4, 5], [6, 7, 8, 9, 10])


def test_drop_unread_refuses_bad_calls_and_changes_nothing() -> None:
    mgr = KVCacheManager(uniform(groups(full(), swa(8)), 20))
    r0 = mgr.make_request("r0", tokens(18))
    admit(mgr, r0)
    before = mgr._coord.snapshot()
    with pytest.raises(UnknownRequestError, match="'nope' holds no blocks"):
        mgr.drop_unread("nope", 18)
    with pytest.raises(RequestLengthError, match=r"num_tokens 19 outside \[0, 18\]"):
        mgr.drop_unread("r0", 19)
    with pytest.raises(RequestLengthError, match="must be an integer >= 0, got -1"):
        mgr.drop_unread("r0", -1)
    step(r0, 18)
    with pytest.raises(RequestLengthError, match=r"num_tokens 4 outside \[18, 18\]"):
        mgr.drop_unread("r0", 4)
    assert mgr._coord.snapshot() == before
    mgr.check_invariants()


def test_blocks_holding_tokens_the_import_lacks_are_never_published() -> None:
    """The exporting side kept smaller window blocks and released tokens [0, 10); this side's
    first kept block (tokens 8-11) holds two of them: it is written from token 10 on and
    withheld from the prefix cache, so no later hit reads tokens 8 and 9."""
    layout = uniform(groups(full(), swa(8)), 20)
    mgr = KVCacheManager(layout, window_retention="all", publish="computed")
    r0 = mgr.make_request("r0", tokens(18))
    admit(mgr, r0)
    assert mgr.drop_unread("r0", 18, missing={1: [(0, 10)]}) == 2
    assert mgr.get_block_ids("r0") == ([1, 2, 3, 4, 5], [0, 0, 8, 9, 10])
    assert mgr._coord.requests["r0"].groups[1].withheld == (2,)
    mgr.check_invariants()
    step(r0, 18)
    r0.append_token_ids([100])
    assert mgr.allocate_slots(r0, 1) is not None
    mgr.check_invariants()
    mgr.free("r0")
    h = r0.block_hashes
    assert h[2] not in cached_hashes(mgr)[1]  # withheld: it lacks tokens 8 and 9
    assert h[3] in cached_hashes(mgr)[1]
    # a hit at 16 reads tokens 9-15 (blocks 2 and 3): block 2 is missing, so the window
    # group serves no hit, and with it the whole request has none
    r1 = mgr.make_request("r1", [*tokens(18), 7, 7, 7])
    hit, _ = admit(mgr, r1)
    assert hit.num_computed_tokens == 0
    mgr.check_invariants()


def test_missing_tokens_a_later_query_reads_are_refused_and_change_nothing() -> None:
    layout = uniform(groups(full(), swa(8, sinks=2)), 20)
    mgr = KVCacheManager(layout, window_retention="all", publish="computed")
    r0 = mgr.make_request("r0", tokens(18))
    admit(mgr, r0)
    before = mgr._coord.snapshot()
    cases = [
        ({1: [(4, 12)]}, UnwrittenTokensError, "token 11 .* a query at or after 18 reads it"),
        ({1: [(1, 6)]}, UnwrittenTokensError, r"token 1 .* \(an attention sink\)"),
        ({0: [(0, 4)]}, UnwrittenTokensError, r"missing\[0\]: token 0 .* reads it"),
        ({5: [(0, 4)]}, LayoutMismatchError, "group_id 5 is not a group"),
        ([(0, 4)], RequestLengthError, "need a mapping of group id to token ranges"),
        ({1: [(3, 3)]}, RequestLengthError, r"missing\[1\]: need token ranges .* got \(3, 3\)"),
        ({1: (0, 4)}, RequestLengthError, r"missing\[1\]: need token ranges .* got 0"),
        ({1: [(-1, 4)]}, RequestLengthError, r"missing\[1\]: must be an integer >= 0"),
    ]
    for missing, error, message in cases:
        with pytest.raises(error, match=message):
            mgr.drop_unread("r0", 18, missing=missing)  # type: ignore[arg-type]
        assert mgr._coord.snapshot() == before
    mgr.check_invariants()
    # published when scheduled: a block holding a missing token cannot be taken back
    mgr = KVCacheManager(uniform(groups(full(), swa(8)), 20), publish="scheduled")
    r0 = mgr.make_request("r0", tokens(18))
    admit(mgr, r0)
    before = mgr._coord.snapshot()
    with pytest.raises(UnwrittenTokensError, match=r"token 8 .* block 8 holding it is published"):
        mgr.drop_unread("r0", 18, missing={1: [(0, 10)]})
    assert mgr._coord.snapshot() == before
