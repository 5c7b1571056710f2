"""Config-class defaults and refusals an outside review found wrong (transformers 5.24).

Each test feeds a config.json as a checkpoint may hold it (a field omitted, so transformers'
config class fills its default or derives it) and asserts the exact spec transformers' class
implies.  The last test re-derives the same dicts through the installed transformers config
classes and compares, when transformers is installed.
"""

from __future__ import annotations

from typing import Any

import pytest

from hybridkv.errors import UnsupportedModelTypeError
from hybridkv.models import spec_from_config
from hybridkv.specs import (
    AttentionSpec,
    ChunkedLocalSpec,
    DType,
    FullAttentionSpec,
    ModelSpec,
    SlidingWindowSpec,
    StateSpec,
)

BF16 = DType.BF16
TINY: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "vocab_size": 128,
    "max_position_embeddings": 256,
}


def kinds(spec: ModelSpec) -> list[tuple[str, int | None]]:
    """(layer type, window or chunk size) per layer."""
    out: list[tuple[str, int | None]] = []
    for layer in spec.layers:
        cache = layer.caches[0]
        size = (
            cache.window
            if isinstance(cache, SlidingWindowSpec)
            else cache.chunk_size
            if isinstance(cache, ChunkedLocalSpec)
            else None
        )
        out.append((layer.layer_type, size))
    return out


def state_shapes(spec: StateSpec) -> dict[str, tuple[tuple[int, ...], DType]]:
    return {t.name: (t.shape, t.dtype) for t in spec.tensors}


# --- 1. head_dim absent: Qwen3Config / NemotronHConfig default 128 -----------------------------

QWEN3_NO_HEAD_DIM: dict[str, Any] = {  # /tmp/specrev/cfg_qwen3_nohd/config.json
    "model_type": "qwen3",
    "num_hidden_layers": 28,
    "hidden_size": 1024,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "max_position_embeddings": 40960,
    "torch_dtype": "bfloat16",
}


def test_qwen3_without_head_dim_uses_the_class_default_128() -> None:
    spec = spec_from_config(QWEN3_NO_HEAD_DIM)
    assert spec.num_layers == 28
    full = FullAttentionSpec(num_kv_heads=8, head_dim=128, dtype=BF16)
    assert {layer.caches for layer in spec.layers} == {(full,)}
    assert full.bytes_per_token == 2 * 8 * 128 * 2 == 4096  # not 1024 // 16 = 64
    assert spec.full_attention_equivalent_bytes_per_token() == 28 * 4096


def test_qwen2_without_head_dim_keeps_hidden_over_heads() -> None:
    # Qwen2Config has no head_dim field: the model uses hidden_size // num_attention_heads
    spec = spec_from_config({**QWEN3_NO_HEAD_DIM, "model_type": "qwen2"})
    assert {layer.caches for layer in spec.layers} == {
        (FullAttentionSpec(num_kv_heads=8, head_dim=64, dtype=BF16),)
    }


QWEN_NO_KV_HEADS: dict[str, Any] = {
    "model_type": "qwen2",
    "num_hidden_layers": 2,
    "hidden_size": 4096,
    "num_attention_heads": 64,
    "torch_dtype": "bfloat16",
}


@pytest.mark.parametrize(("model_type", "head_dim"), [("qwen2", 64), ("qwen3", 128)])
def test_qwen_without_num_key_value_heads_uses_the_class_default_32(
    model_type: str, head_dim: int
) -> None:
    # Qwen2Config and Qwen3Config default num_key_value_heads to 32, not num_attention_heads
    spec = spec_from_config({**QWEN_NO_KV_HEADS, "model_type": model_type})
    assert {layer.caches for layer in spec.layers} == {
        (FullAttentionSpec(num_kv_heads=32, head_dim=head_dim, dtype=BF16),)
    }


