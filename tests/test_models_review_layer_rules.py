"""Generic-path layer rules, class defaults and refusals an outside review found wrong.

Configs without ``layer_types`` (as older transformers saved them, or as written by hand) were
planned with every layer sliding whenever ``sliding_window`` was set, though transformers'
config classes build interleaved patterns (exaone4, dots1, qwen2_moe, ...) or all-full ones
(mellum, laguna); absent ``head_dim`` / ``num_key_value_heads`` took the shared rule instead of
the class default (ministral3, qwen3_moe); minimax was planned as all full attention.  Also:
nemotron_h follows the pattern's length, the mistral3 wrapper's text config defaults to
mistral, and the gemma3n refusal names its field once.

The first tests need no transformers and assert exact specs and messages; the last ones
re-derive every handled model type through the installed transformers config classes.
"""

from __future__ import annotations

import copy
import logging
import warnings
from typing import Any

import pytest

from hybridkv.errors import ConfigError, UnsupportedModelTypeError
from hybridkv.models import spec_from_config, supported_model_types
from hybridkv.models.config import WRAPPER_TEXT_TYPES
from hybridkv.models.generic_rules import GENERIC_TYPES, REFUSED_TYPES
from hybridkv.specs import (
    AttentionSpec,
    DType,
    FullAttentionSpec,
    ModelSpec,
    SlidingWindowSpec,
)

BF16 = DType.BF16
BASE: dict[str, Any] = {
    "hidden_size": 512,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 128,
    "max_position_embeddings": 4096,
    "torch_dtype": "bfloat16",
}


def pattern(spec: ModelSpec) -> str:
    """One letter per layer: S sliding, F full, C chunked, - no cache."""
    letters = {"sliding_attention": "S", "full_attention": "F", "chunked_attention": "C"}
    return "".join(
        "-" if layer.stores_nothing else letters.get(layer.layer_type, "?") for layer in spec.layers
    )


def geometry(spec: ModelSpec) -> set[tuple[str, int, int, int | None]]:
    """(class, KV heads, head size, window) of every attention cache."""
    out: set[tuple[str, int, int, int | None]] = set()
    for layer in spec.layers:
        for cache in layer.caches:
            if isinstance(cache, AttentionSpec):
                window = cache.window if isinstance(cache, SlidingWindowSpec) else None
                out.add((type(cache).__name__, cache.num_kv_heads, cache.head_dim, window))
    return out


# --- 1. layer kinds without layer_types follow the config class's own rule ---------------------

