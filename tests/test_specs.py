"""hybridkv.specs: sizes, token spans, prefix closure, serialisation and validation."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hybridkv.errors import SpecError
from hybridkv.specs import (
    MAX_TOKENS,
    CacheKind,
    CacheSpec,
    ChunkedLocalSpec,
    DType,
    FullAttentionSpec,
    LayerSpec,
    MLASpec,
    ModelSpec,
    NoCacheReason,
    NoCacheSpec,
    SlidingWindowSpec,
    StateMixer,
    StateSpec,
    StateTensor,
    no_cache_layer,
    spec_from_dict,
)

BF16 = DType.BF16


def full(heads: int = 8, head_dim: int = 64, **kw: Any) -> FullAttentionSpec:
    return FullAttentionSpec(num_kv_heads=heads, head_dim=head_dim, dtype=BF16, **kw)


def sliding(window: int = 4, sinks: int = 0, **kw: Any) -> SlidingWindowSpec:
    return SlidingWindowSpec(
        num_kv_heads=8, head_dim=64, dtype=BF16, window=window, sink_tokens=sinks, **kw
    )


def chunked(chunk: int = 4) -> ChunkedLocalSpec:
    return ChunkedLocalSpec(num_kv_heads=8, head_dim=128, dtype=BF16, chunk_size=chunk)


def mla() -> MLASpec:
    return MLASpec(kv_lora_rank=512, qk_rope_head_dim=64, dtype=BF16)


def mamba2() -> StateSpec:
    return StateSpec(
        mixer=StateMixer.MAMBA2,
        tensors=(
            StateTensor(name="conv", shape=(160, 4), dtype=BF16),
            StateTensor(name="ssm", shape=(8, 16, 8), dtype=DType.FP32),
        ),
    )


def spans(spans_: tuple[range, ...]) -> list[tuple[int, int]]:
    return [(r.start, r.stop) for r in spans_]


ALL_SPECS: list[CacheSpec] = [
    full(),
    full(v_head_dim=32, learned_sinks=True),
    sliding(window=128, sinks=4),
    chunked(8192),
    mla(),
    mamba2(),
    NoCacheSpec(),
    NoCacheSpec(reason=NoCacheReason.KV_SHARED, source_layer=3),
]


# --- sizes -----------------------------------------------------------------------------------


def test_dtype_itemsize_and_aliases() -> None:
    assert [d.itemsize for d in DType] == [4, 2, 2, 1, 1]
    assert DType.parse("bf16") is DType.BF16
    assert DType.parse("torch.float16") is DType.FP16
    assert DType.parse("FP8") is DType.FP8_E4M3
    assert DType.parse(DType.FP32) is DType.FP32


def test_dtype_parse_error_names_field_and_value() -> None:
    with pytest.raises(SpecError, match=r"kv_cache_dtype: unknown dtype 'int4'; valid: .*bf16"):
        DType.parse("int4", field="kv_cache_dtype")


def test_attention_bytes_per_token_and_block() -> None:
    spec = full()  # gpt-oss full layer: 2 * 8 heads * 64 * 2 bytes
    assert spec.bytes_per_token == 2048
    assert spec.bytes_per_block(16) == 32768
    assert spec.state_bytes == 0
    assert full(v_head_dim=32).bytes_per_token == 8 * (64 + 32) * 2
    fp8 = FullAttentionSpec(num_kv_heads=8, head_dim=128, dtype=DType.FP8_E4M3)
    assert fp8.bytes_per_token == 2048


def test_mla_bytes_per_token() -> None:
    spec = mla()
    assert spec.latent_dim == 576
    assert spec.bytes_per_token == 1152
    assert spec.bytes_per_block(64) == 73728


def test_state_bytes_and_block_is_one_slot() -> None:
    spec = mamba2()
    assert spec.tensors[0].nbytes == 160 * 4 * 2
    assert spec.tensors[1].nbytes == 8 * 16 * 8 * 4
    assert spec.state_bytes == 1280 + 4096
    assert spec.bytes_per_token == 0
    assert spec.bytes_per_block(16) == 5376
    assert spec.bytes_per_block(1024) == 5376


def test_no_cache_stores_nothing() -> None:
    spec = NoCacheSpec()
    assert spec.stores_nothing
    assert spec.bytes_per_token == 0
    assert spec.bytes_per_block(16) == 0
    assert spec.resident_bytes(1000) == 0
    assert spec.kept_tokens(10) == ()
    assert spec.visible_tokens(10) == ()


@pytest.mark.parametrize("block_size", [0, -16, True])
def test_bytes_per_block_rejects_bad_block_size(block_size: int) -> None:
    with pytest.raises(SpecError, match="block_size: must be a positive integer"):
        full().bytes_per_block(block_size)


# --- token spans -----------------------------------------------------------------------------


def test_full_and_mla_keep_everything() -> None:
    for spec in (full(), mla()):
        assert spans(spec.kept_tokens(10)) == [(0, 10)]
        assert spans(spec.visible_tokens(9)) == [(0, 10)]
        assert spans(spec.kept_tokens(0)) == [(0, 0)]


def test_sliding_window_without_sinks() -> None:
    spec = sliding(window=4)
    assert spans(spec.visible_tokens(0)) == [(0, 1)]
    assert spans(spec.visible_tokens(3)) == [(0, 4)]
    assert spans(spec.visible_tokens(10)) == [(7, 11)]
    # After 10 tokens, the next query (position 10) reads 7..10: keep 7, 8, 9.
    assert spans(spec.kept_tokens(10)) == [(7, 10)]
    assert spans(spec.kept_tokens(2)) == [(0, 2)]
    assert spans(spec.kept_tokens(0)) == [(0, 0)]


def test_sliding_window_with_sink_tokens() -> None:
    spec = sliding(window=4, sinks=2)
    assert spans(spec.visible_tokens(0)) == [(0, 1)]
    assert spans(spec.visible_tokens(5)) == [(0, 6)]  # window 2..5 touches the sinks 0..1
    assert spans(spec.visible_tokens(6)) == [(0, 2), (3, 7)]
    assert spans(spec.visible_tokens(10)) == [(0, 2), (7, 11)]
    assert spans(spec.kept_tokens(10)) == [(0, 2), (7, 10)]
    assert spans(spec.kept_tokens(1)) == [(0, 1)]


def test_chunked_spans_at_chunk_boundaries() -> None:
    spec = chunked(4)
    assert spans(spec.visible_tokens(3)) == [(0, 4)]
    assert spans(spec.visible_tokens(4)) == [(4, 5)]  # first token of a new chunk sees itself
    assert spans(spec.visible_tokens(7)) == [(4, 8)]
    assert spans(spec.kept_tokens(8)) == [(8, 8)]  # a full chunk is never read again
    assert spans(spec.kept_tokens(9)) == [(8, 9)]
    assert spans(spec.kept_tokens(7)) == [(4, 7)]


def test_state_keeps_no_tokens() -> None:
    spec = mamba2()
    assert spec.kept_tokens(100) == ()
    assert spec.visible_tokens(99) == ()


def test_resident_bytes_per_kind() -> None:
    assert full().resident_bytes(100) == 100 * 2048
    assert sliding(window=4).resident_bytes(100) == 4 * 2048
    assert sliding(window=4, sinks=2).resident_bytes(100) == 6 * 2048
    assert sliding(window=4).resident_bytes(3) == 3 * 2048
    assert chunked(4).resident_bytes(9) == 1 * 8 * 256 * 2  # query 8 opens a new chunk
    assert chunked(4).resident_bytes(8) == 4 * 8 * 256 * 2
    assert mla().resident_bytes(10) == 11520
    assert mamba2().resident_bytes(1) == 5376
    assert mamba2().resident_bytes(10_000) == 5376
    for spec in ALL_SPECS:
        assert spec.resident_bytes(0) == 0


def test_prefix_closed_per_kind() -> None:
    closed = {type(spec).__name__: spec.prefix_closed for spec in ALL_SPECS}
    assert closed == {
        "FullAttentionSpec": True,
        "SlidingWindowSpec": False,
        "ChunkedLocalSpec": False,
        "MLASpec": True,
        "StateSpec": False,
        "NoCacheSpec": True,
    }


def test_kinds() -> None:
    assert [spec.kind for spec in ALL_SPECS[2:7]] == [
        CacheKind.SLIDING,
        CacheKind.CHUNKED,
        CacheKind.MLA,
        CacheKind.STATE,
        CacheKind.NONE,
    ]


def _token_set(ranges: tuple[range, ...]) -> set[int]:
    out: set[int] = set()
    for r in ranges:
        assert not out & set(r), "spans overlap"
        out |= set(r)
    return out


@given(
    window=st.integers(1, 12),
    sinks=st.integers(0, 6),
    q=st.integers(0, 40),
)
def test_sliding_visible_is_window_plus_sinks(window: int, sinks: int, q: int) -> None:
    spec = sliding(window=window, sinks=sinks)
    expected = {k for k in range(q + 1) if k > q - window or k < sinks}
    assert _token_set(spec.visible_tokens(q)) == expected
    assert q in _token_set(spec.visible_tokens(q))


@given(
    kind=st.sampled_from(["full", "sliding", "sinks", "chunked", "mla"]),
    size=st.integers(1, 10),
    n=st.integers(0, 30),
    ahead=st.integers(0, 30),
)
def test_kept_tokens_cover_every_future_read(kind: str, size: int, n: int, ahead: int) -> None:
    """Releasing what kept_tokens(n) omits never drops a token a later query reads."""
    spec: CacheSpec = {
        "full": full(),
        "sliding": sliding(window=size),
        "sinks": sliding(window=size, sinks=2),
        "chunked": chunked(size),
        "mla": mla(),
    }[kind]
    kept = _token_set(spec.kept_tokens(n))
    assert kept <= set(range(n))
    needed = _token_set(spec.visible_tokens(n + ahead)) & set(range(n))
    assert needed <= kept


# --- serialisation ---------------------------------------------------------------------------


@pytest.mark.parametrize("spec", ALL_SPECS, ids=lambda s: type(s).__name__)
def test_to_dict_round_trip(spec: CacheSpec) -> None:
    data = spec.to_dict()
    assert data["kind"] == spec.kind.value
    rebuilt = spec_from_dict(data)
    assert rebuilt == spec
    assert hash(rebuilt) == hash(spec)


def test_to_dict_is_json_ready() -> None:
    assert mamba2().to_dict() == {
        "kind": "state",
        "mixer": "mamba2",
        "tensors": [
            {"name": "conv", "shape": [160, 4], "dtype": "bfloat16"},
            {"name": "ssm", "shape": [8, 16, 8], "dtype": "float32"},
        ],
    }
    assert sliding(window=128).to_dict() == {
        "kind": "sliding_window",
        "num_kv_heads": 8,
        "head_dim": 64,
        "dtype": "bfloat16",
        "v_head_dim": None,
        "learned_sinks": False,
        "window": 128,
        "sink_tokens": 0,
    }


def test_spec_from_dict_errors() -> None:
    with pytest.raises(SpecError, match=r"spec.kind: unknown kind 'paged'; valid: full_attention"):
        spec_from_dict({"kind": "paged"})
    with pytest.raises(SpecError, match=r"bad fields for kind 'mla'"):
        spec_from_dict({"kind": "mla", "kv_lora_rank": 512})


def test_string_fields_are_parsed() -> None:
    spec = FullAttentionSpec(num_kv_heads=1, head_dim=8, dtype="fp16")  # type: ignore[arg-type]
    assert spec.dtype is DType.FP16
    state = StateSpec(mixer="kda", tensors=(StateTensor(name="c", shape=(2,), dtype=BF16),))  # type: ignore[arg-type]
    assert state.mixer is StateMixer.KDA
    none = NoCacheSpec(reason="kv_shared", source_layer=0)  # type: ignore[arg-type]
    assert none.reason is NoCacheReason.KV_SHARED


# --- validation ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (
            lambda: full(heads=0),
            r"FullAttentionSpec.num_kv_heads: must be a positive integer, got 0",
        ),
        (lambda: full(head_dim=-1), r"FullAttentionSpec.head_dim: .* got -1"),
        (lambda: full(heads=True), r"num_kv_heads: must be a positive integer, got True"),
        (lambda: full(v_head_dim=0), r"FullAttentionSpec.v_head_dim: .* got 0"),
        (lambda: sliding(window=0), r"SlidingWindowSpec.window: must be a positive integer, got 0"),
        (
            lambda: sliding(window=MAX_TOKENS + 1),
            rf"SlidingWindowSpec.window: {MAX_TOKENS + 1} is larger than the maximum {MAX_TOKENS}",
        ),
        (lambda: sliding(sinks=-1), r"SlidingWindowSpec.sink_tokens: .* got -1"),
        (lambda: chunked(0), r"ChunkedLocalSpec.chunk_size: must be a positive integer, got 0"),
        (
            lambda: MLASpec(kv_lora_rank=0, qk_rope_head_dim=64, dtype=BF16),
            r"MLASpec.kv_lora_rank: must be a positive integer, got 0",
        ),
        (
            lambda: FullAttentionSpec(num_kv_heads=1, head_dim=8, dtype="float64"),  # type: ignore[arg-type]
            r"FullAttentionSpec.dtype: unknown dtype 'float64'",
        ),
        (
            lambda: StateTensor(name="ssm", shape=(4, 0), dtype=BF16),
            r"StateTensor.shape: 'ssm' needs positive integer dims, got \(4, 0\)",
        ),
        (lambda: StateTensor(name="", shape=(4,), dtype=BF16), r"StateTensor.name"),
        (
            lambda: StateSpec(mixer=StateMixer.MAMBA1, tensors=()),
            r"StateSpec.tensors: a state spec needs at least one tensor",
        ),
        (
            lambda: StateSpec(
                mixer=StateMixer.MAMBA1,
                tensors=(
                    StateTensor(name="conv", shape=(1,), dtype=BF16),
                    StateTensor(name="conv", shape=(2,), dtype=BF16),
                ),
            ),
            r"StateSpec.tensors: duplicate tensor names in \['conv', 'conv'\]",
        ),
        (
            lambda: StateSpec(
                mixer="rwkv", tensors=(StateTensor(name="s", shape=(1,), dtype=BF16),)
            ),  # type: ignore[arg-type]
            r"StateSpec.mixer: unknown mixer 'rwkv'; valid: mamba1",
        ),
        (
            lambda: NoCacheSpec(reason=NoCacheReason.KV_SHARED),
            r"NoCacheSpec.source_layer: a kv_shared layer needs the index",
        ),
        (lambda: NoCacheSpec(reason="moe"), r"NoCacheSpec.reason: unknown reason 'moe'"),  # type: ignore[arg-type]
    ],
)
def test_validation_errors_name_field_and_value(build: Any, message: str) -> None:
    with pytest.raises(SpecError, match=message):
        build()


def test_specs_are_frozen() -> None:
    spec = full()
    with pytest.raises(AttributeError):
        spec.num_kv_heads = 4  # type: ignore[misc]


# --- LayerSpec / ModelSpec -------------------------------------------------------------------


def tiny_model() -> ModelSpec:
    return ModelSpec(
        name="tiny",
        model_type="falcon_h1",
        layers=(
            LayerSpec(index=0, layer_type="hybrid", caches=(full(), mamba2())),
            LayerSpec(index=1, layer_type="sliding_attention", caches=(sliding(window=4),)),
            no_cache_layer(2),
            LayerSpec(
                index=3,
                layer_type="sliding_attention",
                caches=(NoCacheSpec(reason=NoCacheReason.KV_SHARED, source_layer=1),),
            ),
        ),
        tp_size=2,
        max_position_embeddings=4096,
        notes=("a note",),
    )


def test_layer_spec_sizes() -> None:
    model = tiny_model()
    assert model.num_layers == 4
    assert model.layers[0].resident_bytes(10) == 10 * 2048 + 5376
    assert model.layers[2].stores_nothing
    assert not model.layers[0].stores_nothing


def test_model_entries_and_totals() -> None:
    model = tiny_model()
    assert [(e.layer, e.slot) for e in model.entries()] == [(0, 0), (0, 1), (1, 0)]
    assert [(e.layer, e.slot) for e in model.entries(include_empty=True)] == [
        (0, 0),
        (0, 1),
        (1, 0),
        (2, 0),
        (3, 0),
    ]
    assert model.resident_bytes(10) == 10 * 2048 + 5376 + 4 * 2048
    assert model.full_attention_equivalent_bytes_per_token() == 2048 + 0 + 2048


def test_model_round_trip() -> None:
    model = tiny_model()
    data = model.to_dict()
    assert data["layers"][3]["caches"] == [
        {"kind": "none", "reason": "kv_shared", "source_layer": 1}
    ]
    assert ModelSpec.from_dict(data) == model


def test_model_from_dict_missing_field() -> None:
    data = tiny_model().to_dict()
    del data["layers"][0]["layer_type"]
    with pytest.raises(SpecError, match=r"ModelSpec: missing field 'layer_type'"):
        ModelSpec.from_dict(data)


def test_layer_and_model_validation() -> None:
    with pytest.raises(SpecError, match=r"LayerSpec.index: must be an integer >= 0, got -1"):
        LayerSpec(index=-1, layer_type="x", caches=(full(),))
    with pytest.raises(SpecError, match=r"LayerSpec.caches: layer 0 has no spec"):
        LayerSpec(index=0, layer_type="x", caches=())
    with pytest.raises(SpecError, match=r"layer 0 mixes NoCacheSpec with real caches"):
        LayerSpec(index=0, layer_type="x", caches=(full(), NoCacheSpec()))
    with pytest.raises(SpecError, match=r"ModelSpec.layers: model 'm' has no layers"):
        ModelSpec(name="m", model_type="llama", layers=())
    with pytest.raises(SpecError, match=r"layer at position 0 has index 1"):
        ModelSpec(name="m", model_type="llama", layers=(no_cache_layer(1),))
    with pytest.raises(SpecError, match=r"ModelSpec.tp_size: must be a positive integer, got 0"):
        ModelSpec(name="m", model_type="llama", layers=(no_cache_layer(0),), tp_size=0)
