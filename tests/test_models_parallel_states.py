"""Tensor-parallel sharding rules and recurrent-state builders (hybridkv.models.parallel/states)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hybridkv.errors import ConfigError
from hybridkv.models.config import DeriveContext
from hybridkv.models.parallel import kv_heads_per_rank, split_exact, split_or_replicate
from hybridkv.models.states import (
    gated_deltanet_state,
    kda_state,
    mamba1_state,
    mamba2_state,
    short_conv_state,
)
from hybridkv.specs import DType, StateMixer, StateSpec

BF16, FP32 = DType.BF16, DType.FP32


def ctx(tp: int = 1, ssm: DType | None = None) -> DeriveContext:
    return DeriveContext(tp_size=tp, dtype=BF16, kv_dtype=BF16, ssm_state_dtype=ssm)


def shapes(spec: StateSpec) -> list[tuple[str, tuple[int, ...], DType]]:
    return [(t.name, t.shape, t.dtype) for t in spec.tensors]


def test_kv_heads_per_rank_examples() -> None:
    assert kv_heads_per_rank(8, 1, field="f", model_type="m") == 8
    assert kv_heads_per_rank(8, 2, field="f", model_type="m") == 4
    assert kv_heads_per_rank(8, 8, field="f", model_type="m") == 1
    assert kv_heads_per_rank(8, 16, field="f", model_type="m") == 1
    assert kv_heads_per_rank(1, 4, field="f", model_type="m") == 1
    with pytest.raises(ConfigError, match=r"m: tp_size=3 cannot shard f=8; use a tp_size that"):
        kv_heads_per_rank(8, 3, field="f", model_type="m")
    with pytest.raises(ConfigError, match=r"tp_size=12 cannot shard f=8"):
        kv_heads_per_rank(8, 12, field="f", model_type="m")


@given(heads=st.integers(1, 64), tp=st.integers(1, 64))
def test_kv_heads_cover_every_head_exactly_or_replicate(heads: int, tp: int) -> None:
    try:
        per_rank = kv_heads_per_rank(heads, tp, field="f", model_type="m")
    except ConfigError:
        assert heads % tp and tp % heads
        return
    assert per_rank >= 1
    assert per_rank * tp == heads or (per_rank == 1 and tp % heads == 0)


def test_split_rules() -> None:
    assert split_exact(128, 4, field="heads", model_type="m") == 32
    with pytest.raises(ConfigError, match=r"m: tp_size=3 does not divide heads=128"):
        split_exact(128, 3, field="heads", model_type="m")
    assert split_or_replicate(8, 4) == 2
    assert split_or_replicate(1, 4) == 1
    assert split_or_replicate(2, 4) == 2


def test_mamba1_state() -> None:
    spec = mamba1_state(ctx(), model_type="jamba", intermediate=8192, d_conv=4, d_state=16)
    assert spec.mixer is StateMixer.MAMBA1
    assert shapes(spec) == [("conv", (8192, 4), BF16), ("ssm", (8192, 16), FP32)]
    assert spec.state_bytes == 8192 * 4 * 2 + 8192 * 16 * 4
    half = mamba1_state(ctx(tp=2), model_type="jamba", intermediate=8192, d_conv=4, d_state=16)
    assert shapes(half) == [("conv", (4096, 4), BF16), ("ssm", (4096, 16), FP32)]


def test_mamba2_state_and_overrides() -> None:
    def build(tp: int = 1, ssm: DType | None = None, flag: DType | None = None) -> StateSpec:
        return mamba2_state(
            ctx(tp, ssm),
            model_type="m",
            n_heads=128,
            head_dim=64,
            n_groups=8,
            d_state=128,
            d_conv=4,
            ssm_dtype_flag=flag,
        )

    assert shapes(build()) == [("conv", (10240, 4), BF16), ("ssm", (128, 64, 128), FP32)]
    assert shapes(build(tp=8)) == [
        ("conv", (1024 + 2 * 128, 4), BF16),
        ("ssm", (16, 64, 128), FP32),
    ]
    assert shapes(build(flag=BF16))[1][2] is BF16
    assert shapes(build(ssm=DType.FP16, flag=BF16))[1][2] is DType.FP16  # caller wins
    with pytest.raises(ConfigError, match=r"tp_size=3 does not divide mamba heads=128"):
        build(tp=3)


def test_linear_attention_states() -> None:
    gdn = gated_deltanet_state(
        ctx(),
        model_type="qwen3_next",
        num_k_heads=2,
        num_v_heads=4,
        head_k_dim=8,
        head_v_dim=16,
        d_conv=4,
    )
    assert shapes(gdn) == [("conv", (2 * 2 * 8 + 4 * 16, 4), BF16), ("recurrent", (4, 8, 16), FP32)]
    kda = kda_state(ctx(tp=2), model_type="kimi_linear", num_heads=4, head_dim=8, d_conv=4)
    assert shapes(kda) == [("conv", (3 * 2 * 8, 4), BF16), ("recurrent", (2, 8, 8), FP32)]
    conv = short_conv_state(ctx(), model_type="lfm2", hidden_size=64, l_cache=3)
    assert shapes(conv) == [("conv", (64, 3), BF16)]
    assert conv.state_bytes == 384