NEMOTRON_NO_HEAD_DIM: dict[str, Any] = {
    "model_type": "nemotron_h",
    "dtype": "float32",
    **TINY,
    "num_key_value_heads": 2,
    "hybrid_override_pattern": "M*",
    "mamba_num_heads": 8,
    "mamba_head_dim": 16,
    "n_groups": 2,
    "ssm_state_size": 8,
    "conv_kernel": 4,
    "chunk_size": 4,
}


def test_nemotron_h_without_head_dim_uses_the_class_default_128() -> None:
    spec = spec_from_config(NEMOTRON_NO_HEAD_DIM)
    assert [layer.layer_type for layer in spec.layers] == ["linear_attention", "full_attention"]
    (state,) = spec.layers[0].caches
    assert isinstance(state, StateSpec)
    assert state_shapes(state) == {
        "conv": ((160, 4), DType.FP32),
        "ssm": ((8, 16, 8), DType.FP32),
    }
    full = FullAttentionSpec(num_kv_heads=2, head_dim=128, dtype=DType.FP32)
    assert spec.layers[1].caches == (full,)  # not 64 // 4 = 16
    assert full.bytes_per_token == 2 * 2 * 128 * 4 == 2048


def test_nemotron_h_remote_code_attention_head_dim_still_names_the_head_size() -> None:
    # remote-code Nemotron-H checkpoints (the catalog's Nemotron-H-8B) name it attention_head_dim
    spec = spec_from_config({**NEMOTRON_NO_HEAD_DIM, "attention_head_dim": 32})
    assert spec.layers[1].caches == (
        FullAttentionSpec(num_kv_heads=2, head_dim=32, dtype=DType.FP32),
    )
    both = spec_from_config({**NEMOTRON_NO_HEAD_DIM, "attention_head_dim": 32, "head_dim": 16})
    assert both.layers[1].caches == (
        FullAttentionSpec(num_kv_heads=2, head_dim=16, dtype=DType.FP32),
    )


# --- 2. olmo_hybrid: linear head counts and sizes derived as OlmoHybridConfig does --------------

OLMO_HYBRID: dict[str, Any] = {
    "model_type": "olmo_hybrid",
    "dtype": "bfloat16",
    **TINY,
    "num_hidden_layers": 2,
    "layer_types": ["linear_attention", "full_attention"],
    "pad_token_id": 0,
}


def test_olmo_hybrid_derives_linear_dims_from_hidden_size_and_heads() -> None:
    spec = spec_from_config({**OLMO_HYBRID, "num_key_value_heads": 2})
    (state,) = spec.layers[0].caches
    assert isinstance(state, StateSpec)
    # Hk = Hv = 4 heads, dk = int(0.75 * 64 / 4) = 12, dv = 2 * dk = 24
    assert state_shapes(state) == {
        "conv": ((2 * 4 * 12 + 4 * 24, 4), BF16),
        "recurrent": ((4, 12, 24), DType.FP32),
    }
    assert state.state_bytes == 192 * 4 * 2 + 4 * 12 * 24 * 4
    assert spec.layers[1].caches == (FullAttentionSpec(num_kv_heads=2, head_dim=16, dtype=BF16),)


def test_olmo_hybrid_without_num_key_value_heads_is_multi_head() -> None:
    config = {
        **OLMO_HYBRID,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 8,
        "linear_value_head_dim": 16,
    }
    spec = spec_from_config(config)
    (state,) = spec.layers[0].caches
    assert isinstance(state, StateSpec)
    assert state_shapes(state) == {
        "conv": ((96, 4), BF16),
        "recurrent": ((4, 8, 16), DType.FP32),
    }
    full = FullAttentionSpec(num_kv_heads=4, head_dim=16, dtype=BF16)  # not the 7B's 30
    assert spec.layers[1].caches == (full,)
    assert full.bytes_per_token == 2 * 4 * 16 * 2 == 256


