"""Acceptance test: our derived layer specs equal the caches transformers itself allocates.

For every supported architecture a tiny config is built with transformers' own config class,
a random-weight model runs one forward pass of ``SEQ`` tokens with ``use_cache=True``, and the
returned cache is compared layer by layer with ``spec_from_config(config.to_dict())``:

* attention layers: K/V tensors ``[1, kv_heads, kept_tokens, head_dim]``, dtype, and the
  sliding window the cache layer was built with;
* chunked layers: transformers keeps a sliding window of ``attention_chunk_size`` tokens (a
  superset of the chunk), so the window equals our ``chunk_size`` and KV heads / head dims
  are compared, not the token count;
* MLA layers: transformers caches the latent itself (``keys`` = normalised KV latent
  ``[1, 1, seq, kv_lora_rank]``, ``values`` = shared RoPE key ``[1, 1, seq, qk_rope_head_dim]``),
  so the latent dims compare directly;
* state layers: conv and recurrent tensors (batch dimension dropped), shapes and dtypes;
* layers storing nothing (MLP/MoE-only, KV-shared): transformers' ``DummyLayer``;
* the layer-type list equals transformers' ``get_layer_types_and_kwargs`` (``dummy`` for ours
  that store nothing).
"""

from __future__ import annotations

import copy
import functools
import logging
import warnings
from dataclasses import dataclass
from typing import Any

import pytest

from hybridkv.models import spec_from_config
from hybridkv.specs import (
    AttentionSpec,
    CacheSpec,
    ChunkedLocalSpec,
    MLASpec,
    ModelSpec,
    SlidingWindowSpec,
    StateSpec,
)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hybridkv.engine.probe import output_cache  # noqa: E402

cache_utils = pytest.importorskip("transformers.cache_utils")

SEQ = 8
WINDOW = 4
TINY: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
    "max_position_embeddings": 256,
}
MLA_TINY: dict[str, Any] = {
    "num_key_value_heads": 4,
    "kv_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "moe_intermediate_size": 32,
}
MAMBA2_TINY: dict[str, Any] = {
    "mamba_n_heads": 8,
    "mamba_n_groups": 2,
    "mamba_d_state": 8,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "mamba_chunk_size": 4,
}

#: model_type -> tiny config overrides (transformers config-class keyword arguments).
CASES: dict[str, dict[str, Any]] = {
    "llama": {"num_hidden_layers": 2},
    "mistral": {"num_hidden_layers": 2, "sliding_window": WINDOW},
    "mixtral": {"num_hidden_layers": 2, "sliding_window": WINDOW, "num_local_experts": 2},
    "qwen2": {
        "num_hidden_layers": 4,
        "use_sliding_window": True,
        "sliding_window": WINDOW,
        "max_window_layers": 2,
    },
    "qwen3": {"num_hidden_layers": 2, "head_dim": 32},
    "gemma2": {"num_hidden_layers": 4, "head_dim": 16, "sliding_window": WINDOW},
    "gemma3_text": {"num_hidden_layers": 7, "head_dim": 16, "sliding_window": WINDOW},
    "gemma4_text": {
        "num_hidden_layers": 8,
        "num_kv_shared_layers": 3,
        "layer_types": [
            *("sliding_attention", "sliding_attention", "full_attention"),
            *("sliding_attention", "full_attention", "sliding_attention"),
            *("sliding_attention", "full_attention"),
        ],
        "head_dim": 16,
        "global_head_dim": 32,
        "num_global_key_value_heads": 1,
        "attention_k_eq_v": True,
        "sliding_window": WINDOW,
        "hidden_size_per_layer_input": 8,
        "vocab_size_per_layer_input": 128,
    },
    "cohere2": {"num_hidden_layers": 4, "sliding_window": WINDOW},
    "olmo3": {"num_hidden_layers": 4, "sliding_window": WINDOW},
    "gpt_oss": {
        "num_hidden_layers": 4,
        "head_dim": 16,
        "sliding_window": WINDOW,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
    },
    "llama4_text": {
        "num_hidden_layers": 4,
        "head_dim": 16,
        "attention_chunk_size": WINDOW,
        "num_local_experts": 2,
        "intermediate_size_mlp": 128,
    },
    "qwen3_next": {
        "num_hidden_layers": 4,
        "head_dim": 16,
        "linear_key_head_dim": 8,
        "linear_value_head_dim": 16,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32,
    },
    "qwen3_5_text": {
        "num_hidden_layers": 4,
        "head_dim": 16,
        "linear_key_head_dim": 8,
        "linear_value_head_dim": 16,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
    },
    "olmo_hybrid": {
        "num_hidden_layers": 4,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 8,
        "linear_value_head_dim": 16,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"],
        "pad_token_id": 0,
    },
    "jamba": {
        "num_hidden_layers": 4,
        "attn_layer_period": 2,
        "attn_layer_offset": 1,
        "num_experts": 2,
        "expert_layer_period": 2,
        "expert_layer_offset": 1,
        "mamba_d_state": 8,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
        "use_mamba_kernels": False,
    },
    "bamba": {"num_hidden_layers": 4, "attn_layer_indices": [1, 3], **MAMBA2_TINY},
    "granitemoehybrid": {
        "num_hidden_layers": 4,
        "layer_types": ["mamba", "attention", "mamba", "attention"],
        "num_local_experts": 2,
        "num_experts_per_tok": 1,
        "shared_intermediate_size": 32,
        **MAMBA2_TINY,
    },
    "nemotron_h": {
        "hybrid_override_pattern": "M-M*-E",
        "head_dim": 16,
        "mamba_num_heads": 8,
        "mamba_head_dim": 16,
        "n_groups": 2,
        "ssm_state_size": 8,
        "conv_kernel": 4,
        "chunk_size": 4,
        "n_routed_experts": 2,
        "num_experts_per_tok": 1,
        "moe_intermediate_size": 32,
        "moe_shared_expert_intermediate_size": 32,
    },
    "falcon_h1": {"num_hidden_layers": 2, "mamba_d_ssm": 128, **MAMBA2_TINY},
    "zamba2": {
        "num_hidden_layers": 5,
        "layers_block_type": ["mamba", "hybrid", "mamba", "hybrid", "mamba"],
        "mamba_d_state": 8,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
        "mamba_ngroups": 2,
        "n_mamba_heads": 8,
        "chunk_size": 4,
        "num_mem_blocks": 2,
    },
    "lfm2": {"num_hidden_layers": 4, "full_attn_idxs": [1, 3], "conv_L_cache": 3},
    "deepseek_v2": {
        "num_hidden_layers": 2,
        "q_lora_rank": None,
        "n_routed_experts": 2,
        "num_experts_per_tok": 1,
        "n_shared_experts": 1,
        **MLA_TINY,
    },
    "deepseek_v3": {
        "num_hidden_layers": 2,
        "q_lora_rank": 16,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "n_group": 2,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        **MLA_TINY,
    },
    "kimi_linear": {
        "num_hidden_layers": 4,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "q_lora_rank": None,
        "num_experts": 4,
        "num_experts_per_token": 2,
        "linear_attn_config": {
            "full_attn_layers": [2, 4],
            "kda_layers": [1, 3],
            "head_dim": 8,
            "num_heads": 4,
            "short_conv_kernel_size": 4,
        },
        **MLA_TINY,
    },
}

