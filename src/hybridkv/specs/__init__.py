"""Per-layer cache specs: what each layer stores and for how long.  No torch."""

from __future__ import annotations

from hybridkv.specs.dtypes import DType
from hybridkv.specs.kinds import (
    MAX_TOKENS,
    WINDOW_KINDS,
    AttentionSpec,
    CacheKind,
    CacheSpec,
    ChunkedLocalSpec,
    FullAttentionSpec,
    MLASpec,
    NoCacheReason,
    NoCacheSpec,
    SlidingWindowSpec,
    StateMixer,
    StateSpec,
    StateTensor,
    spec_from_dict,
)
from hybridkv.specs.model import CacheEntry, LayerSpec, ModelSpec, no_cache_layer

__all__ = [
    "MAX_TOKENS",
    "WINDOW_KINDS",
    "AttentionSpec",
    "CacheEntry",
    "CacheKind",
    "CacheSpec",
    "ChunkedLocalSpec",
    "DType",
    "FullAttentionSpec",
    "LayerSpec",
    "MLASpec",
    "ModelSpec",
    "NoCacheReason",
    "NoCacheSpec",
    "SlidingWindowSpec",
    "StateMixer",
    "StateSpec",
    "StateTensor",
    "no_cache_layer",
    "spec_from_dict",
]