def test_olmo_hybrid_value_size_follows_a_given_key_size() -> None:
    config = {**OLMO_HYBRID, "hidden_size": 100, "linear_num_key_heads": 3, "head_dim": 25}
    spec = spec_from_config(config)
    (state,) = spec.layers[0].caches
    assert isinstance(state, StateSpec)
    # dk = int(0.75 * 100 / 3) = 25, dv = 50, Hv = num_attention_heads = 4
    assert state_shapes(state)["recurrent"] == ((4, 25, 50), DType.FP32)
    assert state_shapes(state)["conv"] == ((2 * 3 * 25 + 4 * 50, 4), BF16)
    given = spec_from_config({**config, "linear_key_head_dim": 10})
    (state,) = given.layers[0].caches
    assert isinstance(state, StateSpec)
    assert state_shapes(state)["recurrent"] == ((4, 10, 20), DType.FP32)


@pytest.mark.parametrize(
    ("layers", "expected"),
    [
        (2, "LF"),
        (3, "LLF"),
        (5, "LLLFL"),
        (8, "LLLFLLLF"),
    ],
)
def test_olmo_hybrid_default_layer_types(layers: int, expected: str) -> None:
    config = {k: v for k, v in OLMO_HYBRID.items() if k != "layer_types"}
    spec = spec_from_config({**config, "num_hidden_layers": layers})
    names = {"L": "linear_attention", "F": "full_attention"}
    assert [layer.layer_type for layer in spec.layers] == [names[c] for c in expected]


# --- 3. dory: a KV cache per recurrent loop -> refused ------------------------------------------

DORY: dict[str, Any] = {
    "model_type": "dory",
    **TINY,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_hidden_layers": 8,
    "sliding_window": 16,
    "layer_types": ["sliding_attention", "mlp"] * 3 + ["full_attention", "mlp"],
    "n_input_layers": 2,
    "n_recurrent_layers": 4,
    "n_output_layers": 2,
    "n_recurrent_loops": 3,
    "recurrent_kv_cache_mode": "per_loop",
}


@pytest.mark.parametrize(
    "drop",
    [(), ("n_recurrent_loops",), ("recurrent_kv_cache_mode",)],
    ids=["both", "mode", "loops"],
)
def test_dory_looped_layers_are_refused(drop: tuple[str, ...]) -> None:
    config = {k: v for k, v in DORY.items() if k not in drop}
    with pytest.raises(UnsupportedModelTypeError) as info:
        spec_from_config(config)
    message = str(info.value)
    assert message.startswith("config.model_type: 'dory' is not supported: it has no registry")
    assert "looped recurrent layers with a KV cache per loop" in message
    present = [k for k in ("n_recurrent_loops", "recurrent_kv_cache_mode") if k not in drop]
    assert f"({', '.join(present)})" in message


# --- 4. qwen2 / qwen3: use_sliding_window without sliding_window -> class default 4096 ----------


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
def test_qwen_sliding_window_defaults_to_4096(model_type: str) -> None:
    config = {
        "model_type": model_type,
        **TINY,
        "num_hidden_layers": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "use_sliding_window": True,
        "max_window_layers": 2,
    }
    expected = [("full_attention", None)] * 2 + [("sliding_attention", 4096)] * 2
    spec = spec_from_config(config)
    assert kinds(spec) == expected
    assert spec.layers[2].caches == (
        SlidingWindowSpec(num_kv_heads=2, head_dim=16, dtype=BF16, window=4096),
    )
    with_types = spec_from_config({**config, "layer_types": [t for t, _ in expected]})
    assert kinds(with_types) == expected
    off = spec_from_config({**config, "use_sliding_window": False})
    assert kinds(off) == [("full_attention", None)] * 4


# --- 5. llama4_text: attention_chunk_size null -> every layer full -----------------------------


def test_llama4_null_chunk_size_makes_every_layer_full() -> None:
    config = {
        "model_type": "llama4_text",
        **TINY,
        "num_hidden_layers": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "attention_chunk_size": None,
    }
    spec = spec_from_config(config)
    assert {layer.caches for layer in spec.layers} == {
        (FullAttentionSpec(num_kv_heads=2, head_dim=16, dtype=BF16),)
    }
    assert [layer.layer_type for layer in spec.layers] == ["full_attention"] * 4
    chunked = spec_from_config({**config, "attention_chunk_size": 8})
    assert kinds(chunked) == [("chunked_attention", 8)] * 3 + [("full_attention", None)]


