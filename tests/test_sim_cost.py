"""The simulator's step-cost model: exact FLOPs and bytes per layer kind and per TP rank.

Each test uses an accelerator whose one side is free (infinite bandwidth or infinite FLOP/s,
no overhead), so a step's seconds equal its FLOPs or its bytes and can be checked exactly.
"""

from __future__ import annotations

import pytest

from hybridkv.sim.cost import Accelerator, ModelProfile, StepCostModel
from hybridkv.specs import (
    ChunkedLocalSpec,
    DType,
    FullAttentionSpec,
    LayerSpec,
    MLASpec,
    ModelSpec,
    SlidingWindowSpec,
)
from hybridkv.specs.kinds import CacheSpec

#: seconds == FLOPs
FLOPS = Accelerator(
    name="flops", peak_flops=1.0, hbm_bandwidth=1e30, mfu=1.0, bw_efficiency=1.0, step_overhead_s=0
)
#: seconds == bytes
BYTES = Accelerator(
    name="bytes", peak_flops=1e30, hbm_bandwidth=1.0, mfu=1.0, bw_efficiency=1.0, step_overhead_s=0
)
KV = {"num_kv_heads": 2, "head_dim": 16, "dtype": DType.FP16}  # 128 bytes per token


def _cost(
    spec: CacheSpec, accel: Accelerator, *, tp: int = 1, params: float = 0.0
) -> StepCostModel:
    model = ModelSpec(
        name="m",
        model_type="test",
        layers=(LayerSpec(index=0, layer_type="x", caches=(spec,)),),
        tp_size=tp,
    )
    return StepCostModel(model, ModelProfile(active_params=params, q_heads=4), accel)


def test_full_attention_counts_every_key_each_query_sees() -> None:
    # queries at 2, 3, 4 see 3 + 4 + 5 keys; 4 heads * 16 dims; 4 FLOPs per key and dim
    assert _cost(FullAttentionSpec(**KV), FLOPS).step_seconds([(2, 3)]) == 4 * 64 * 12
    # reads the 5 keys and writes the 3 new tokens, 128 bytes each
    assert _cost(FullAttentionSpec(**KV), BYTES).step_seconds([(2, 3)]) == (5 + 3) * 128


def test_sliding_window_caps_each_query_at_the_window() -> None:
    spec = SlidingWindowSpec(window=3, **KV)
    # queries at 0, 1, 2, 3, 4 see 1, 2, 3, 3, 3 keys
    assert _cost(spec, FLOPS).step_seconds([(0, 5)]) == 4 * 64 * 12
    # queries at 4, 5 see keys 2..4 and 3..5: reads positions 2..5, writes 2
    assert _cost(spec, BYTES).step_seconds([(4, 2)]) == (4 + 2) * 128


def test_chunked_local_attention_sees_its_own_chunk_up_to_itself() -> None:
    spec = ChunkedLocalSpec(chunk_size=4, **KV)
    # queries at 2..7 see 3, 4 | 1, 2, 3, 4 keys (a new chunk starts at 4), not 4 each
    assert _cost(spec, FLOPS).step_seconds([(2, 6)]) == 4 * 64 * 17
    # a decode step deep in the sequence: the query at 9 sees 8, 9 only
    assert _cost(spec, FLOPS).step_seconds([(9, 1)]) == 4 * 64 * 2
    # reads its chunk's keys from 8 on, writes 1
    assert _cost(spec, BYTES).step_seconds([(9, 1)]) == (2 + 1) * 128


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_tensor_parallel_divides_heads_weights_and_linear_flops(tp: int) -> None:
    spec = FullAttentionSpec(**KV)
    attention = 4 * (16 * 4 // tp) * 12  # one rank's 4 / tp query heads
    assert _cost(spec, FLOPS, tp=tp, params=1000.0).step_seconds([(2, 3)]) == pytest.approx(
        attention + 2 * 1000 / tp * 3
    )
    # one rank's weights (2 bytes a parameter) and its cache bytes
    assert _cost(spec, BYTES, tp=tp, params=1000.0).step_seconds([(2, 3)]) == pytest.approx(
        2 * 1000 / tp + (5 + 3) * 128
    )


def test_mla_splits_query_heads_over_ranks_and_keeps_the_latent_whole() -> None:
    spec = MLASpec(kv_lora_rank=28, qk_rope_head_dim=4, dtype=DType.FP16)  # 32 elements
    one = _cost(spec, FLOPS, tp=1).step_seconds([(2, 3)])
    assert one == 4 * (32 * 4) * 12
    assert _cost(spec, FLOPS, tp=2).step_seconds([(2, 3)]) == one / 2
    # every rank reads the whole latent cache
    assert _cost(spec, BYTES, tp=2).step_seconds([(2, 3)]) == (5 + 3) * 64


def test_a_rank_holds_at_least_one_query_head() -> None:
    # 4 query heads over 8 ranks: each rank still computes one head
    assert _cost(FullAttentionSpec(**KV), FLOPS, tp=8).step_seconds([(0, 1)]) == 4 * 16 * 1