RULES: list[tuple[str, dict[str, Any], str]] = [
    # Exaone4Config: every sliding_window_pattern-th layer full
    ("exaone4", {"sliding_window": 16, "sliding_window_pattern": 4}, "SSSFSSSF"),
    ("exaone_moe", {"sliding_window": 16, "sliding_window_pattern": 2}, "SFSFSFSF"),
    ("exaone4", {"sliding_window": None, "sliding_window_pattern": 4}, "FFFFFFFF"),
    # Qwen2MoeConfig: odd-numbered layers below max_window_layers slide
    (
        "qwen2_moe",
        {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 5},
        "SFSFSFFF",
    ),
    (
        "qwen2_moe",
        {"use_sliding_window": False, "sliding_window": 16, "max_window_layers": 5},
        "FFFFFFFF",
    ),
    # AfmoeConfig: every global_attn_every_n_layers-th layer full
    ("afmoe", {"sliding_window": 16, "global_attn_every_n_layers": 4}, "SSSFSSSF"),
    # CwmConfig, GraniteSwaConfig, GraniteMoeSwaConfig: layers 0 and 4 full
    ("cwm", {"sliding_window": 16}, "FSSSFSSS"),
    ("granite_swa", {"sliding_window": 16}, "FSSSFSSS"),
    ("granitemoe_swa", {"sliding_window": 16}, "FSSSFSSS"),
    # VaultGemmaConfig: alternating, sliding first
    ("vaultgemma", {"sliding_window": 16}, "SFSFSFSF"),
    # Cohere2MoeConfig: two dense layers by the prefix pattern (2), the rest by 4, afresh
    (
        "cohere2_moe",
        {
            "sliding_window": 16,
            "first_k_dense_replace": 2,
            "prefix_dense_sliding_window_pattern": 2,
            "sliding_window_pattern": 4,
        },
        "SFSSSFSS",
    ),
    ("cohere2_moe", {"sliding_window": 16}, "SSSFSSSF"),
    # SmolLM3Config: with use_sliding_window the NoPE layers (every 4th) slide
    ("smollm3", {"use_sliding_window": True, "sliding_window": 16}, "FFFSFFFS"),
    ("smollm3", {"sliding_window": 16}, "FFFFFFFF"),
    # MellumConfig, LagunaConfig: every layer full despite the window
    ("mellum", {"sliding_window": 16}, "FFFFFFFF"),
    ("laguna", {"sliding_window": 16}, "FFFFFFFF"),
    # Dots1Config: layers from max_window_layers on slide
    ("dots1", {"sliding_window": 16, "max_window_layers": 6}, "FFFFFFSS"),
    ("dots1", {"sliding_window": None, "max_window_layers": 6}, "FFFFFFFF"),
    # BeamConfig: every sixth and the last full; FlintConfig; Kolibri1Config: every fifth
    ("beam", {"sliding_window": 16}, "SSSSSFSF"),
    ("flint", {"sliding_window": 16}, "FFSSSFSF"),
    ("kolibri1", {"sliding_window": 16}, "SSSSFSSS"),
    # classes whose every layer takes the window
    ("ministral", {"sliding_window": 16}, "SSSSSSSS"),
    ("phi3", {"sliding_window": 16}, "SSSSSSSS"),
    ("starcoder2", {"sliding_window": 16}, "SSSSSSSS"),
    ("qwen3_moe", {"use_sliding_window": True, "sliding_window": 16}, "SSSSSSSS"),
    ("qwen3_moe", {"sliding_window": 16}, "FFFFFFFF"),  # use_sliding_window defaults false
]


@pytest.mark.parametrize(("model_type", "extra", "expected"), RULES)
def test_layer_kinds_follow_the_config_class(
    model_type: str, extra: dict[str, Any], expected: str
) -> None:
    spec = spec_from_config({"model_type": model_type, **BASE, "num_hidden_layers": 8, **extra})
    assert pattern(spec) == expected
    want: set[tuple[str, int, int, int | None]] = set()
    if "F" in expected:
        want.add(("FullAttentionSpec", 2, 64, None))
    if "S" in expected:
        want.add(("SlidingWindowSpec", 2, 64, 16))
    assert geometry(spec) == want
    assert spec.notes[0].startswith(f"{model_type}: no registry entry; derived generically")


def test_exaone4_32b_without_layer_types() -> None:
    # EXAONE-4.0-32B's published fields, layer_types dropped: 3 sliding : 1 full, not all sliding
    config = {
        "model_type": "exaone4",
        "hidden_size": 5120,
        "num_attention_heads": 40,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "num_hidden_layers": 64,
        "sliding_window": 4096,
        "sliding_window_pattern": 4,
        "torch_dtype": "bfloat16",
    }
    spec = spec_from_config(config)
    assert pattern(spec) == "SSSF" * 16
    assert spec.layers[3].caches == (FullAttentionSpec(num_kv_heads=8, head_dim=128, dtype=BF16),)
    assert spec.layers[0].caches == (
        SlidingWindowSpec(num_kv_heads=8, head_dim=128, dtype=BF16, window=4096),
    )
    assert (
        "exaone4: the config has no layer_types; layer kinds follow transformers' exaone4 config "
        "class (every sliding_window_pattern-th layer full)"
    ) in spec.notes