# --- 6. mllama: cross-attention layers cache image K/V -> refused ------------------------------


def test_mllama_cross_attention_layers_are_refused() -> None:
    config = {
        "model_type": "mllama",
        "text_config": {
            "model_type": "mllama_text_model",
            **TINY,
            "num_hidden_layers": 4,
            "num_key_value_heads": 2,
            "cross_attention_layers": [1, 3],
        },
    }
    with pytest.raises(UnsupportedModelTypeError) as info:
        spec_from_config(config)
    message = str(info.value)
    assert message.startswith("config.model_type: 'mllama_text_model' is not supported")
    assert "cross-attention layers caching image K/V, not per-token K/V" in message
    assert "(cross_attention_layers)" in message


# --- the same configs through transformers' own config classes ---------------------------------

ORACLE_CASES: dict[str, dict[str, Any]] = {
    "qwen3-no-head-dim": QWEN3_NO_HEAD_DIM,
    "qwen2-no-kv-heads": QWEN_NO_KV_HEADS,
    "qwen3-no-kv-heads": {**QWEN_NO_KV_HEADS, "model_type": "qwen3"},
    "nemotron_h-no-head-dim": NEMOTRON_NO_HEAD_DIM,
    "olmo_hybrid-derived-dims": {**OLMO_HYBRID, "num_key_value_heads": 2},
    "olmo_hybrid-mha": {**OLMO_HYBRID, "linear_num_key_heads": 2, "linear_key_head_dim": 8},
    "olmo_hybrid-3-layers": {
        **{k: v for k, v in OLMO_HYBRID.items() if k != "layer_types"},
        "num_hidden_layers": 3,
    },
    "qwen2-window-default": {
        "model_type": "qwen2",
        **TINY,
        "num_hidden_layers": 4,
        "num_key_value_heads": 2,
        "use_sliding_window": True,
        "max_window_layers": 2,
    },
    "qwen3-window-default": {
        "model_type": "qwen3",
        **TINY,
        "num_hidden_layers": 4,
        "num_key_value_heads": 2,
        "use_sliding_window": True,
        "max_window_layers": 3,
    },
    "llama4-null-chunk": {
        "model_type": "llama4_text",
        **TINY,
        "num_hidden_layers": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "attention_chunk_size": None,
    },
}


@pytest.mark.parametrize("case", sorted(ORACLE_CASES))
def test_matches_the_transformers_config_class(case: str) -> None:
    transformers = pytest.importorskip("transformers")
    cache_utils = pytest.importorskip("transformers.cache_utils")
    raw = ORACLE_CASES[case]
    kwargs = {k: v for k, v in raw.items() if k not in ("model_type", "dtype", "torch_dtype")}
    hf = transformers.AutoConfig.for_model(raw["model_type"], **kwargs)
    hf_types, hf_kwargs = cache_utils.get_layer_types_and_kwargs(hf)
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    spec = spec_from_config(raw)
    assert [layer.layer_type for layer in spec.layers] == list(hf_types)
    for layer, hf_kw in zip(spec.layers, hf_kwargs, strict=True):
        for cache in layer.caches:
            if isinstance(cache, AttentionSpec):
                assert (cache.num_kv_heads, cache.head_dim) == (hf.num_key_value_heads, head_dim)
                window = cache.window if isinstance(cache, SlidingWindowSpec) else None
                assert window == hf_kw.get("sliding_window")
            elif raw["model_type"] == "olmo_hybrid":
                assert isinstance(cache, StateSpec)
                hk, hv = hf.linear_num_key_heads, hf.linear_num_value_heads
                dk, dv = hf.linear_key_head_dim, hf.linear_value_head_dim
                assert state_shapes(cache)["recurrent"][0] == (hv, dk, dv)
                assert state_shapes(cache)["conv"][0] == (2 * hk * dk + hv * dv, 4)
