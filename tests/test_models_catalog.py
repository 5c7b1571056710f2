"""The model catalog: names, lookups, deep copies, resolve_model and the summary helpers."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from hybridkv.errors import UnknownModelError
from hybridkv.models import (
    DEFAULT_MODEL,
    catalog_config,
    catalog_entries,
    catalog_entry,
    catalog_names,
    resolve_model,
)
from hybridkv.models.summary import cache_detail, cache_label, format_kind_counts, kind_counts

REQUIRED = [
    "gpt-oss-20b",
    "gpt-oss-120b",
    "gemma-3-4b",
    "gemma-3-27b",
    "Qwen3-Next-80B-A3B",
    "Llama-3.1-8B",
    "Llama-3.3-70B",
    "DeepSeek-V3",
    "Jamba-v0.1",
    "Nemotron-H-8B",
    "Falcon-H1-7B",
    "Mistral-7B-v0.1",
    "LFM2-1.2B",
]


def test_catalog_has_the_required_models() -> None:
    names = catalog_names()
    assert set(REQUIRED) <= set(names)
    assert len(names) == len(set(names))
    assert DEFAULT_MODEL == "Qwen3-Next-80B-A3B" and DEFAULT_MODEL in names


@pytest.mark.parametrize("name", catalog_names())
def test_every_entry_derives(name: str) -> None:
    entry = catalog_entry(name)
    spec = resolve_model(name)
    assert spec.name == name
    assert spec.num_layers >= 1
    assert spec.max_position_embeddings is None or spec.max_position_embeddings > 0
    assert spec.entries(), "a model with no cache at all"
    assert entry.hf_id.count("/") == 1


def test_lookup_is_case_insensitive_and_accepts_hf_ids() -> None:
    spec = resolve_model("gpt-oss-20b")
    assert resolve_model("GPT-OSS-20B") == spec
    assert resolve_model("openai/gpt-oss-20b") == spec
    assert resolve_model("  OpenAI/GPT-oss-20b ") == spec
    assert catalog_entry("nvidia/nemotron-h-8b-base-8k").name == "Nemotron-H-8B"


def test_catalog_config_is_a_deep_copy() -> None:
    cfg = catalog_config("gemma-3-4b")
    cfg["text_config"]["num_hidden_layers"] = 2
    cfg["torch_dtype"] = "float32"
    assert catalog_config("gemma-3-4b")["text_config"]["num_hidden_layers"] == 34
    assert resolve_model("gemma-3-4b").num_layers == 34


@pytest.mark.parametrize("name", ["", "   ", None])
def test_an_empty_or_missing_name_is_refused(name: str) -> None:
    """Not read as the current directory ('' is a path to it), nor an AttributeError."""
    with pytest.raises(UnknownModelError) as info:
        resolve_model(name)
    assert str(info.value) == (
        f"model: got {name!r}; give a catalog name (catalog_names()), a path to a config.json "
        "or its directory, or a Hugging Face id in the local hub cache"
    )


def test_unknown_names_suggest_close_matches() -> None:
    with pytest.raises(UnknownModelError) as info:
        resolve_model("gpt-oss-2b")
    message = str(info.value)
    assert (
        "model: 'gpt-oss-2b' is neither a catalog name, a path to a config.json nor a model id "
        "in the local Hugging Face cache" in message
    )
    assert "close matches: gpt-oss-20b" in message
    with pytest.raises(UnknownModelError, match=r"catalog: gpt-oss-20b, gpt-oss-120b"):
        catalog_config("no-such-model")
    with pytest.raises(LookupError):
        catalog_entry("llama-9")


def test_resolve_model_reads_config_paths(tmp_path: Path) -> None:
    model_dir = tmp_path / "my-model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(catalog_config("LFM2-1.2B")))
    from_dir = resolve_model(str(model_dir), tp_size=2)
    from_file = resolve_model(str(model_dir / "config.json"), tp_size=2)
    assert from_dir.name == from_file.name == "my-model"
    assert from_dir.layers == resolve_model("LFM2-1.2B", tp_size=2).layers
    with pytest.raises(UnknownModelError):
        resolve_model(str(tmp_path / "empty"))


def test_entries_expose_model_type() -> None:
    types = {entry.name: entry.model_type for entry in catalog_entries()}
    assert types["gemma-3-4b"] == "gemma3"
    assert types["Falcon-H1-7B"] == "falcon_h1"


def test_summary_helpers() -> None:
    assert kind_counts(resolve_model("gpt-oss-20b")) == {"sliding(128)": 12, "full": 12}
    counts = kind_counts(resolve_model("Nemotron-H-8B"))
    assert counts == {"mamba2": 24, "none": 24, "full": 4}
    assert format_kind_counts(counts) == "24 mamba2 + 24 none + 4 full"
    falcon = resolve_model("Falcon-H1-7B")
    assert kind_counts(falcon) == {"full": 44, "mamba2": 44}
    attention, mamba = falcon.layers[0].caches
    assert cache_detail(attention) == "2 kv x 128, bf16"
    assert cache_detail(mamba) == "conv 3584x4 bf16, ssm 24x128x256 fp32"
    assert cache_label(resolve_model("Llama-3.3-70B").layers[0].caches[0]) == "full"
    deepseek = resolve_model("DeepSeek-V3", kv_cache_dtype="fp8").layers[0].caches[0]
    assert cache_detail(deepseek) == "latent 512+64, fp8e4m3"
    assert (
        cache_detail(resolve_model("gpt-oss-20b").layers[0].caches[0]) == "8 kv x 64, bf16, sinks"
    )


def test_hugging_face_ids_are_found_in_the_local_hub_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hybridkv.models import resolve_model
    from hybridkv.models.hub_cache import hub_cache_dir, hub_config_path

    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    assert hub_cache_dir() == tmp_path / "hub"
    repo = tmp_path / "hub" / "models--Qwen--Qwen3-30B-A3B"
    config = {
        "model_type": "qwen3_moe",
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "hidden_size": 2048,
        "max_position_embeddings": 40960,
    }
    old = repo / "snapshots" / "aaa"
    main = repo / "snapshots" / "bbb"
    for snap, layers in ((old, 2), (main, 48)):
        snap.mkdir(parents=True)
        (snap / "config.json").write_text(json.dumps({**config, "num_hidden_layers": layers}))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("bbb\n")
    assert hub_config_path("Qwen/Qwen3-30B-A3B") == main / "config.json"
    spec = resolve_model("Qwen/Qwen3-30B-A3B")
    assert (spec.name, spec.model_type, spec.num_layers) == ("Qwen/Qwen3-30B-A3B", "qwen3_moe", 48)
    # without refs/main: the most recent snapshot; unknown or malformed ids: not found
    (repo / "refs" / "main").unlink()
    os.utime(old / "config.json", (2_000_000_000, 2_000_000_000))
    assert hub_config_path("Qwen/Qwen3-30B-A3B") == old / "config.json"
    assert hub_config_path("Qwen/nope") is None
    assert hub_config_path("../x") is None
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))
    assert hub_config_path("Qwen/Qwen3-30B-A3B") is None
