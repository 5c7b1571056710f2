"""MTP / draft layers: derived from the config, tagged, merged into the target's groups."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from hybridkv.errors import ConfigError, SpecError
from hybridkv.models import resolve_model, spec_from_config
from hybridkv.models.catalog import catalog_config
from hybridkv.plan import group_entries, make_plan
from hybridkv.specs import (
    CacheKind,
    DType,
    FullAttentionSpec,
    LayerSpec,
    ModelSpec,
    NoCacheSpec,
    SlidingWindowSpec,
)

GIB = 1 << 30


def test_deepseek_v3_mtp_layer_joins_the_mla_group() -> None:
    base = resolve_model("DeepSeek-V3")
    spec = resolve_model("DeepSeek-V3", mtp=True)
    assert (base.num_layers, spec.num_layers, spec.num_target_layers) == (61, 62, 61)
    mtp = spec.layers[61]
    assert (mtp.index, mtp.tag, mtp.layer_type) == (61, "mtp", "mtp_attention")
    assert mtp.caches == base.layers[0].caches  # the same MLA latent
    [group] = group_entries(spec)
    assert group.spec.kind is CacheKind.MLA
    assert len(group.members) == 62 and group.members[-1] == (61, 0)
    assert spec.notes[-1] == "mtp: 1 layers after layer 60, grouped by spec"


def test_qwen3_next_mtp_joins_full_attention_and_keeps_group_ids() -> None:
    base = resolve_model("Qwen3-Next-80B-A3B")
    spec = resolve_model("Qwen3-Next-80B-A3B", mtp=True)  # no count field: one, as shipped
    before = group_entries(base)
    after = group_entries(spec)
    assert [g.spec for g in after] == [g.spec for g in before]  # same ids, same specs
    assert [len(g.members) for g in before] == [36, 12]
    assert [len(g.members) for g in after] == [36, 13]
    assert after[1].members[-1] == (48, 0)
    # Planned with them: one more full-attention layer per request costs capacity.
    caps = []
    for s in (base, spec):
        plan = make_plan(
            s, memory_bytes=16 * GIB, max_model_len=32768, strategy="arena", state_split=1
        )
        caps.append(plan.capacity.max_concurrent_requests)
        assert plan.layout.groups[1].members == group_entries(s)[1].members
    assert caps == [19, 18]  # 17 before the blocks past the last chunk counted


def test_nemotron_h_mtp_sublayers() -> None:
    cfg = catalog_config("Nemotron-H-8B")
    cfg["num_nextn_predict_layers"] = 2
    cfg["mtp_layers_block_type"] = ["attention", "moe"]
    base = spec_from_config(catalog_config("Nemotron-H-8B"))
    spec = spec_from_config(cfg, mtp=True)
    n = base.num_layers
    extra = spec.layers[n:]
    assert [(x.index, x.layer_type) for x in extra] == [
        (n, "mtp_attention"),
        (n + 1, "mtp_moe"),
        (n + 2, "mtp_attention"),
        (n + 3, "mtp_moe"),
    ]
    full = next(c for layer in base.layers for c in layer.caches if c.kind is CacheKind.FULL)
    assert extra[0].caches == (full,) and extra[1].caches == (NoCacheSpec(),)
    assert [len(g.members) for g in group_entries(spec)] == [
        len(g.members) + (2 if g.spec == full else 0) for g in group_entries(base)
    ]


@pytest.mark.parametrize(
    ("patch", "match"),
    [
        ({}, "declares no MTP module"),
        ({"num_nextn_predict_layers": 0}, "declares no MTP module"),
        (
            {"num_nextn_predict_layers": 1, "mtp_layers_block_type": ["conv"]},
            "mtp_layers_block_type: unknown sublayer type 'conv'",
        ),
    ],
)
def test_mtp_errors(patch: dict[str, Any], match: str) -> None:
    cfg = {**catalog_config("Llama-3.1-8B"), **patch}
    with pytest.raises(ConfigError, match=match):
        spec_from_config(cfg, mtp=True)


def test_mtp_state_sublayer_needs_a_target_state() -> None:
    cfg = {
        **catalog_config("Llama-3.1-8B"),
        "num_nextn_predict_layers": 1,
        "mtp_layers_block_type": ["mamba"],
    }
    with pytest.raises(ConfigError, match="no target layer of that kind"):
        spec_from_config(cfg, mtp=True)


def _attn(heads: int = 2) -> FullAttentionSpec:
    return FullAttentionSpec(num_kv_heads=heads, head_dim=16, dtype=DType.FP16)


def _model(*specs: Any, tp: int = 1, name: str = "m") -> ModelSpec:
    return ModelSpec(
        name=name,
        model_type="test",
        layers=tuple(LayerSpec(index=i, layer_type="x", caches=(s,)) for i, s in enumerate(specs)),
        tp_size=tp,
    )


def test_with_draft_merges_by_spec_and_appends_new_groups_last() -> None:
    swa = SlidingWindowSpec(num_kv_heads=2, head_dim=16, dtype=DType.FP16, window=8)
    target = _model(swa, _attn(), swa, _attn())
    draft = _model(_attn(), _attn(heads=4), name="eagle")
    spec = target.with_draft(draft)
    assert [(x.index, x.tag) for x in spec.layers] == [
        (0, ""),
        (1, ""),
        (2, ""),
        (3, ""),
        (4, "draft"),
        (5, "draft"),
    ]
    groups = group_entries(spec)
    assert [g.members for g in groups] == [
        ((0, 0), (2, 0)),
        ((1, 0), (3, 0), (4, 0)),  # the draft's matching layer joins the target's group
        ((5, 0),),  # a spec the target lacks: a new group after the target's
    ]
    assert spec.notes == ("draft: eagle (2 layers) after layer 3, grouped by spec",)
    assert ModelSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    assert "tag" not in target.to_dict()["layers"][0]  # unchanged format for target layers


def test_with_draft_errors() -> None:
    target = _model(_attn())
    with pytest.raises(SpecError, match="tp_size 2, the target 1"):
        target.with_draft(_model(_attn(), tp=2))
    with pytest.raises(SpecError, match="tag must name"):
        target.with_draft(_model(_attn()), tag="")
    with pytest.raises(SpecError, match=r"LayerSpec\.tag: layer 0 has tag 'a b'"):
        LayerSpec(index=0, layer_type="x", caches=(_attn(),), tag="a b")


def test_cli_plan_mtp() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "hybridkv",
            "plan",
            "--model",
            "DeepSeek-V3",
            "--memory",
            "80GiB",
            "--max-model-len",
            "32768",
            "--mtp",
            "--json",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    data = json.loads(out.stdout)
    assert len(data["model"]["layers"]) == 62
    assert data["model"]["layers"][61]["tag"] == "mtp"
    assert data["model"]["notes"] == ["mtp: 1 layers after layer 60, grouped by spec"]
    assert len(data["layout"]["groups"][0]["members"]) == 62
    bad = subprocess.run(
        [sys.executable, "-m", "hybridkv", "plan", "--model", "Llama-3.1-8B", "--mtp"],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2
    assert "declares no MTP module" in bad.stderr
    assert "Traceback" not in bad.stderr
