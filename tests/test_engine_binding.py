"""Probing what transformers caches, and binding a memory layout to it."""

from __future__ import annotations

import functools
import re
from typing import Any

import pytest
import torch

from hybridkv.engine.binding import RouteKind, bind_layout
from hybridkv.engine.errors import BindingError
from hybridkv.engine.layouts import fixed_layout
from hybridkv.engine.models import TINY_MODELS, load_model
from hybridkv.engine.probe import ModelProbe, ProbedState, probe_model, probe_model_spec
from hybridkv.plan import GroupPlan, MemoryLayout, PoolPlan, Strategy
from hybridkv.specs import (
    CacheSpec,
    FullAttentionSpec,
    LayerSpec,
    MLASpec,
    ModelSpec,
    SlidingWindowSpec,
    StateSpec,
    StateTensor,
)

pytestmark = pytest.mark.usefixtures("one_thread")


@functools.cache
def _probe(name: str) -> ModelProbe:
    return probe_model(load_model(name))


def with_spec(spec: ModelSpec, layer: int, cache: CacheSpec) -> ModelSpec:
    layers = list(spec.layers)
    layers[layer] = LayerSpec(index=layer, layer_type=layers[layer].layer_type, caches=(cache,))
    return ModelSpec(name=spec.name, model_type=spec.model_type, layers=tuple(layers))


def test_probe_measures_lfm3() -> None:
    probe = _probe("lfm3")
    assert [layer.layer_type for layer in probe.layers] == [
        "conv",
        "sliding_attention",
        "full_attention",
    ] * 2
    conv, sliding, full = probe.layers[:3]
    assert conv.kv is None and conv.states == (ProbedState("conv", 0, (64, 7), torch.float32),)
    assert (sliding.kv, sliding.window, sliding.states) == ((2, 16, 16), 8, ())
    assert (full.kv, full.window, full.mla, full.sinks) == ((2, 16, 16), None, False, False)
    assert not probe.reads_cache_length


def test_probe_sees_mla_sinks_and_cache_length_reads() -> None:
    mla = _probe("deepseek_v3").layers[0]
    assert (mla.kv, mla.mla) == ((1, 32, 8), True)
    assert [layer.sinks for layer in _probe("gpt_oss").layers] == [True] * 4
    assert _probe("llama4_text").reads_cache_length
    assert [layer.layer_type for layer in _probe("nemotron_h").layers][3] == "dummy"


def test_probe_restores_the_attention_implementation() -> None:
    model = load_model("llama")
    before = model.config._attn_implementation
    probe_model(model)
    assert model.config._attn_implementation == before


def _supported() -> set[str]:
    from hybridkv.models import supported_model_types

    return set(supported_model_types())


@pytest.mark.parametrize("name", sorted(TINY_MODELS))
def test_probed_spec_equals_spec_from_config(name: str) -> None:
    from hybridkv.errors import UnsupportedModelTypeError
    from hybridkv.models import spec_from_config

    model_type = TINY_MODELS[name].model_type
    model = load_model(name)
    try:  # the registry, or the generic derivation of attention-only decoders
        derived = spec_from_config(model.config.to_dict(), kv_cache_dtype="float32")
    except UnsupportedModelTypeError as exc:
        assert model_type not in _supported()
        pytest.skip(f"hybridkv.models does not derive {model_type!r} yet: {exc}")
    measured = probe_model_spec(probe_model(model))
    assert [layer.caches for layer in measured.layers] == [layer.caches for layer in derived.layers]


def test_binding_routes_every_caching_layer() -> None:
    probe = _probe("lfm3")
    layout = fixed_layout(probe_model_spec(probe), block_size=4, num_blocks=8)
    binding = bind_layout(probe, layout)
    assert {i: r.kind for i, r in binding.tokens.items()} == {
        1: RouteKind.ATTENTION,
        2: RouteKind.ATTENTION,
        4: RouteKind.ATTENTION,
        5: RouteKind.ATTENTION,
    }
    assert sorted(binding.states) == [0, 3]
    assert binding.states[0].tensors[0][:3] == ("conv", "conv", 0)
    assert sorted(binding.token_groups()) == [1, 2] and sorted(binding.state_groups()) == [0]
    deepseek = _probe("deepseek_v3")
    routes = bind_layout(deepseek, fixed_layout(probe_model_spec(deepseek), num_blocks=4))
    assert {r.kind for r in routes.tokens.values()} == {RouteKind.MLA}


def test_conv_state_may_drop_its_oldest_column() -> None:
    probe = _probe("lfm2")
    spec = probe_model_spec(probe)
    conv = StateSpec(
        mixer="short_conv", tensors=(StateTensor(name="conv", shape=(64, 2), dtype="fp32"),)
    )
    trimmed = with_spec(with_spec(spec, 0, conv), 2, conv)
    route = bind_layout(probe, fixed_layout(trimmed, num_blocks=4)).states[0]
    assert (route.tensors[0].hf_shape, route.tensors[0].shape) == ((64, 3), (64, 2))


