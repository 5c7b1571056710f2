"""Index arithmetic of a step: kernel slots, visible spans, masks, and their checks."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from hybridkv.engine.errors import BatchError
from hybridkv.engine.gather import kernel_slots, segment_index, visibility_mask, visible_spans
from hybridkv.plan import GroupPlan
from hybridkv.specs import (
    CacheSpec,
    ChunkedLocalSpec,
    FullAttentionSpec,
    MLASpec,
    SlidingWindowSpec,
    StateMixer,
    StateSpec,
    StateTensor,
)

KV = {"num_kv_heads": 1, "head_dim": 2, "dtype": "fp32"}


def group(spec: CacheSpec, block_size: int = 4, kernel: int | None = None) -> GroupPlan:
    return GroupPlan(
        group_id=0,
        spec=spec,
        members=((0, 0),),
        block_size=block_size,
        kernel_block_size=kernel or block_size,
        page_bytes=spec.bytes_per_block(block_size),
    )


def test_kernel_slots_split_manager_blocks() -> None:
    # block 8, kernel 4: token 13 is manager block 9 (index 1), kernel block 9*2+1, offset 1
    blocks, offsets = kernel_slots((5, 9), [0, 3, 4, 7, 8, 13, 15], 8, 4)
    assert blocks == [10, 10, 11, 11, 18, 19, 19]
    assert offsets == [0, 3, 0, 3, 0, 1, 3]


def test_segment_index_of_a_sliding_window_decode_step() -> None:
    spec = SlidingWindowSpec(window=5, **KV)
    # 10 tokens computed; the 11th (index 10) reads 6..10; blocks 0 (tokens 0-3) released.
    idx = segment_index(
        group(spec), (0, 7, 3), num_computed=10, num_new=1, num_block_ids=8, request_id="r"
    )
    assert idx.write_blocks.tolist() == [3] and idx.write_offsets.tolist() == [2]
    assert idx.key_positions.tolist() == [6, 7, 8, 9, 10]
    assert idx.read_blocks.tolist() == [7, 7, 3, 3, 3]
    assert idx.read_offsets.tolist() == [2, 3, 0, 1, 2]
    assert idx.mask.tolist() == [[True] * 5]


def test_segment_index_with_kernel_blocks_and_chunk_of_queries() -> None:
    spec = FullAttentionSpec(**KV)
    idx = segment_index(
        group(spec, 4, 2), (6, 2), num_computed=3, num_new=3, num_block_ids=8, request_id="r"
    )
    assert idx.write_blocks.tolist() == [13, 4, 4]  # 6*2+1, then 2*2+0
    assert idx.write_offsets.tolist() == [1, 0, 1]
    assert idx.read_blocks.tolist() == [12, 12, 13, 13, 4, 4]
    assert idx.mask.int().tolist() == [
        [1, 1, 1, 1, 0, 0],
        [1, 1, 1, 1, 1, 0],
        [1, 1, 1, 1, 1, 1],
    ]


def test_chunked_local_reads_only_the_current_chunk() -> None:
    spec = ChunkedLocalSpec(chunk_size=4, **KV)
    idx = segment_index(
        group(spec), (0, 5, 6), num_computed=6, num_new=3, num_block_ids=8, request_id="r"
    )
    assert idx.key_positions.tolist() == [4, 5, 6, 7, 8]
    assert idx.mask.int().tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [0, 0, 0, 0, 1]]


@pytest.mark.parametrize(
    ("table", "kw", "message"),
    [
        ((3,), {"num_computed": 2, "num_new": 3}, "1 blocks cover 4 tokens, the step needs 5"),
        ((3, 9), {"num_computed": 2, "num_new": 3}, "block id 9 is outside [0, 8)"),
        ((3, 0), {"num_computed": 2, "num_new": 3}, "token 4 (written) is in block index 1"),
        ((0, 4), {"num_computed": 4, "num_new": 1}, "token 0 (read) is in block index 0"),
    ],
)
def test_segment_index_rejects_bad_tables(
    table: tuple[int, ...], kw: dict[str, int], message: str
) -> None:
    with pytest.raises(BatchError, match=re.escape(message)):
        segment_index(group(FullAttentionSpec(**KV)), table, num_block_ids=8, request_id="r", **kw)


def test_state_specs_have_no_tokens_to_gather() -> None:
    spec = StateSpec(
        mixer=StateMixer.SHORT_CONV, tensors=(StateTensor(name="conv", shape=(2, 3), dtype="fp32"),)
    )
    with pytest.raises(BatchError, match="'state' keeps no tokens"):
        visible_spans(spec, 0, 4)


SPECS = st.one_of(
    st.builds(lambda: FullAttentionSpec(**KV)),
    st.builds(lambda: MLASpec(kv_lora_rank=4, qk_rope_head_dim=2, dtype="fp32")),
    st.builds(
        lambda w, s: SlidingWindowSpec(window=w, sink_tokens=s, **KV),
        st.integers(1, 9),
        st.integers(0, 3),
    ),
    st.builds(lambda c: ChunkedLocalSpec(chunk_size=c, **KV), st.integers(1, 9)),
)


@given(spec=SPECS, start=st.integers(0, 30), length=st.integers(1, 12))
def test_spans_and_mask_agree_with_the_spec(spec: CacheSpec, start: int, length: int) -> None:
    end = start + length
    spans = visible_spans(spec, start, end)
    keys = [p for lo, hi in spans for p in range(lo, hi)]
    # spans are sorted and disjoint
    assert keys == sorted(set(keys))
    mask = visibility_mask(spec, torch.arange(start, end), torch.tensor(keys, dtype=torch.long))
    for i, q in enumerate(range(start, end)):
        visible = {p for r in spec.visible_tokens(q) for p in r}
        # every key a query sees is gathered, and the mask marks exactly those
        assert visible <= set(keys)
        assert {k for k, m in zip(keys, mask[i].tolist(), strict=True) if m} == visible