def test_exaone4_string_pattern_is_refused() -> None:
    config = {
        "model_type": "exaone4",
        **BASE,
        "num_hidden_layers": 4,
        "sliding_window": 4096,
        "sliding_window_pattern": "LLLG",
    }
    with pytest.raises(ConfigError) as info:
        spec_from_config(config)
    assert str(info.value) == (
        "exaone4 config: field 'sliding_window_pattern' is 'LLLG', a string pattern that "
        "transformers' exaone4 config class cannot expand into layer kinds; add 'layer_types' "
        "to config.json (one of full_attention, sliding_attention per layer) or make "
        "'sliding_window_pattern' an integer n (every n-th layer full)"
    )
    # with layer_types the string is not read
    types = ["sliding_attention"] * 3 + ["full_attention"]
    assert pattern(spec_from_config({**config, "layer_types": types})) == "SSSF"


def test_exaone4_class_defaults_fill_absent_fields() -> None:
    # Exaone4Config: sliding_window 4096, pattern 4, num_key_value_heads 32
    config = {"model_type": "exaone4", "hidden_size": 2048, "num_attention_heads": 32}
    spec = spec_from_config({**config, "num_hidden_layers": 4})
    assert pattern(spec) == "SSSF"
    assert geometry(spec) == {
        ("FullAttentionSpec", 32, 64, None),
        ("SlidingWindowSpec", 32, 64, 4096),
    }


def test_hrm_text_without_num_layers_per_stack_is_refused() -> None:
    config = {"model_type": "hrm_text", **BASE, "num_hidden_layers": 4}
    with pytest.raises(ConfigError) as info:
        spec_from_config(config)
    assert str(info.value) == (
        "hrm_text config: field 'num_layers_per_stack' is missing, so transformers' "
        "HrmTextConfig reads num_hidden_layers=4 as the per-stack count and caches "
        "4 * H_cycles * (L_cycles + 1) attention calls; add 'num_layers_per_stack' (the "
        "per-stack count) to config.json, with num_hidden_layers the total, as transformers "
        "saves it"
    )
    spec = spec_from_config({**config, "num_layers_per_stack": 1})
    assert pattern(spec) == "FFFF"


# --- unknown model types: a window or pattern without layer_types is refused ------------------

UNKNOWN: dict[str, Any] = {"model_type": "newarch", **BASE, "num_hidden_layers": 4}


@pytest.mark.parametrize(
    ("extra", "found"),
    [
        ({"sliding_window": 4096}, "sliding_window=4096"),
        ({"sliding_window_pattern": "LLLG"}, "sliding_window_pattern='LLLG'"),
        (
            {"sliding_window": 512, "sliding_window_pattern": 4},
            "sliding_window=512, sliding_window_pattern=4",
        ),
        ({"global_attn_every_n_layers": 3}, "global_attn_every_n_layers=3"),
        ({"max_window_layers": 2}, "max_window_layers=2"),
        ({"no_rope_layer_interval": 4}, "no_rope_layer_interval=4"),
        ({"attention_chunk_size": 8192}, "attention_chunk_size=8192"),
        (
            {"use_sliding_window": False, "attention_chunk_size": 64},
            "attention_chunk_size=64",
        ),
    ],
)
def test_unknown_type_with_a_pattern_but_no_layer_types_is_refused(
    extra: dict[str, Any], found: str
) -> None:
    with pytest.raises(ConfigError) as info:
        spec_from_config({**UNKNOWN, **extra})
    assert str(info.value) == (
        f"newarch config: has {found} but no 'layer_types'; which layers this makes slide or "
        "chunk is up to transformers' newarch config class, and hybridkv has no rule for it; "
        "add 'layer_types' to config.json (one entry per layer: full_attention, "
        "sliding_attention or chunked_attention)"
    )
    # the fix the message names works
    types = ["sliding_attention", "full_attention"] * 2
    fixed = spec_from_config(
        {**UNKNOWN, **extra, "sliding_window": 32, "use_sliding_window": True, "layer_types": types}
    )
    assert pattern(fixed) == "SFSF"


