"""Per-request block need (hybridkv.plan.need): exact values and a brute-force cross-check."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hybridkv.errors import PlanError
from hybridkv.plan import GroupPlan, blocks_for_request, spec_blocks_for_request
from hybridkv.plan.need import blocks_touched
from hybridkv.specs import CacheSpec, NoCacheSpec
from test_plan_factories import chunked, full, mla, sliding, state


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def brute_force_need(spec: CacheSpec, block_size: int, seq_len: int) -> int:
    """Peak blocks touched by any query < seq_len (sets of block ids), + 1, capped."""
    peak = 0
    for q in range(seq_len):
        blocks = {t // block_size for r in spec.visible_tokens(q) for t in r}
        peak = max(peak, len(blocks))
    return min(_cdiv(seq_len, block_size), peak + 1)


def test_full_and_mla_keep_every_block() -> None:
    assert spec_blocks_for_request(full(), 16, 131072) == 8192
    assert spec_blocks_for_request(full(), 16, 131073) == 8193
    assert spec_blocks_for_request(mla(), 4, 5) == 2


def test_state_needs_one_slot() -> None:
    assert spec_blocks_for_request(state((4,)), 256, 1) == 1
    assert spec_blocks_for_request(state((4,)), 256, 131072) == 1


def test_zero_length_needs_nothing() -> None:
    assert spec_blocks_for_request(full(), 16, 0) == 0
    assert spec_blocks_for_request(state((4,)), 16, 0) == 0


def test_sliding_window_worst_alignment_plus_one() -> None:
    # A 128-token span starting on the last token of a block touches 9 blocks of 16.
    assert spec_blocks_for_request(sliding(128), 16, 131072) == 10
    # Window 129: still at most 9 blocks touched (129 + 15 tokens of alignment = 144 = 9 * 16).
    assert spec_blocks_for_request(sliding(129), 16, 131072) == 10
    # Short sequences never exceed what full attention would hold.
    assert spec_blocks_for_request(sliding(128), 16, 100) == 7
    assert spec_blocks_for_request(sliding(128), 16, 129) == 9
    # Window 8, block 4: a span 3..10 touches blocks 0..2, so 3 + 1.
    assert spec_blocks_for_request(sliding(8), 4, 32) == 4


def test_sliding_window_with_sinks() -> None:
    # Sinks 0..3 (block 0) plus an 8-token window touching up to 3 more blocks, + 1.
    assert spec_blocks_for_request(sliding(8, sinks=4), 4, 64) == 5
    assert spec_blocks_for_request(sliding(8, sinks=4), 4, 64) == brute_force_need(
        sliding(8, sinks=4), 4, 64
    )


def test_chunked_local() -> None:
    # Aligned chunk of 8 with block 4: two blocks, + 1.
    assert spec_blocks_for_request(chunked(8), 4, 64) == 3
    # Chunk 6 with block 4: chunk 1 spans tokens 6..11 = blocks 1..2; chunk 2 12..17 = 3..4.
    assert spec_blocks_for_request(chunked(6), 4, 64) == 3
    # Chunk 7 with block 4: chunk 1 spans tokens 7..13 = blocks 1..3, so 3 + 1.
    assert spec_blocks_for_request(chunked(7), 4, 64) == 4


def test_blocks_for_request_reads_the_group_block_size() -> None:
    group = GroupPlan(
        group_id=0,
        spec=full(),
        members=((0, 0),),
        block_size=8,
        kernel_block_size=8,
        page_bytes=256,
    )
    assert blocks_for_request(group, 17) == 3


def test_blocks_touched_merges_overlapping_spans() -> None:
    assert blocks_touched((range(0, 4), range(2, 9)), 4) == 3
    assert blocks_touched((range(0, 0), range(5, 6)), 4) == 1
    assert blocks_touched((), 4) == 0


@pytest.mark.parametrize(
    ("spec", "block_size", "seq_len", "field"),
    [
        (full(), 0, 10, "block_size"),
        (full(), 16, -1, "seq_len"),
        (NoCacheSpec(), 16, 10, "spec.kind"),
    ],
)
def test_bad_arguments_raise(spec: CacheSpec, block_size: int, seq_len: int, field: str) -> None:
    with pytest.raises(PlanError, match=field):
        spec_blocks_for_request(spec, block_size, seq_len)


@given(
    window=st.integers(1, 40),
    sinks=st.integers(0, 10),
    block_size=st.integers(1, 9),
    seq_len=st.integers(1, 120),
)
def test_sliding_matches_brute_force(
    window: int, sinks: int, block_size: int, seq_len: int
) -> None:
    spec = sliding(window, sinks=sinks)
    assert spec_blocks_for_request(spec, block_size, seq_len) == brute_force_need(
        spec, block_size, seq_len
    )


@given(chunk=st.integers(1, 40), block_size=st.integers(1, 9), seq_len=st.integers(1, 150))
def test_chunked_matches_brute_force(chunk: int, block_size: int, seq_len: int) -> None:
    spec = chunked(chunk)
    assert spec_blocks_for_request(spec, block_size, seq_len) == brute_force_need(
        spec, block_size, seq_len
    )