KV = {"num_kv_heads": 2, "head_dim": 16, "dtype": "fp32"}


@pytest.mark.parametrize(
    ("name", "layer", "cache", "message"),
    [
        (
            "gemma3_text",
            0,
            SlidingWindowSpec(window=16, **KV),
            "serves layer 0 (sliding_attention) but its window is 16; the model needs 8",
        ),
        (
            "gemma3_text",
            0,
            FullAttentionSpec(**KV),
            "its kind is 'full_attention'; the model needs 'sliding_attention'",
        ),
        (
            "llama",
            1,
            FullAttentionSpec(num_kv_heads=4, head_dim=16, dtype="fp32"),
            "num_kv_heads is 4",
        ),
        (
            "llama",
            1,
            MLASpec(kv_lora_rank=32, qk_rope_head_dim=8, dtype="fp32"),
            "spec kind is 'mla'",
        ),
        (
            "lfm2",
            0,
            StateSpec(
                mixer="short_conv", tensors=(StateTensor(name="conv", shape=(32, 3), dtype="fp32"),)
            ),
            "stores conv tensor 'conv' of layer 0 with shape (32, 3); transformers keeps (64, 3)",
        ),
        (
            "lfm2",
            0,
            StateSpec(
                mixer="short_conv",
                tensors=(
                    StateTensor(name="conv", shape=(64, 3), dtype="fp32"),
                    StateTensor(name="ssm", shape=(4,), dtype="fp32"),
                ),
            ),
            "stores recurrent tensors ['ssm'] for layer 0, but transformers keeps 0",
        ),
        (
            "lfm2",
            1,
            StateSpec(
                mixer="short_conv", tensors=(StateTensor(name="conv", shape=(64, 3), dtype="fp32"),)
            ),
            "spec kind is 'state'",
        ),
    ],
)
def test_binding_rejects_specs_that_do_not_fit(
    name: str, layer: int, cache: CacheSpec, message: str
) -> None:
    probe = _probe(name)
    spec = with_spec(probe_model_spec(probe), layer, cache)
    with pytest.raises(BindingError, match=re.escape(message)):
        bind_layout(probe, fixed_layout(spec, num_blocks=4))


def _layout(members: tuple[tuple[int, int], ...], spec: CacheSpec) -> MemoryLayout:
    group = GroupPlan(
        group_id=0,
        spec=spec,
        members=members,
        block_size=4,
        kernel_block_size=4,
        page_bytes=spec.bytes_per_block(4),
    )
    pool = PoolPlan(pool_id=0, group_ids=(0,), block_bytes=group.block_bytes, num_blocks=4)
    return MemoryLayout(strategy=Strategy.POOLS, groups=(group,), pools=(pool,))


@pytest.mark.parametrize(
    ("members", "message"),
    [
        (((0, 0), (1, 0)), "layer 2 (full_attention) caches data but is a member of no group"),
        (((0, 0), (1, 0), (2, 1)), "member (layer 2, slot 1)"),
        (((0, 0), (1, 0), (2, 0), (3, 0)), "member layer 3; the model has layers 0..2"),
    ],
)
def test_binding_rejects_bad_membership(members: Any, message: str) -> None:
    with pytest.raises(BindingError, match=re.escape(message)):
        bind_layout(_probe("llama"), _layout(members, FullAttentionSpec(**KV)))


def test_falcon_h1_layers_route_attention_and_state_from_one_layer() -> None:
    """falcon_h1's ``hybrid`` layers keep K/V (cache slot 0) and a Mamba2 state (slot 1): the
    probe measures both, its spec lists both, and the binding routes each to its group."""
    probe = _probe("falcon_h1")
    assert [(layer.layer_type, layer.kv) for layer in probe.layers] == [("hybrid", (2, 16, 16))] * 3
    assert all([s.role for s in layer.states] == ["conv", "recurrent"] for layer in probe.layers)
    spec = probe_model_spec(probe)
    assert [[c.kind.value for c in layer.caches] for layer in spec.layers] == [
        ["full_attention", "state"]
    ] * 3
    layout = fixed_layout(spec, block_size=4, num_blocks=8)
    binding = bind_layout(probe, layout)
    assert {(r.layer, r.slot, r.kind) for r in binding.tokens.values()} == {
        (i, 0, RouteKind.ATTENTION) for i in range(3)
    }
    assert {(r.layer, r.slot) for r in binding.states.values()} == {(i, 1) for i in range(3)}
    state = next(g for g in layout.groups if g.spec.kind.value == "state")
    swapped = _layout(tuple((i, 0) for i in range(3)), state.spec)
    with pytest.raises(BindingError, match=re.escape("that layer's state is its cache slot 1")):
        bind_layout(probe, swapped)