def test_unknown_type_with_windows_switched_off_is_all_full() -> None:
    # Qwen-style fields: use_sliding_window false switches the window off in every class
    config = {
        **UNKNOWN,
        "use_sliding_window": False,
        "sliding_window": 32768,
        "max_window_layers": 2,
    }
    spec = spec_from_config(config)
    assert pattern(spec) == "FFFF"
    assert pattern(spec_from_config({**UNKNOWN, "sliding_window": None})) == "FFFF"


def test_table_type_with_a_chunk_size_but_no_layer_types_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"^phi3 config: has attention_chunk_size=64 but no"):
        spec_from_config(
            {"model_type": "phi3", **BASE, "num_hidden_layers": 2, "attention_chunk_size": 64}
        )


# --- 2. minimax: linear-attention layers -> refused, with and without layer_types --------------

MINIMAX: dict[str, Any] = {
    "model_type": "minimax",
    "hidden_size": 6144,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "num_hidden_layers": 80,
    "torch_dtype": "bfloat16",
}


@pytest.mark.parametrize("with_layer_types", [False, True])
def test_minimax_is_refused(with_layer_types: bool) -> None:
    config = dict(MINIMAX)
    if with_layer_types:
        config["layer_types"] = ["full_attention", "linear_attention"] * 40
    with pytest.raises(UnsupportedModelTypeError) as info:
        spec_from_config(config)
    message = str(info.value)
    assert message.startswith(
        "config.model_type: 'minimax' is not supported: it has no registry entry and cannot be "
        "derived from the shared attention fields (MiniMaxConfig makes every second layer "
        "'linear_attention' (lightning attention, a fixed-size per-request state of "
        "num_attention_heads x head_dim x head_dim), which hybridkv has no spec for; planning it "
        "as attention would be wrong); registered: "
    )


# --- 3. class defaults for absent fields -------------------------------------------------------


def test_ministral3_in_a_mistral3_wrapper_defaults_head_dim_to_128() -> None:
    # Ministral-3-3B-like: text_config without head_dim (hidden / heads would be 96)
    config = {
        "model_type": "mistral3",
        "torch_dtype": "bfloat16",
        "text_config": {
            "model_type": "ministral3",
            "hidden_size": 3072,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "num_hidden_layers": 4,
            "sliding_window": None,
        },
    }
    spec = spec_from_config(config)
    assert spec.model_type == "ministral3"
    assert {layer.caches for layer in spec.layers} == {
        (FullAttentionSpec(num_kv_heads=8, head_dim=128, dtype=BF16),)
    }
    assert (
        "ministral3: the config omits head_dim; transformers' class default used (head_dim=128)"
    ) in spec.notes


def test_qwen3_moe_without_num_key_value_heads_uses_the_class_default_4() -> None:
    config = {
        "model_type": "qwen3_moe",
        "hidden_size": 2048,
        "num_attention_heads": 32,
        "head_dim": 128,
        "num_hidden_layers": 2,
        "torch_dtype": "bfloat16",
    }
    spec = spec_from_config(config)
    assert {layer.caches for layer in spec.layers} == {
        (FullAttentionSpec(num_kv_heads=4, head_dim=128, dtype=BF16),)
    }
    assert (
        "qwen3_moe: the config omits num_key_value_heads; transformers' class default used "
        "(num_key_value_heads=4)"
    ) in spec.notes


# --- 4. nemotron_h: the pattern's length wins over num_hidden_layers ---------------------------


def test_nemotron_h_follows_the_pattern_length() -> None:
    config = {
        "model_type": "nemotron_h",
        "num_hidden_layers": 6,
        "hidden_size": 4096,
        "hybrid_override_pattern": "M-M*-E-",
    }
    spec = spec_from_config(config)
    assert [layer.layer_type for layer in spec.layers] == [
        "linear_attention",
        "mlp",
        "linear_attention",
        "full_attention",
        "mlp",
        "moe",
        "mlp",
    ]
    assert spec.layers[3].caches == (FullAttentionSpec(num_kv_heads=8, head_dim=128, dtype=BF16),)
    assert (
        "nemotron_h: num_hidden_layers=6 disagrees with the 7 entries of hybrid_override_pattern; "
        "7 layers derived (transformers' NemotronHConfig takes the length of "
        "hybrid_override_pattern and ignores num_hidden_layers)"
    ) in spec.notes
    with pytest.raises(ConfigError, match=r"field 'hybrid_override_pattern' is empty"):
        spec_from_config({**config, "hybrid_override_pattern": ""})


