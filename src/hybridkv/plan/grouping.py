"""Grouping: cache entries with identical specs share one block table per request.

A *spec group* is every ``(layer, slot)`` entry of a model whose :class:`CacheSpec` compares
equal.  Any number of groups, any layer order and any member counts are allowed; group ids
follow the order in which a spec first appears (layer order, then slot order).

Example: gpt-oss (sliding window on even layers, full attention on odd ones, 24 layers) gives
group 0 = sliding, members ``(0,0), (2,0) .. (22,0)``; group 1 = full, ``(1,0) .. (23,0)``.
"""

from __future__ import annotations

from typing import NamedTuple

from hybridkv.errors import PlanError, brief_repr
from hybridkv.plan.layout import GroupPlan, MemoryLayout
from hybridkv.plan.options import DEFAULT_STATE_BLOCK_SIZE, PlanOptions, kernel_block_size_for
from hybridkv.specs import CacheKind, CacheSpec, DType, ModelSpec, StateSpec

__all__ = [
    "TOKEN_KINDS",
    "BuiltLayout",
    "SpecGroup",
    "base_group_plans",
    "check_model",
    "element_alignment",
    "group_entries",
    "is_state",
]

#: Kinds that store bytes per token (their block size is a number of tokens of KV).
TOKEN_KINDS = frozenset({CacheKind.FULL, CacheKind.SLIDING, CacheKind.CHUNKED, CacheKind.MLA})


class SpecGroup(NamedTuple):
    """One spec and the ``(layer, slot)`` entries that carry it, in layer order."""

    spec: CacheSpec
    members: tuple[tuple[int, int], ...]


class BuiltLayout(NamedTuple):
    """What a strategy returns: the layout and human-readable notes on the choices it made."""

    layout: MemoryLayout
    notes: tuple[str, ...] = ()


def is_state(spec: CacheSpec) -> bool:
    """True for fixed-size per-request state kinds (one slot per block)."""
    return spec.kind is CacheKind.STATE


def element_alignment(spec: CacheSpec) -> int:
    """The largest element size (bytes) of the arrays ``spec`` stores: every page of the group
    starts at a multiple of it, so its ``page_bytes`` must be one (a state of an fp32 ``[1]``
    and an fp8 ``[3]`` tensor needs 7 bytes, but pages of 8 so the next page's fp32 lines up).
    """
    if isinstance(spec, StateSpec):
        return max((t.dtype.itemsize for t in spec.tensors), default=1)
    dtype = getattr(spec, "dtype", None)
    return dtype.itemsize if isinstance(dtype, DType) else 1


def aligned_page_bytes(spec: CacheSpec, block_size: int) -> int:
    """``spec.bytes_per_block(block_size)`` rounded up to a multiple of
    :func:`element_alignment` (unchanged for every attention and MLA page, whose bytes are
    whole elements of one type)."""
    align = element_alignment(spec)
    return -(-spec.bytes_per_block(block_size) // align) * align


def check_model(model: object) -> ModelSpec:
    """``model`` if it is a :class:`ModelSpec`; raises :class:`PlanError` naming what it is
    (a model name string: resolve it first)."""
    if isinstance(model, ModelSpec):
        return model
    hint = (
        f"; resolve a name first: hybridkv.models.resolve_model({model!r})"
        if isinstance(model, str)
        else " (hybridkv.models.resolve_model or spec_from_config make one)"
    )
    raise PlanError(f"model: expected a ModelSpec, got {brief_repr(model)}{hint}")


def group_entries(model: ModelSpec) -> tuple[SpecGroup, ...]:
    """Group ``model``'s caching entries by identical spec, in order of first appearance.

    Raises :class:`PlanError` when ``model`` is not a :class:`ModelSpec` or has no caching
    layer at all.  Pure: reads only.
    """
    check_model(model)
    by_spec: dict[CacheSpec, list[tuple[int, int]]] = {}
    for entry in model.entries():
        by_spec.setdefault(entry.spec, []).append((entry.layer, entry.slot))
    if not by_spec:
        raise PlanError(
            f"model: {model.name!r} has no caching layers ({model.num_layers} layers, all "
            "store nothing); a plan needs at least one attention, MLA or state layer"
        )
    return tuple(SpecGroup(spec, tuple(members)) for spec, members in by_spec.items())


def split_state_groups(groups: tuple[SpecGroup, ...], k: int) -> tuple[SpecGroup, ...]:
    """``groups`` with each state group cut into ``min(k, members)`` groups of consecutive
    members, the first ``members % parts`` of them one member larger (see
    ``PlanOptions.state_split``).  Pure."""
    out: list[SpecGroup] = []
    for group in groups:
        n = len(group.members)
        parts = min(k, n) if is_state(group.spec) else 1
        start = 0
        for i in range(parts):
            size = n // parts + (i < n % parts)
            out.append(SpecGroup(group.spec, group.members[start : start + size]))
            start += size
    return tuple(out)


def base_group_plans(groups: tuple[SpecGroup, ...], options: PlanOptions) -> tuple[GroupPlan, ...]:
    """Unpadded group plans: per-token groups use ``options.block_size``, state groups
    ``options.state_block_size`` (default 256 tokens); pages are
    ``spec.bytes_per_block(block_size)`` rounded up to a multiple of the largest element size
    (:func:`aligned_page_bytes`; exact for every model whose state bytes are whole elements
    of its largest type).  Used by the ``arena`` and ``pools`` strategies.
    """
    state_bs = options.state_block_size or DEFAULT_STATE_BLOCK_SIZE
    out: list[GroupPlan] = []
    for gid, group in enumerate(groups):
        bs = state_bs if is_state(group.spec) else options.block_size
        out.append(
            GroupPlan(
                group_id=gid,
                spec=group.spec,
                members=group.members,
                block_size=bs,
                kernel_block_size=kernel_block_size_for(group.spec, bs, options.kernel_block_size),
                page_bytes=aligned_page_bytes(group.spec, bs),
            )
        )
    return tuple(out)
