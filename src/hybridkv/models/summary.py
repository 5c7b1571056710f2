"""Short human-readable descriptions of cache specs, for listings and reports.  No torch.

``cache_label`` names a cache's kind and its key parameter (``"sliding(128)"``, ``"mamba2"``);
``kind_counts`` tallies those labels over a model; ``cache_detail`` spells out shapes.

>>> from hybridkv.models import resolve_model
>>> kind_counts(resolve_model("gpt-oss-20b"))
{'sliding(128)': 12, 'full': 12}
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import cast

from hybridkv.specs import (
    AttentionSpec,
    CacheKind,
    CacheSpec,
    ChunkedLocalSpec,
    MLASpec,
    ModelSpec,
    NoCacheReason,
    NoCacheSpec,
    SlidingWindowSpec,
    StateSpec,
)

__all__ = ["cache_detail", "cache_label", "format_kind_counts", "kind_counts"]

_DTYPE_SHORT: dict[str, str] = {
    "float32": "fp32",
    "bfloat16": "bf16",
    "float16": "fp16",
    "float8_e4m3fn": "fp8e4m3",
    "float8_e5m2": "fp8e5m2",
}


def _short(dtype: str) -> str:
    return _DTYPE_SHORT.get(dtype, dtype)


# The registry below dispatches on ``spec.kind``, so each function's cast is exact.
def _label_none(spec: CacheSpec) -> str:
    none = cast(NoCacheSpec, spec)
    return "kv_shared" if none.reason is NoCacheReason.KV_SHARED else "none"


def _label_state(spec: CacheSpec) -> str:
    return cast(StateSpec, spec).mixer.value


def _label_sliding(spec: CacheSpec) -> str:
    sliding = cast(SlidingWindowSpec, spec)
    sinks = f"+{sliding.sink_tokens}sink" if sliding.sink_tokens else ""
    return f"sliding({sliding.window}{sinks})"


def _label_chunked(spec: CacheSpec) -> str:
    return f"chunked({cast(ChunkedLocalSpec, spec).chunk_size})"


_LABELS: dict[CacheKind, Callable[[CacheSpec], str]] = {
    CacheKind.FULL: lambda spec: "full",
    CacheKind.SLIDING: _label_sliding,
    CacheKind.CHUNKED: _label_chunked,
    CacheKind.MLA: lambda spec: "mla",
    CacheKind.STATE: _label_state,
    CacheKind.NONE: _label_none,
}


def cache_label(spec: CacheSpec) -> str:
    """The kind label: ``full``, ``sliding(W)``, ``chunked(C)``, ``mla``, a state mixer name
    (``mamba2``...), ``none`` or ``kv_shared``."""
    return _LABELS[spec.kind](spec)


def kind_counts(spec: ModelSpec) -> dict[str, int]:
    """How many caches of each :func:`cache_label` the model has, in first-seen order.

    A layer with two caches (falcon_h1) counts once per cache; no-cache layers count too.
    """
    counts = Counter(cache_label(c) for _, _, c in spec.entries(include_empty=True))
    return dict(counts)


def format_kind_counts(counts: dict[str, int]) -> str:
    """``"12 sliding(128) + 12 full"``."""
    return " + ".join(f"{n} {label}" for label, n in counts.items())


def cache_detail(spec: CacheSpec) -> str:
    """Shapes and dtypes of one cache: ``"8 kv x 64, bf16, sinks"``, ``"conv 160x4 bf16"``..."""
    if isinstance(spec, AttentionSpec):
        dims = (
            f"{spec.head_dim}" if spec.v_dim == spec.head_dim else f"{spec.head_dim}/{spec.v_dim}"
        )
        sinks = ", sinks" if spec.learned_sinks else ""
        return f"{spec.num_kv_heads} kv x {dims}, {_short(spec.dtype.value)}{sinks}"
    if isinstance(spec, MLASpec):
        return f"latent {spec.kv_lora_rank}+{spec.qk_rope_head_dim}, {_short(spec.dtype.value)}"
    if isinstance(spec, StateSpec):
        return ", ".join(
            f"{t.name} {'x'.join(str(d) for d in t.shape)} {_short(t.dtype.value)}"
            for t in spec.tensors
        )
    if isinstance(spec, NoCacheSpec) and spec.source_layer is not None:
        return f"reads layer {spec.source_layer}"
    return "-"
