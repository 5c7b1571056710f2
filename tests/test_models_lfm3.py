"""LFM3 (short conv + sliding + full attention): layer kinds and cache specs from a tiny config."""

from __future__ import annotations

from typing import Any

import pytest

from hybridkv.errors import ConfigError
from hybridkv.models import spec_from_config, supported_model_types
from hybridkv.specs import (
    DType,
    FullAttentionSpec,
    SlidingWindowSpec,
    StateMixer,
    StateSpec,
    StateTensor,
)


def lfm3_config(**overrides: Any) -> dict[str, Any]:
    return {
        "model_type": "lfm3",
        "num_hidden_layers": 6,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "sliding_window": 8,
        "conv_L_cache": 3,
        "dtype": "float32",
        **overrides,
    }


def test_lfm3_is_registered() -> None:
    assert "lfm3" in supported_model_types()


def test_explicit_layer_types() -> None:
    spec = spec_from_config(
        lfm3_config(layer_types=["conv", "sliding_attention", "full_attention"] * 2)
    )
    conv = StateSpec(
        mixer=StateMixer.SHORT_CONV,
        tensors=(StateTensor(name="conv", shape=(64, 3), dtype=DType.FP32),),
    )
    sliding = SlidingWindowSpec(num_kv_heads=2, head_dim=16, dtype=DType.FP32, window=8)
    full = FullAttentionSpec(num_kv_heads=2, head_dim=16, dtype=DType.FP32)
    assert [layer.caches for layer in spec.layers] == [(conv,), (sliding,), (full,)] * 2
    # per token: 2 (K and V) * 2 heads * 16 dims * 4 bytes
    assert sliding.bytes_per_token == full.bytes_per_token == 256
    # a conv state is 64 channels * 3 columns * 4 bytes, whatever the length
    assert conv.state_bytes == 768


def test_default_pattern_follows_transformers() -> None:
    spec = spec_from_config(lfm3_config(num_hidden_layers=9))
    assert [layer.layer_type for layer in spec.layers] == [
        "conv",
        "conv",
        "full_attention",
        "conv",
        "sliding_attention",
        "conv",
        "full_attention",
        "conv",
        "sliding_attention",
    ]


def test_checkpoint_defaults_and_tensor_parallel() -> None:
    config = {"model_type": "lfm3", "num_hidden_layers": 3, "hidden_size": 2048}
    spec = spec_from_config(config, tp_size=2)
    # defaults of transformers' Lfm3Config: 4 KV heads of 128 dims, window 256, L_cache 7, bf16
    assert spec.layers[2].caches == (
        FullAttentionSpec(num_kv_heads=2, head_dim=128, dtype=DType.BF16),
    )
    (conv,) = spec.layers[0].caches
    assert isinstance(conv, StateSpec)
    assert [(t.name, t.shape, t.dtype) for t in conv.tensors] == [("conv", (1024, 7), DType.BF16)]


def test_bad_layer_type_names_the_layer() -> None:
    with pytest.raises(ConfigError, match="layer 1 has layer type 'mamba'"):
        spec_from_config(lfm3_config(layer_types=["conv", "mamba"] * 3))