#: Architectures with recurrent state, also checked in bfloat16 (state dtype rules).
STATE_CASES = [
    "qwen3_next",
    "qwen3_5_text",
    "olmo_hybrid",
    "jamba",
    "bamba",
    "granitemoehybrid",
    "nemotron_h",
    "falcon_h1",
    "zamba2",
    "lfm2",
    "kimi_linear",
]


@dataclass(frozen=True)
class Observed:
    """What transformers allocated for one tiny model."""

    config: Any
    config_dict: dict[str, Any]
    layers: list[Any]


@functools.cache
def observe(model_type: str, dtype_name: str) -> Observed:
    """Build the tiny model once per (architecture, dtype) and run one cached forward pass."""
    config = transformers.AutoConfig.for_model(model_type, **{**TINY, **CASES[model_type]})
    config_dict = copy.deepcopy(config.to_dict())
    torch.manual_seed(0)
    dtype = getattr(torch, dtype_name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        previous = logging.getLogger("transformers").level
        logging.getLogger("transformers").setLevel(logging.ERROR)
        try:
            model = transformers.AutoModelForCausalLM.from_config(
                copy.deepcopy(config), dtype=dtype
            )
            model.eval()
            ids = torch.randint(0, TINY["vocab_size"], (1, SEQ))
            with torch.no_grad():
                out = model(input_ids=ids, position_ids=torch.arange(SEQ)[None], use_cache=True)
        finally:
            logging.getLogger("transformers").setLevel(previous)
    config_dict["dtype"] = dtype_name
    return Observed(config=config, config_dict=config_dict, layers=list(output_cache(out).layers))


def _dtype_name(tensor: Any) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def _check_attention(i: int, spec: AttentionSpec, layer: Any) -> None:
    keys, values = layer.keys, layer.values
    assert keys is not None and values is not None, f"layer {i}: transformers stored no KV"
    assert keys.shape[1] == spec.num_kv_heads and keys.shape[3] == spec.head_dim, i
    assert values.shape[1] == spec.num_kv_heads and values.shape[3] == spec.v_dim, i
    assert _dtype_name(keys) == spec.dtype.value == _dtype_name(values), i
    if isinstance(spec, ChunkedLocalSpec):
        assert layer.sliding_window == spec.chunk_size, i
        return
    kept = sum(len(r) for r in spec.kept_tokens(SEQ))
    assert keys.shape[2] == kept == values.shape[2], f"layer {i}: tokens kept"
    if isinstance(spec, SlidingWindowSpec):
        assert layer.sliding_window == spec.window, i
    else:
        assert getattr(layer, "sliding_window", None) is None, i


def _check_mla(i: int, spec: MLASpec, layer: Any) -> None:
    assert tuple(layer.keys.shape) == (1, 1, SEQ, spec.kv_lora_rank), i
    assert tuple(layer.values.shape) == (1, 1, SEQ, spec.qk_rope_head_dim), i
    assert _dtype_name(layer.keys) == spec.dtype.value, i


def _check_state(i: int, spec: StateSpec, layer: Any) -> None:
    assert layer.number_of_states == 1, i
    conv, *recurrent = spec.tensors
    observed_conv = layer.conv_states[0]
    assert tuple(observed_conv.shape) == (1, *conv.shape), f"layer {i}: conv state shape"
    assert _dtype_name(observed_conv) == conv.dtype.value, f"layer {i}: conv state dtype"
    observed_rec = layer.recurrent_states[0]
    if not recurrent:
        assert observed_rec is None, f"layer {i}: unexpected recurrent state"
        return
    (rec,) = recurrent
    assert tuple(observed_rec.shape) == (1, *rec.shape), f"layer {i}: recurrent state shape"
    assert _dtype_name(observed_rec) == rec.dtype.value, f"layer {i}: recurrent state dtype"


def _check_cache(i: int, spec: CacheSpec, layer: Any) -> None:
    if isinstance(spec, AttentionSpec):
        _check_attention(i, spec, layer)
    elif isinstance(spec, MLASpec):
        _check_mla(i, spec, layer)
    elif isinstance(spec, StateSpec):
        _check_state(i, spec, layer)
    else:
        raise AssertionError(f"layer {i}: unexpected spec {spec!r}")


def compare(spec: ModelSpec, observed: Observed) -> None:
    """Assert ``spec`` describes exactly the caches in ``observed`` (see the module docstring)."""
    assert spec.num_layers == len(observed.layers)
    text_config = observed.config.get_text_config(decoder=True)
    hf_types, hf_kwargs = cache_utils.get_layer_types_and_kwargs(text_config)
    ours = ["dummy" if layer.stores_nothing else layer.layer_type for layer in spec.layers]
    assert ours == list(hf_types)
    for layer_spec, layer, kwargs in zip(spec.layers, observed.layers, hf_kwargs, strict=True):
        i = layer_spec.index
        if layer_spec.stores_nothing:
            assert type(layer).__name__ == "DummyLayer", i
            continue
        assert type(layer).__name__ != "DummyLayer", i
        for cache in layer_spec.caches:
            _check_cache(i, cache, layer)
        windows = [c.window for c in layer_spec.caches if isinstance(c, SlidingWindowSpec)]
        if windows:
            assert kwargs.get("sliding_window") == windows[0], i


@pytest.mark.parametrize("model_type", sorted(CASES))
def test_specs_match_transformers_cache_fp32(model_type: str) -> None:
    observed = observe(model_type, "float32")
    spec = spec_from_config(observed.config_dict)
    assert spec.model_type == model_type
    compare(spec, observed)


@pytest.mark.parametrize("model_type", STATE_CASES)
def test_state_dtypes_match_transformers_bf16(model_type: str) -> None:
    observed = observe(model_type, "bfloat16")
    spec = spec_from_config(observed.config_dict)
    compare(spec, observed)
    states = [c for _, _, c in spec.entries() if isinstance(c, StateSpec)]
    assert states
    for state in states:
        assert state.tensors[0].dtype.value == "bfloat16"  # conv: model dtype
        assert all(t.dtype.value == "float32" for t in state.tensors[1:])  # recurrent: fp32


def test_gemma4_kv_shared_layers_read_the_last_producer_of_their_type() -> None:
    observed = observe("gemma4_text", "float32")
    spec = spec_from_config(observed.config_dict)
    sources = {
        layer.index: layer.caches[0].source_layer for layer in spec.layers if layer.stores_nothing
    }
    assert sources == {5: 3, 6: 3, 7: 4}
    assert observed.config.kv_sharing_modes == [None, None, None, "store", "store"] + ["reuse"] * 3


@pytest.mark.parametrize(
    ("wrapper", "text_type"),
    [
        ("Gemma3Config", "gemma3_text"),
        ("Gemma4Config", "gemma4_text"),
        ("Llama4Config", "llama4_text"),
    ],
)
def test_wrapper_config_derives_like_its_text_config(wrapper: str, text_type: str) -> None:
    text = transformers.AutoConfig.for_model(text_type, **{**TINY, **CASES[text_type]})
    config = getattr(transformers, wrapper)(text_config=text.to_dict())
    from_wrapper = spec_from_config(config.to_dict())
    from_text = spec_from_config(text.to_dict())
    assert from_wrapper.layers == from_text.layers
    assert from_wrapper.model_type == text_type