# --- 5. mistral3 wrapper: a text_config without model_type is mistral -------------------------


def test_mistral3_text_config_without_model_type_is_mistral() -> None:
    text = {
        "hidden_size": 5120,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "num_hidden_layers": 4,
        "head_dim": 128,
        "sliding_window": None,
    }
    spec = spec_from_config({"model_type": "mistral3", "text_config": text})
    assert spec.model_type == "mistral"
    assert {layer.caches for layer in spec.layers} == {
        (FullAttentionSpec(num_kv_heads=8, head_dim=128, dtype=BF16),)
    }
    # MistralConfig's default window (4096) when the text config omits it
    absent = {k: v for k, v in text.items() if k != "sliding_window"}
    windowed = spec_from_config({"model_type": "mistral3", "text_config": absent})
    assert pattern(windowed) == "SSSS"
    assert geometry(windowed) == {("SlidingWindowSpec", 8, 128, 4096)}


# --- 6. gemma3n: the refusal names num_kv_shared_layers once -----------------------------------


def test_gemma3n_refusal_names_its_field_once() -> None:
    config = {
        "model_type": "gemma3n_text",
        **BASE,
        "num_hidden_layers": 4,
        "num_kv_shared_layers": 2,
    }
    with pytest.raises(UnsupportedModelTypeError) as info:
        spec_from_config(config)
    message = str(info.value)
    assert "(it has fields of KV sharing between layers (num_kv_shared_layers)); " in message
    assert message.count("num_kv_shared_layers") == 1


# --- the same through transformers' own config classes -----------------------------------------

_SMALL: dict[str, Any] = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 10,
    "vocab_size": 512,
    "max_position_embeddings": 4096,
    "use_sliding_window": True,
    "sliding_window": 4,
    "max_window_layers": 5,
    "prefix_dense_sliding_window_pattern": 2,
}


def _quiet() -> Any:
    logging.getLogger("transformers").setLevel(logging.ERROR)
    return warnings.catch_warnings()


def _hf_layers(hf: Any) -> list[tuple[str, int, int, int | None]]:
    """(layer type, KV heads, head size, window) per layer, as transformers' cache sees them."""
    cache_utils = pytest.importorskip("transformers.cache_utils")
    text = hf.get_text_config(decoder=True)
    types, kwargs = cache_utils.get_layer_types_and_kwargs(text)
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    size = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return [
        (t, heads, size, kw.get("sliding_window") if t == "sliding_attention" else None)
        for t, kw in zip(types, kwargs, strict=True)
    ]


def _ours(spec: ModelSpec) -> list[tuple[str, int, int, int | None]]:
    out: list[tuple[str, int, int, int | None]] = []
    for layer in spec.layers:
        cache = layer.caches[0]
        assert isinstance(cache, AttentionSpec)
        window = cache.window if isinstance(cache, SlidingWindowSpec) else None
        out.append((layer.layer_type, cache.num_kv_heads, cache.head_dim, window))
    return out


@pytest.mark.parametrize("model_type", sorted(GENERIC_TYPES))
def test_to_dict_without_layer_types_matches_transformers(model_type: str) -> None:
    """transformers' own ``to_dict()`` with windows on, ``layer_types`` dropped."""
    transformers = pytest.importorskip("transformers")
    with _quiet():
        warnings.simplefilter("ignore")
        base = transformers.AutoConfig.for_model(model_type).to_dict()
        small = {k: v for k, v in _SMALL.items() if k in base}
        if model_type == "cohere2_moe":
            small["first_k_dense_replace"] = 2  # a kwarg the class pops, not a field
        hf = transformers.AutoConfig.for_model(model_type, **small)
        expected = _hf_layers(hf)
    config = copy.deepcopy(hf.to_dict())
    config.pop("layer_types", None)
    if model_type == "cohere2_moe":
        config["first_k_dense_replace"] = 2
    assert _ours(spec_from_config(config)) == expected


