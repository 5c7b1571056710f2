"""Per-architecture derivation: exact layer specs of real catalog models and family rules."""

from __future__ import annotations

from typing import Any

from hybridkv.models import catalog_config, resolve_model, spec_from_config
from hybridkv.specs import (
    ChunkedLocalSpec,
    DType,
    FullAttentionSpec,
    MLASpec,
    ModelSpec,
    NoCacheReason,
    NoCacheSpec,
    SlidingWindowSpec,
    StateMixer,
    StateSpec,
)

BF16, FP32 = DType.BF16, DType.FP32


def state_shapes(spec: StateSpec) -> dict[str, tuple[tuple[int, ...], str]]:
    return {t.name: (t.shape, t.dtype.value) for t in spec.tensors}


def layers_of(spec: ModelSpec, layer_type: str) -> list[int]:
    return [layer.index for layer in spec.layers if layer.layer_type == layer_type]


def llama_config(**overrides: Any) -> dict[str, Any]:
    return {
        "model_type": "llama",
        "num_hidden_layers": 2,
        "hidden_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        **overrides,
    }


# --- real models: known facts ----------------------------------------------------------------


def test_gpt_oss_20b() -> None:
    spec = resolve_model("gpt-oss-20b")
    assert spec.num_layers == 24
    assert spec.max_position_embeddings == 131072
    assert layers_of(spec, "sliding_attention") == list(range(0, 24, 2))
    assert layers_of(spec, "full_attention") == list(range(1, 24, 2))
    assert spec.layers[0].caches == (
        SlidingWindowSpec(num_kv_heads=8, head_dim=64, dtype=BF16, window=128, learned_sinks=True),
    )
    assert spec.layers[1].caches == (
        FullAttentionSpec(num_kv_heads=8, head_dim=64, dtype=BF16, learned_sinks=True),
    )
    assert spec.layers[1].caches[0].bytes_per_token == 2 * 8 * 64 * 2 == 2048
    # At 10,000 tokens: 12 full layers keep everything, 12 sliding layers keep 128 tokens.
    assert spec.resident_bytes(10_000) == 12 * 10_000 * 2048 + 12 * 128 * 2048


def test_llama_3_1_8b_total_bytes_per_token() -> None:
    spec = resolve_model("Llama-3.1-8B")
    assert spec.num_layers == 32
    assert {layer.caches[0] for layer in spec.layers} == {
        FullAttentionSpec(num_kv_heads=8, head_dim=128, dtype=BF16)
    }
    assert spec.full_attention_equivalent_bytes_per_token() == 32 * 4096 == 131072


def test_deepseek_v3_mla() -> None:
    spec = resolve_model("DeepSeek-V3")
    assert spec.num_layers == 61
    assert {layer.caches[0] for layer in spec.layers} == {
        MLASpec(kv_lora_rank=512, qk_rope_head_dim=64, dtype=BF16)
    }
    assert spec.layers[0].caches[0].bytes_per_token == (512 + 64) * 2
    assert spec.full_attention_equivalent_bytes_per_token() == 61 * 1152


def test_qwen3_next() -> None:
    spec = resolve_model("Qwen3-Next-80B-A3B")
    assert layers_of(spec, "full_attention") == list(range(3, 48, 4))
    assert len(layers_of(spec, "linear_attention")) == 36
    gdn = spec.layers[0].caches[0]
    assert isinstance(gdn, StateSpec) and gdn.mixer is StateMixer.GATED_DELTANET
    assert state_shapes(gdn) == {
        "conv": ((8192, 4), "bfloat16"),
        "recurrent": ((32, 128, 128), "float32"),
    }
    assert gdn.state_bytes == 8192 * 4 * 2 + 32 * 128 * 128 * 4
    assert spec.layers[3].caches == (FullAttentionSpec(num_kv_heads=2, head_dim=256, dtype=BF16),)


def test_jamba_mamba1() -> None:
    spec = resolve_model("Jamba-v0.1")
    assert layers_of(spec, "full_attention") == [4, 12, 20, 28]
    mamba = spec.layers[0].caches[0]
    assert isinstance(mamba, StateSpec) and mamba.mixer is StateMixer.MAMBA1
    assert state_shapes(mamba) == {"conv": ((8192, 4), "bfloat16"), "ssm": ((8192, 16), "float32")}
    assert spec.layers[4].caches == (FullAttentionSpec(num_kv_heads=8, head_dim=128, dtype=BF16),)


