"""spec_from_config: dtype rules, tensor-parallel sharding, errors and config sources."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import pytest

from hybridkv.errors import ConfigError, SpecError, UnsupportedModelTypeError
from hybridkv.models import catalog_config, resolve_model, spec_from_config, supported_model_types
from hybridkv.specs import (
    AttentionSpec,
    DType,
    FullAttentionSpec,
    MLASpec,
    ModelSpec,
    StateSpec,
)

BF16, FP32 = DType.BF16, DType.FP32


def state_shapes(spec: StateSpec) -> dict[str, tuple[tuple[int, ...], str]]:
    return {t.name: (t.shape, t.dtype.value) for t in spec.tensors}


def llama_config(**overrides: Any) -> dict[str, Any]:
    return {
        "model_type": "llama",
        "num_hidden_layers": 2,
        "hidden_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        **overrides,
    }


# --- dtypes ----------------------------------------------------------------------------------


def test_kv_cache_dtype_applies_to_attention_only() -> None:
    spec = resolve_model("Jamba-v0.1", kv_cache_dtype="fp8")
    attention = spec.layers[4].caches[0]
    assert isinstance(attention, AttentionSpec) and attention.dtype is DType.FP8_E4M3
    assert attention.bytes_per_token == 2 * 8 * 128
    mamba = spec.layers[0].caches[0]
    assert isinstance(mamba, StateSpec)
    assert state_shapes(mamba)["conv"][1] == "bfloat16"
    assert state_shapes(mamba)["ssm"][1] == "float32"
    assert spec.notes == ("kv_cache_dtype=float8_e4m3fn applies to attention/MLA caches only",)
    mla = resolve_model("DeepSeek-V3", kv_cache_dtype="fp8").layers[0].caches[0]
    assert mla.bytes_per_token == 576


def test_kv_cache_dtype_auto_is_the_model_dtype() -> None:
    assert resolve_model("gpt-oss-20b", kv_cache_dtype="auto") == resolve_model("gpt-oss-20b")


def test_model_dtype_from_config() -> None:
    cfg = catalog_config("Falcon-H1-7B")
    cfg["torch_dtype"] = "float16"
    attention, mamba = spec_from_config(cfg).layers[0].caches
    assert attention.dtype is DType.FP16  # type: ignore[union-attr]
    assert state_shapes(mamba)["conv"][1] == "float16"  # type: ignore[arg-type]
    assert state_shapes(mamba)["ssm"][1] == "float32"  # type: ignore[arg-type]
    del cfg["torch_dtype"]
    cfg["dtype"] = "float32"
    assert spec_from_config(cfg).layers[0].caches[0].dtype is FP32  # type: ignore[union-attr]


def test_ssm_state_dtype_override_and_config_flag() -> None:
    spec = resolve_model("Nemotron-H-8B", ssm_state_dtype="bf16")
    assert state_shapes(spec.layers[0].caches[0])["ssm"][1] == "bfloat16"  # type: ignore[arg-type]
    cfg = catalog_config("Nemotron-H-8B")
    cfg["mamba_ssm_cache_dtype"] = "float16"
    flagged = spec_from_config(cfg).layers[0].caches[0]
    assert state_shapes(flagged)["ssm"][1] == "float16"  # type: ignore[arg-type]


def test_bad_dtypes() -> None:
    with pytest.raises(SpecError, match=r"kv_cache_dtype: unknown dtype 'int3'"):
        resolve_model("gpt-oss-20b", kv_cache_dtype="int3")
    with pytest.raises(SpecError, match=r"llama config.torch_dtype: unknown dtype 'float64'"):
        spec_from_config(llama_config(torch_dtype="float64"))


# --- tensor parallelism ----------------------------------------------------------------------


def test_tp_divides_kv_heads() -> None:
    spec = resolve_model("gpt-oss-20b", tp_size=2)
    assert spec.tp_size == 2
    assert spec.layers[1].caches[0] == FullAttentionSpec(
        num_kv_heads=4, head_dim=64, dtype=BF16, learned_sinks=True
    )
    assert spec.notes == ()


def test_tp_larger_than_kv_heads_replicates_one_head() -> None:
    spec = resolve_model("gpt-oss-20b", tp_size=16)
    assert spec.layers[1].caches[0].num_kv_heads == 1  # type: ignore[union-attr]
    assert spec.notes == ("tp_size=16 > 8 KV heads: each rank holds one replicated KV head",)


def test_tp_that_cannot_shard_heads() -> None:
    with pytest.raises(ConfigError, match=r"gpt_oss: tp_size=3 cannot shard num_key_value_heads=8"):
        resolve_model("gpt-oss-20b", tp_size=3)


def test_tp_mla_latent_is_replicated() -> None:
    spec = resolve_model("DeepSeek-V3", tp_size=8)
    assert spec.layers[0].caches[0] == MLASpec(kv_lora_rank=512, qk_rope_head_dim=64, dtype=BF16)
    assert spec.notes == ("MLA latent replicated on each of the 8 ranks (not split by tp)",)


def test_tp_splits_mamba2_heads_and_groups() -> None:
    spec = resolve_model("Nemotron-H-8B", tp_size=4)
    assert state_shapes(spec.layers[0].caches[0]) == {  # type: ignore[arg-type]
        "conv": ((32 * 64 + 2 * 2 * 128, 4), "bfloat16"),
        "ssm": ((32, 64, 128), "float32"),
    }
    assert spec.layers[7].caches[0].num_kv_heads == 2  # type: ignore[union-attr]
    falcon = resolve_model("Falcon-H1-7B", tp_size=2)  # 1 group: replicated on both ranks
    assert state_shapes(falcon.layers[0].caches[1]) == {  # type: ignore[arg-type]
        "conv": ((12 * 128 + 2 * 256, 4), "bfloat16"),
        "ssm": ((12, 128, 256), "float32"),
    }


def test_tp_splits_linear_attention_heads() -> None:
    spec = resolve_model("Qwen3-Next-80B-A3B", tp_size=2)
    assert state_shapes(spec.layers[0].caches[0]) == {  # type: ignore[arg-type]
        "conv": ((2 * 8 * 128 + 16 * 128, 4), "bfloat16"),
        "recurrent": ((16, 128, 128), "float32"),
    }
    lfm2 = resolve_model("LFM2-1.2B", tp_size=4)
    assert state_shapes(lfm2.layers[0].caches[0]) == {"conv": ((512, 3), "bfloat16")}  # type: ignore[arg-type]


def test_tp_that_cannot_split_state() -> None:
    with pytest.raises(ConfigError, match=r"jamba: tp_size=3 does not divide mamba intermediate"):
        resolve_model("Jamba-v0.1", tp_size=3)


@pytest.mark.parametrize("tp", [0, -2, True, 1.5])
def test_bad_tp_size(tp: Any) -> None:
    with pytest.raises(ConfigError, match=rf"tp_size: must be a positive integer, got {tp!r}"):
        spec_from_config(llama_config(), tp_size=tp)


# --- errors ----------------------------------------------------------------------------------


def test_unknown_model_type_lists_supported() -> None:
    with pytest.raises(UnsupportedModelTypeError) as info:
        spec_from_config({"model_type": "rwkv9", "num_hidden_layers": 2})
    message = str(info.value)
    assert "'rwkv9' is not supported" in message
    for model_type in ("gpt_oss", "qwen3_next", "nemotron_h", "deepseek_v3"):
        assert model_type in message
    assert isinstance(info.value, ConfigError)


def test_missing_model_type() -> None:
    with pytest.raises(ConfigError, match=r"config.model_type: missing"):
        spec_from_config({"num_hidden_layers": 2})


def test_missing_required_field_names_field_and_model_type() -> None:
    cfg = llama_config()
    del cfg["num_hidden_layers"]
    with pytest.raises(
        ConfigError, match=r"llama config: missing required field 'num_hidden_layers'"
    ):
        spec_from_config(cfg)
    jamba = catalog_config("Jamba-v0.1")
    del jamba["hidden_size"]
    with pytest.raises(ConfigError, match=r"jamba config: missing required field 'hidden_size'"):
        spec_from_config(jamba)


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("num_attention_heads", 0, "an integer in [1, 2147483647]"),
        ("num_key_value_heads", -8, "an integer in [1, 2147483647]"),
        ("num_hidden_layers", "32", "an integer in [1, 65536]"),
        ("num_hidden_layers", 65537, "an integer in [1, 65536]"),
        ("hidden_size", 12.5, "an integer in [1, 2147483647]"),
    ],
)
def test_invalid_values_name_field_and_value(field: str, value: Any, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        spec_from_config(llama_config(**{field: value}))
    assert f"llama config: field {field!r} must be {expected}, got {value!r}" in str(info.value)


def test_layer_types_errors() -> None:
    with pytest.raises(
        ConfigError, match=r"'layer_types' has 3 entries but the model has 2 layers"
    ):
        spec_from_config(llama_config(layer_types=["full_attention"] * 3))
    with pytest.raises(ConfigError, match=r"layer 1 has layer type 'banana'; valid attention"):
        spec_from_config(llama_config(layer_types=["full_attention", "banana"]))
    with pytest.raises(ConfigError, match=r"missing required field 'sliding_window'"):
        spec_from_config(llama_config(layer_types=["full_attention", "sliding_attention"]))


def test_hybrid_config_errors() -> None:
    cfg = catalog_config("Nemotron-H-8B")
    cfg["hybrid_override_pattern"] = "M*X-"
    with pytest.raises(ConfigError, match=r"has characters \['X'\]; valid: M \(mamba2\)"):
        spec_from_config(cfg)
    # transformers' NemotronHConfig takes the pattern's length (num_hidden_layers is ignored)
    cfg["hybrid_override_pattern"] = "M*M-"
    spec = spec_from_config(cfg)
    assert [layer.layer_type for layer in spec.layers] == [
        "linear_attention",
        "full_attention",
        "linear_attention",
        "mlp",
    ]
    assert any("num_hidden_layers=52 disagrees with the 4 entries" in n for n in spec.notes)
    zamba = llama_config(model_type="zamba2")
    with pytest.raises(
        ConfigError, match=r"zamba2 config: missing required field 'layers_block_type'"
    ):
        spec_from_config(zamba)
    gemma4 = llama_config(model_type="gemma4_text", num_kv_shared_layers=2)
    with pytest.raises(ConfigError, match=r"'num_kv_shared_layers' must be smaller than"):
        spec_from_config(gemma4)


def test_input_config_is_not_mutated() -> None:
    cfg = catalog_config("gemma-3-4b")
    before = copy.deepcopy(cfg)
    spec_from_config(cfg, tp_size=2, kv_cache_dtype="fp8")
    with pytest.raises(ConfigError):
        spec_from_config(cfg, tp_size=3)
    assert cfg == before


# --- config sources and names ----------------------------------------------------------------


def test_config_from_file_and_directory(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(catalog_config("gpt-oss-20b")))
    from_dir = spec_from_config(tmp_path)
    from_file = spec_from_config(str(tmp_path / "config.json"))
    assert from_dir.layers == from_file.layers == resolve_model("gpt-oss-20b").layers
    assert from_dir.name == "gpt_oss"


def test_bad_config_paths(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"is not a config.json file or a directory"):
        spec_from_config(tmp_path / "missing")
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match=r"cannot read .* as JSON"):
        spec_from_config(bad)
    bad.write_text("[1, 2]")
    with pytest.raises(ConfigError, match=r"holds list, not a JSON object"):
        spec_from_config(bad)
    bad.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ConfigError, match=r"nests JSON too deeply to read"):
        spec_from_config(bad)
    bad.write_text('{"num_hidden_layers": ' + "1" * 5000 + "}")
    with pytest.raises(ConfigError, match=r"cannot read .* as JSON: Exceeds the limit"):
        spec_from_config(bad)


def test_spec_names() -> None:
    assert spec_from_config(llama_config()).name == "llama"
    assert spec_from_config(llama_config(_name_or_path="org/model")).name == "org/model"
    assert spec_from_config(llama_config(), name="mine").name == "mine"


def test_supported_model_types() -> None:
    assert supported_model_types() == sorted(supported_model_types())
    assert {
        "llama",
        "mistral",
        "qwen2",
        "qwen3",
        "gemma2",
        "gemma3_text",
        "gemma4_text",
        "cohere2",
        "gpt_oss",
        "qwen3_next",
        "jamba",
        "bamba",
        "granitemoehybrid",
        "nemotron_h",
        "falcon_h1",
        "zamba2",
        "lfm2",
        "deepseek_v2",
        "deepseek_v3",
        "kimi_linear",
        "llama4_text",
    } <= set(supported_model_types())


def test_model_spec_round_trips_through_dict() -> None:
    spec = resolve_model("Falcon-H1-7B", tp_size=2)
    assert ModelSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec


@pytest.mark.parametrize("kv", [3, 0, 16])
def test_kv_heads_that_do_not_divide_the_query_heads_are_refused(kv: int) -> None:
    cfg = {**catalog_config("Llama-3.1-8B"), "num_attention_heads": 8, "num_key_value_heads": kv}
    message = (
        f"llama config: num_key_value_heads={kv} does not divide num_attention_heads=8; "
        "grouped-query attention shares each KV head among the same number of query heads"
    )
    if kv == 0:  # the typed getter refuses a zero first
        message = "field 'num_key_value_heads' must be an integer in [1, 2147483647], got 0"
    with pytest.raises(ConfigError, match=re.escape(message)):
        spec_from_config(cfg)


def test_kimi_k2_is_derived_as_deepseek_v3() -> None:
    """Kimi-K2 checkpoints name ``model_type: kimi_k2`` and load with DeepSeek-V3's classes
    (transformers' kimi_k25 config maps a kimi_k2 text config to deepseek_v3): the same
    layers as DeepSeek-V3, top level or inside a kimi_k25 wrapper, with a note (it was
    refused as an unknown type with MLA fields)."""
    from hybridkv.models.catalog_data import CATALOG_DATA

    deepseek = next(cfg for name, _, cfg in CATALOG_DATA if name == "DeepSeek-V3")
    kimi = {**deepseek, "model_type": "kimi_k2"}
    base = spec_from_config(deepseek)
    note = "model_type 'kimi_k2' derived as 'deepseek_v3' (its checkpoints' architecture)"
    for config in (kimi, {"model_type": "kimi_k25", "text_config": kimi}):
        spec = spec_from_config(config)
        assert spec.model_type == "deepseek_v3" and spec.layers == base.layers
        assert note in spec.notes
    assert note not in base.notes
