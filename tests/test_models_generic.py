"""Architectures without a registry entry, derived from shared config fields, checked against
the caches transformers itself allocates (the harness of ``test_models_transformers``).

``GENERIC`` lists the decoder-only text architectures transformers ships that hybridkv
derives generically; with the registry's own (``test_models_transformers.CASES``) they make
the architecture list this project is checked on.
"""

from __future__ import annotations

import copy
import functools
import logging
import warnings
from typing import Any

import pytest

from hybridkv.errors import UnsupportedModelTypeError
from hybridkv.models import spec_from_config, supported_model_types
from hybridkv.specs import CacheKind, FullAttentionSpec, SlidingWindowSpec

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hybridkv.engine.probe import output_cache  # noqa: E402

harness = pytest.importorskip("test_models_transformers")

#: Decoder-only text architectures derived generically (no registry entry).
GENERIC = [
    "afmoe",
    "apertus",
    "arcee",
    "aria_text",
    "beam",
    "biogpt",
    "bitnet",
    "cohere",
    "cohere2_moe",
    "cwm",
    "diffllama",
    "doge",
    "ernie4_5",
    "ernie4_5_moe",
    "exaone4",
    "exaone_moe",
    "flex_olmo",
    "flint",
    "gemma",
    "glm",
    "glm4",
    "glm4_moe",
    "gpt_neox",
    "gpt_neox_japanese",
    "granite",
    "granite_swa",
    "granitemoe",
    "granitemoe_swa",
    "granitemoeshared",
    "helium",
    "hrm_text",
    "hunyuan_v1_dense",
    "hunyuan_v1_moe",
    "hy_v3",
    "hyperclovax",
    "internlm3",
    "iquestcoder",
    "jais2",
    "kolibri1",
    "laguna",
    "mellum",
    "minimax_m2",
    "ministral",
    "ministral3",
    "nanochat",
    "nemotron",
    "olmo",
    "olmo2",
    "olmoe",
    "opt",
    "persimmon",
    "phi",
    "phi3",
    "phimoe",
    "qwen2_moe",
    "qwen3_moe",
    "seed_oss",
    "smollm3",
    "solar_open",
    "stablelm",
    "starcoder2",
    "vaultgemma",
]

_SMALL: dict[str, Any] = {
    **harness.TINY,
    "num_hidden_layers": 3,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "num_experts_per_tok": 2,
    "pad_token_id": 0,
}
_ROPE = {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "head_dim": 16}
#: Where a config class's own defaults do not build (no RoPE base) or hide a head size.
_OVERRIDES: dict[str, dict[str, Any]] = {
    "ministral": _ROPE,
    "hunyuan_v1_dense": _ROPE,
    "hunyuan_v1_moe": _ROPE,
    "helium": {"head_dim": 16},
}


@functools.cache
def _observe(model_type: str) -> Any:
    """A tiny instance (only fields the config class has are shrunk), one cached forward."""
    base = transformers.AutoConfig.for_model(model_type).to_dict()
    small = {k: v for k, v in _SMALL.items() if k in base}
    config = transformers.AutoConfig.for_model(
        model_type, **small, **_OVERRIDES.get(model_type, {})
    )
    config_dict = copy.deepcopy(config.to_dict())
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        previous = logging.getLogger("transformers").level
        logging.getLogger("transformers").setLevel(logging.ERROR)
        try:
            model = transformers.AutoModelForCausalLM.from_config(
                copy.deepcopy(config), dtype=torch.float32
            ).eval()
            ids = torch.randint(1, 64, (1, harness.SEQ))
            with torch.no_grad():
                out = model(
                    input_ids=ids, position_ids=torch.arange(harness.SEQ)[None], use_cache=True
                )
        finally:
            logging.getLogger("transformers").setLevel(previous)
    config_dict["dtype"] = "float32"
    return harness.Observed(
        config=config, config_dict=config_dict, layers=list(output_cache(out).layers)
    )


@pytest.mark.parametrize("model_type", GENERIC)
def test_generic_derivation_matches_transformers(model_type: str) -> None:
    observed = _observe(model_type)
    spec = spec_from_config(copy.deepcopy(observed.config_dict))
    assert any("derived generically" in note for note in spec.notes)
    harness.compare(spec, observed)


def test_the_architecture_list() -> None:
    """At least 40 architectures, every one a causal LM transformers ships, none twice."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    registry = set(harness.CASES)
    assert registry <= set(supported_model_types())
    assert not registry & set(GENERIC)
    assert not set(GENERIC) & set(supported_model_types())
    shipped = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    assert set(GENERIC) <= shipped
    assert len(registry | set(GENERIC)) >= 40


def test_raw_config_needs_no_transformers() -> None:
    # Qwen3-30B-A3B's published fields (qwen3_moe: no registry entry)
    config = {
        "model_type": "qwen3_moe",
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "hidden_size": 2048,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_position_embeddings": 40960,
        "torch_dtype": "bfloat16",
    }
    spec = spec_from_config(config)
    assert spec.num_layers == 48 and spec.max_position_embeddings == 40960
    assert {layer.caches[0] for layer in spec.layers} == {
        FullAttentionSpec(num_kv_heads=4, head_dim=128, dtype=spec.layers[0].caches[0].dtype)
    }
    assert spec.layers[0].caches[0].bytes_per_token == 2 * 4 * 128 * 2
    assert spec.notes[0].startswith("qwen3_moe: no registry entry; derived generically")
    # ministral-style explicit layer types, with a window
    mixed = {
        "model_type": "ministral",
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "hidden_size": 512,
        "sliding_window": 1024,
        "layer_types": ["sliding_attention", "full_attention", "moe", "full_attention"],
    }
    spec = spec_from_config(mixed)
    kinds = [layer.caches[0].kind for layer in spec.layers]
    assert kinds == [CacheKind.SLIDING, CacheKind.FULL, CacheKind.NONE, CacheKind.FULL]
    assert spec.layers[0].caches[0] == SlidingWindowSpec(
        num_kv_heads=2, head_dim=64, dtype=spec.layers[0].caches[0].dtype, window=1024
    )


@pytest.mark.parametrize(
    ("extra", "reason"),
    [
        ({"is_encoder_decoder": True}, "it is an encoder-decoder model"),
        ({"kv_lora_rank": 512}, "it has fields of multi-head latent attention (kv_lora_rank)"),
        ({"mamba_d_state": 16}, "it has fields of Mamba state (mamba_d_state)"),
        ({"type_vocab_size": 2}, "an encoder's token-type embeddings"),
        ({"num_kv_heads": 8}, "a KV head count under its own name"),
        ({"num_kv_shared_layers": 0}, "KV sharing between layers"),
        ({"layer_types": ["full_attention", "linear_attention"]}, "layer_types name linear"),
    ],
)
def test_refusals_say_why(extra: dict[str, Any], reason: str) -> None:
    config = {
        "model_type": "newarch",
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "hidden_size": 64,
        **extra,
    }
    with pytest.raises(UnsupportedModelTypeError) as info:
        spec_from_config(config)
    message = str(info.value)
    assert message.startswith("config.model_type: 'newarch' is not supported: it has no registry")
    assert reason in message