@pytest.mark.parametrize("model_type", sorted(GENERIC_TYPES))
def test_absent_fields_take_the_class_defaults(model_type: str) -> None:
    """Only the layer count and sizes given: KV heads, head size, window and layer kinds all
    come from the class defaults, as transformers' config class fills them."""
    transformers = pytest.importorskip("transformers")
    # 160 heads: divisible by every default KV head count in the table
    fields: dict[str, Any] = {
        "hidden_size": 2560,
        "num_attention_heads": 160,
        "num_hidden_layers": 10,
    }
    if model_type == "hrm_text":
        fields["num_layers_per_stack"] = 5  # else refused (test_hrm_text_...)
    with _quiet():
        warnings.simplefilter("ignore")
        expected = _hf_layers(transformers.AutoConfig.for_model(model_type, **fields))
    assert _ours(spec_from_config({"model_type": model_type, **fields})) == expected


@pytest.mark.parametrize("model_type", sorted(REFUSED_TYPES))
@pytest.mark.parametrize("drop", [False, True])
def test_refused_types_are_refused_with_and_without_layer_types(
    model_type: str, drop: bool
) -> None:
    transformers = pytest.importorskip("transformers")
    with _quiet():
        warnings.simplefilter("ignore")
        config = transformers.AutoConfig.for_model(model_type).to_dict()
    if drop:
        config.pop("layer_types", None)
    with pytest.raises(UnsupportedModelTypeError, match=rf"^config.model_type: '{model_type}'"):
        spec_from_config(config)


def test_every_causal_lm_without_layer_types_matches_or_is_refused() -> None:
    """Each causal LM transformers ships without a registry entry: its default ``to_dict()``
    with ``layer_types`` dropped is refused or derives the layer kinds and windows
    transformers' cache gets."""
    transformers = pytest.importorskip("transformers")
    cache_utils = pytest.importorskip("transformers.cache_utils")
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    registered = set(supported_model_types())
    wrong: list[str] = []
    checked = 0
    for model_type in sorted(set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) - registered):
        with _quiet():
            warnings.simplefilter("ignore")
            try:
                base = transformers.AutoConfig.for_model(model_type).to_dict()
                sizes = {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2}
                hf = transformers.AutoConfig.for_model(
                    model_type, **{k: v for k, v in sizes.items() if k in base}
                )
                text = hf.get_text_config(decoder=True)
                types, kwargs = cache_utils.get_layer_types_and_kwargs(text)
            except Exception:  # a class whose defaults do not build: nothing to compare
                continue
        config = copy.deepcopy(hf.to_dict())
        config.pop("layer_types", None)
        if isinstance(config.get("text_config"), dict):
            config["text_config"].pop("layer_types", None)
        try:
            spec = spec_from_config(config)
        except ConfigError:
            continue
        checked += 1
        ours = [
            (
                "dummy" if layer.stores_nothing else layer.layer_type,
                getattr(layer.caches[0], "window", None),
            )
            for layer in spec.layers
        ]
        theirs = [
            (t, kw.get("sliding_window") if t == "sliding_attention" else None)
            for t, kw in zip(types, kwargs, strict=True)
        ]
        if ours != theirs:
            wrong.append(
                f"{model_type}: ours {sorted(set(ours))}, transformers {sorted(set(theirs))}"
            )
    assert checked >= 50
    assert wrong == []


def test_wrapper_text_types_are_transformers_defaults() -> None:
    pytest.importorskip("transformers")
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    for wrapper, text_type in WRAPPER_TEXT_TYPES.items():
        spec = CONFIG_MAPPING[wrapper].sub_configs_defaults["text_config"]
        assert spec.model_type == text_type, wrapper