def test_nemotron_h_pattern() -> None:
    spec = resolve_model("Nemotron-H-8B")
    assert spec.num_layers == 52
    assert layers_of(spec, "full_attention") == [7, 18, 29, 40]
    assert len(layers_of(spec, "linear_attention")) == 24
    assert len(layers_of(spec, "mlp")) == 24
    assert spec.layers[1].caches == (NoCacheSpec(),)
    mamba = spec.layers[0].caches[0]
    assert isinstance(mamba, StateSpec) and mamba.mixer is StateMixer.MAMBA2
    # conv channels: 128 heads * 64 + 2 * 8 groups * 128 state
    assert state_shapes(mamba) == {
        "conv": ((10240, 4), "bfloat16"),
        "ssm": ((128, 64, 128), "float32"),
    }
    assert spec.layers[7].caches == (FullAttentionSpec(num_kv_heads=8, head_dim=128, dtype=BF16),)


def test_falcon_h1_layers_carry_attention_and_mamba2() -> None:
    spec = resolve_model("Falcon-H1-7B")
    assert spec.num_layers == 44
    attention, mamba = spec.layers[0].caches
    assert attention == FullAttentionSpec(num_kv_heads=2, head_dim=128, dtype=BF16)
    assert isinstance(mamba, StateSpec)
    assert state_shapes(mamba) == {
        "conv": ((3072 + 2 * 256, 4), "bfloat16"),
        "ssm": ((24, 128, 256), "float32"),
    }
    assert [(e.layer, e.slot) for e in spec.entries()][:3] == [(0, 0), (0, 1), (1, 0)]


def test_lfm2_short_conv() -> None:
    spec = resolve_model("LFM2-1.2B")
    assert layers_of(spec, "full_attention") == [2, 5, 8, 10, 12, 14]
    conv = spec.layers[0].caches[0]
    assert isinstance(conv, StateSpec) and conv.mixer is StateMixer.SHORT_CONV
    assert state_shapes(conv) == {"conv": ((2048, 3), "bfloat16")}
    assert spec.layers[2].caches == (FullAttentionSpec(num_kv_heads=8, head_dim=64, dtype=BF16),)


def test_kimi_linear_kda_and_mla() -> None:
    spec = resolve_model("Kimi-Linear-48B-A3B")
    assert layers_of(spec, "full_attention") == [3, 7, 11, 15, 19, 23, 26]
    kda = spec.layers[0].caches[0]
    assert isinstance(kda, StateSpec) and kda.mixer is StateMixer.KDA
    assert state_shapes(kda) == {
        "conv": ((12288, 4), "bfloat16"),
        "recurrent": ((32, 128, 128), "float32"),
    }
    assert spec.layers[3].caches == (MLASpec(kv_lora_rank=512, qk_rope_head_dim=64, dtype=BF16),)


def test_gemma3_wrapper_uses_text_config_and_defaults() -> None:
    spec = resolve_model("gemma-3-4b")  # text_config omits the head counts: defaults 8/4/256
    assert spec.model_type == "gemma3_text"
    assert spec.num_layers == 34
    assert layers_of(spec, "full_attention") == [5, 11, 17, 23, 29]
    assert spec.layers[0].caches == (
        SlidingWindowSpec(num_kv_heads=4, head_dim=256, dtype=BF16, window=1024),
    )
    assert resolve_model("gemma-3-27b").layers[5].caches[0].bytes_per_token == 2 * 16 * 128 * 2


def test_mistral_and_qwen2() -> None:
    mistral = resolve_model("Mistral-7B-v0.1")
    assert {layer.caches[0] for layer in mistral.layers} == {
        SlidingWindowSpec(num_kv_heads=8, head_dim=128, dtype=BF16, window=4096)
    }
    qwen = resolve_model("Qwen2.5-7B")  # sliding_window set but use_sliding_window false
    assert {layer.caches[0] for layer in qwen.layers} == {
        FullAttentionSpec(num_kv_heads=4, head_dim=128, dtype=BF16)
    }


# --- per-architecture rules ------------------------------------------------------------------


