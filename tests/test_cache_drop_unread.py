"""``KVCacheManager.drop_unread``: an imported prompt's window blocks before its last window
are freed unpublished, so an import never needs data the exporting side already dropped."""

from __future__ import annotations

import pytest

from hybridkv.cache import KVCacheManager
from hybridkv.cache.errors import RequestLengthError, UnknownRequestError
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
