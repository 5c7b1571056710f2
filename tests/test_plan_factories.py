"""Tiny hand-built specs and models for the planner tests (imported by test_plan_*.py).

Byte sizes are chosen to be easy to check by hand: ``full()`` stores 1 KV head of dim 4 in
fp32, i.e. 32 bytes per token (128 bytes per 4-token block).
"""

from __future__ import annotations

from collections.abc import Sequence

from hybridkv.specs import (
    CacheSpec,
    ChunkedLocalSpec,
    DType,
    FullAttentionSpec,
    LayerSpec,
    MLASpec,
    ModelSpec,
    SlidingWindowSpec,
    StateMixer,
    StateSpec,
    StateTensor,
    no_cache_layer,
)


def full(*, kv: int = 1, hd: int = 4, dtype: str = "fp32") -> FullAttentionSpec:
    return FullAttentionSpec(num_kv_heads=kv, head_dim=hd, dtype=DType.parse(dtype))


def sliding(
    window: int, *, kv: int = 1, hd: int = 4, sinks: int = 0, dtype: str = "fp32"
) -> SlidingWindowSpec:
    return SlidingWindowSpec(
        num_kv_heads=kv, head_dim=hd, dtype=DType.parse(dtype), window=window, sink_tokens=sinks
    )


def chunked(chunk: int, *, kv: int = 1, hd: int = 4) -> ChunkedLocalSpec:
    return ChunkedLocalSpec(num_kv_heads=kv, head_dim=hd, dtype=DType.FP32, chunk_size=chunk)


def mla(rank: int = 6, rope: int = 2) -> MLASpec:
    return MLASpec(kv_lora_rank=rank, qk_rope_head_dim=rope, dtype=DType.FP32)


def state(*shapes: tuple[int, ...], mixer: str = "mamba2") -> StateSpec:
    """A state spec with fp32 tensors of ``shapes`` (``4 * prod(shape)`` bytes each)."""
    tensors = tuple(
        StateTensor(name=f"t{i}", shape=shape, dtype=DType.FP32) for i, shape in enumerate(shapes)
    )
    return StateSpec(mixer=StateMixer(mixer), tensors=tensors)


def model(
    layers: Sequence[CacheSpec | tuple[CacheSpec, ...] | None],
    *,
    name: str = "tiny",
    max_position_embeddings: int | None = None,
) -> ModelSpec:
    """A model whose layer ``i`` carries ``layers[i]`` (None: stores nothing)."""
    out: list[LayerSpec] = []
    for i, caches in enumerate(layers):
        if caches is None:
            out.append(no_cache_layer(i))
            continue
        specs = caches if isinstance(caches, tuple) else (caches,)
        out.append(LayerSpec(index=i, layer_type=specs[0].kind.value, caches=specs))
    return ModelSpec(
        name=name,
        model_type="tiny",
        layers=tuple(out),
        max_position_embeddings=max_position_embeddings,
    )


def swa_full_model() -> ModelSpec:
    """Layers 0,2 sliding (window 8), 1,3 full; 32 bytes per token each."""
    return model([sliding(8), full(), sliding(8), full()])


def gemma_like(num_layers: int = 13, window: int = 8) -> ModelSpec:
    """Five sliding layers, then one full layer, repeated (gemma3's 5:1 pattern)."""
    return model([full() if i % 6 == 5 else sliding(window) for i in range(num_layers)])


def mamba_like() -> ModelSpec:
    """7 Mamba2 layers (352-byte state) and 3 full-attention layers, interleaved."""
    ssm = state((3, 8), (2, 4, 8))
    kinds = "MMAMMAMMAM"
    return model([full() if k == "A" else ssm for k in kinds])