def test_explicit_null_window_overrides_the_default() -> None:
    cfg = llama_config(model_type="mistral", sliding_window=None)
    assert {layer.layer_type for layer in spec_from_config(cfg).layers} == {"full_attention"}
    default = spec_from_config({k: v for k, v in cfg.items() if k != "sliding_window"})
    assert default.layers[0].caches[0] == SlidingWindowSpec(
        num_kv_heads=2, head_dim=64, dtype=BF16, window=4096
    )


def test_qwen_max_window_layers() -> None:
    cfg = llama_config(
        model_type="qwen3",
        num_hidden_layers=4,
        use_sliding_window=True,
        sliding_window=16,
        max_window_layers=2,
    )
    spec = spec_from_config(cfg)
    assert [layer.layer_type for layer in spec.layers] == [
        "full_attention",
        "full_attention",
        "sliding_attention",
        "sliding_attention",
    ]


def test_cohere2_head_dim_is_hidden_over_heads() -> None:
    cfg = llama_config(model_type="cohere2", num_hidden_layers=4, head_dim=999, sliding_window=8)
    spec = spec_from_config(cfg)
    assert layers_of(spec, "full_attention") == [3]
    assert {layer.caches[0].head_dim for layer in spec.layers} == {64}  # type: ignore[union-attr]


def test_llama4_chunked_layers() -> None:
    cfg = llama_config(model_type="llama4_text", num_hidden_layers=8, head_dim=128)
    spec = spec_from_config(cfg)
    assert layers_of(spec, "full_attention") == [3, 7]
    assert spec.layers[0].caches == (
        ChunkedLocalSpec(num_kv_heads=2, head_dim=128, dtype=BF16, chunk_size=8192),
    )


def test_gemma4_from_published_style_fields() -> None:
    cfg = llama_config(
        model_type="gemma4_text",
        num_hidden_layers=8,
        head_dim=256,
        global_head_dim=512,
        num_key_value_heads=4,
        num_global_key_value_heads=1,
        attention_k_eq_v=True,
        sliding_window=512,
        num_kv_shared_layers=2,
    )
    spec = spec_from_config(cfg)
    # default pattern S S S S S F S S, the last layer forced full: S S S S S F S F
    assert layers_of(spec, "full_attention") == [5, 7]
    assert spec.layers[0].caches == (
        SlidingWindowSpec(num_kv_heads=4, head_dim=256, dtype=BF16, window=512),
    )
    assert spec.layers[5].caches == (FullAttentionSpec(num_kv_heads=1, head_dim=512, dtype=BF16),)
    assert spec.layers[6].caches == (NoCacheSpec(reason=NoCacheReason.KV_SHARED, source_layer=4),)
    assert spec.layers[7].caches == (NoCacheSpec(reason=NoCacheReason.KV_SHARED, source_layer=5),)


def test_gemma4_shared_layers_and_global_head_dim() -> None:
    cfg = llama_config(
        model_type="gemma4_text",
        num_hidden_layers=6,
        layer_types=["sliding_attention", "full_attention"] * 3,
        head_dim=64,
        global_head_dim=128,
        num_kv_shared_layers=2,
        sliding_window=16,
    )
    spec = spec_from_config(cfg)
    assert spec.layers[1].caches == (FullAttentionSpec(num_kv_heads=2, head_dim=128, dtype=BF16),)
    assert spec.layers[4].caches == (NoCacheSpec(reason=NoCacheReason.KV_SHARED, source_layer=2),)
    assert spec.layers[5].caches == (NoCacheSpec(reason=NoCacheReason.KV_SHARED, source_layer=3),)


def test_qwen3_5_wrapper_and_ssm_dtype_flag() -> None:
    text = catalog_config("Qwen3-Next-80B-A3B")
    del text["model_type"]
    text["mamba_ssm_dtype"] = "bfloat16"
    spec = spec_from_config({"model_type": "qwen3_5", "text_config": text})
    assert spec.model_type == "qwen3_5_text"
    assert state_shapes(spec.layers[0].caches[0]) == {  # type: ignore[arg-type]
        "conv": ((8192, 4), "bfloat16"),
        "recurrent": ((32, 128, 128), "bfloat16"),
    }


def test_kimi_default_layer_types_without_linear_attn_config() -> None:
    cfg = llama_config(model_type="kimi_linear", num_hidden_layers=9, num_attention_heads=4)
    spec = spec_from_config(cfg)
    assert layers_of(spec, "full_attention") == [4, 8]
