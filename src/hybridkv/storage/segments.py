"""What one member page holds: its named segments (K, V, MLA latent, state tensors).  No torch.

A *segment* is one typed array a layer stores per manager block:

=============================  =========  ==========================================
kind                           segments   per-block shape (logical, kernel order)
=============================  =========  ==========================================
full / sliding / chunked       ``k``      ``[block_size, num_kv_heads, head_dim]``
                               ``v``      ``[block_size, num_kv_heads, v_dim]``
MLA                            ``latent`` ``[block_size, kv_lora_rank + rope_dim]``
state (Mamba, DeltaNet, conv)  each       the tensor's own shape, e.g. ``[3, 256]``
                               tensor
=============================  =========  ==========================================

Segments are returned in *page order*, the order they are laid out inside a page.  Attention
and MLA keep the order above.  State tensors are ordered by element size, largest first
(stable within one size), so every tensor starts at an offset aligned to its own element size
without padding: ``ssm`` fp32 ``[4, 8]`` (128 B) then ``conv`` bf16 ``[3, 8]`` (48 B) packs
into 176 B.  The per-kind builders live in a registry keyed by :class:`CacheKind`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from math import prod

from hybridkv.specs import AttentionSpec, CacheKind, CacheSpec, DType, MLASpec, StateSpec
from hybridkv.storage.errors import ViewKindError

__all__ = ["HEADED_KINDS", "Segment", "max_itemsize", "page_segments"]

#: Kinds whose segments carry a KV-head axis (axis 1 of ``k`` and ``v``).
HEADED_KINDS: frozenset[CacheKind] = frozenset(
    {CacheKind.FULL, CacheKind.SLIDING, CacheKind.CHUNKED}
)


@dataclass(frozen=True, kw_only=True)
class Segment:
    """One typed array of a member page: ``name``, element ``dtype`` and per-block ``shape``."""

    name: str
    dtype: DType
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of this segment in one block (no padding)."""
        return self.numel * self.dtype.itemsize


def _attention(spec: CacheSpec, block_size: int) -> tuple[Segment, ...]:
    assert isinstance(spec, AttentionSpec)  # registry guarantees the kind
    heads = spec.num_kv_heads
    return (
        Segment(name="k", dtype=spec.dtype, shape=(block_size, heads, spec.head_dim)),
        Segment(name="v", dtype=spec.dtype, shape=(block_size, heads, spec.v_dim)),
    )


def _mla(spec: CacheSpec, block_size: int) -> tuple[Segment, ...]:
    assert isinstance(spec, MLASpec)
    return (Segment(name="latent", dtype=spec.dtype, shape=(block_size, spec.latent_dim)),)


def _state(spec: CacheSpec, block_size: int) -> tuple[Segment, ...]:
    assert isinstance(spec, StateSpec)
    ordered = sorted(spec.tensors, key=lambda t: -t.dtype.itemsize)  # stable sort
    return tuple(Segment(name=t.name, dtype=t.dtype, shape=t.shape) for t in ordered)


_BUILDERS: dict[CacheKind, Callable[[CacheSpec, int], tuple[Segment, ...]]] = {
    CacheKind.FULL: _attention,
    CacheKind.SLIDING: _attention,
    CacheKind.CHUNKED: _attention,
    CacheKind.MLA: _mla,
    CacheKind.STATE: _state,
}


def page_segments(spec: CacheSpec, block_size: int) -> tuple[Segment, ...]:
    """The segments one member page of ``spec`` holds, in page order.

    Raises :class:`ViewKindError` for a kind that stores nothing.
    """
    builder = _BUILDERS.get(spec.kind)
    if builder is None:
        valid = ", ".join(k.value for k in _BUILDERS)
        raise ViewKindError(f"spec.kind: {spec.kind.value!r} stores no page; valid: {valid}")
    return builder(spec, block_size)


def max_itemsize(segments: tuple[Segment, ...]) -> int:
    """Largest element size among ``segments`` (the alignment every page offset needs)."""
    return max(s.dtype.itemsize for s in segments)
