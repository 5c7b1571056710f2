"""Bind a memory layout to a measured model: which group serves each layer, and how.

:func:`bind_layout` checks a :class:`~hybridkv.plan.MemoryLayout` against a
:class:`~hybridkv.engine.probe.ModelProbe` and returns a :class:`ModelBinding`, the runner's
per-layer routing table:

* attention layers (full, sliding, chunked) -> a :class:`TokenRoute` of kind ``attention``:
  the paged attention function writes and gathers their K/V;
* MLA layers -> a :class:`TokenRoute` of kind ``mla``: the cache layer pages the latent;
* recurrent layers -> a :class:`StateRoute`: states are loaded from and stored to slots;
* KV-shared layers (gemma4) -> ``shared``: they attend over their source layer's blocks
  through its route, writing nothing.

A layer with attention and a recurrent state (falcon_h1's ``hybrid`` layers) has both routes:
its attention cache is one group's member (its slot in the spec, 0) and its state another's
(slot 1).

Checks (each failure is a :class:`BindingError` naming the layer, the group and both values):
every cache a layer keeps (K/V, latent, state) is served by exactly one group, a member
``(layer, slot)`` of which it is, whose spec kind matches the layer (window / chunk, heads and
head sizes, latent sizes, state tensors), and every group member is such a cache.  Dtypes may
differ (the cache may be bf16 or fp8 while the model runs fp32); values are cast on write and
read.

State tensors pair with transformers' ``conv_states`` / ``recurrent_states`` by name: a name
starting with ``conv`` is a conv state, any other name a recurrent state, in order.  A conv
tensor may keep transformers' full kernel width ``K`` or only the ``K - 1`` columns a causal
conv needs (the oldest column never reaches an output); recurrent shapes must match exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, NamedTuple, cast

import torch

from hybridkv.engine.errors import BindingError
from hybridkv.engine.probe import ModelProbe, ProbedLayer
from hybridkv.engine.views import group_block_ids
from hybridkv.plan import GroupPlan, MemoryLayout
from hybridkv.specs import (
    AttentionSpec,
    CacheKind,
    ChunkedLocalSpec,
    MLASpec,
    SlidingWindowSpec,
    StateSpec,
)

__all__ = [
    "ModelBinding",
    "RouteKind",
    "StateRoute",
    "StateTensorRoute",
    "TokenRoute",
    "bind_layout",
]


class RouteKind(StrEnum):
    """How the runner serves a layer."""

    ATTENTION = "attention"
    MLA = "mla"
    STATE = "state"


class TokenRoute(NamedTuple):
    """A per-token cache layer (attention or MLA) and the group that pages it."""

    kind: RouteKind
    layer: int
    slot: int
    group: GroupPlan
    num_block_ids: int


class StateTensorRoute(NamedTuple):
    """One stored state tensor and the transformers state it mirrors.

    ``role`` is ``conv`` or ``recurrent``; ``state_idx`` the transformers state index;
    ``hf_shape`` / ``hf_dtype`` the per-request shape and dtype transformers uses; ``shape``
    the stored one (equal, or a conv state with one column fewer).
    """

    name: str
    role: str
    state_idx: int
    hf_shape: tuple[int, ...]
    hf_dtype: torch.dtype
    shape: tuple[int, ...]


class StateRoute(NamedTuple):
    """A recurrent layer, its state group and its tensors."""

    layer: int
    slot: int
    group: GroupPlan
    num_block_ids: int
    tensors: tuple[StateTensorRoute, ...]


@dataclass(frozen=True)
class ModelBinding:
    """The runner's routing table.  ``tokens`` and ``states`` are keyed by layer index."""

    tokens: dict[int, TokenRoute]
    states: dict[int, StateRoute]
    num_layers: int
    #: KV-shared layer -> the layer whose route it reads through (never writes).
    shared: dict[int, int] = field(default_factory=dict)

    @property
    def has_state(self) -> bool:
        return bool(self.states)

    def token_groups(self) -> dict[int, tuple[GroupPlan, int]]:
        """Token groups in use: ``group_id -> (group, num_block_ids)``."""
        return {r.group.group_id: (r.group, r.num_block_ids) for r in self.tokens.values()}

    def state_groups(self) -> dict[int, tuple[GroupPlan, int]]:
        """State groups in use: ``group_id -> (group, num_block_ids)``."""
        return {r.group.group_id: (r.group, r.num_block_ids) for r in self.states.values()}


def _error(
    layer: ProbedLayer, group: GroupPlan, what: str, want: object, got: object
) -> BindingError:
    return BindingError(
        f"layout: group {group.group_id} serves layer {layer.layer} "
        f"({layer.layer_type}) but its {what} is {got!r}; the model needs {want!r}"
    )


def _mismatch(layer: ProbedLayer, group: GroupPlan, what: str, want: object, got: object) -> None:
    if want != got:
        raise _error(layer, group, what, want, got)


#: Layer types of layers with attention and a recurrent state -> their attention's type.
_HYBRID_TYPES = {"hybrid": "full_attention", "hybrid_sliding": "sliding_attention"}


def _check_kv(layer: ProbedLayer, group: GroupPlan, layer_type: str) -> AttentionSpec:
    spec = cast(AttentionSpec, group.spec)
    if layer.kv is None or layer.mla:
        raise _error(layer, group, "spec kind", "an MLA or state spec", spec.kind.value)
    measured = _HYBRID_TYPES.get(layer.layer_type, layer.layer_type)
    _mismatch(layer, group, "kind", measured, layer_type)
    heads, k_dim, v_dim = layer.kv
    _mismatch(layer, group, "num_kv_heads", heads, spec.num_kv_heads)
    _mismatch(layer, group, "head_dim", k_dim, spec.head_dim)
    _mismatch(layer, group, "v_dim", v_dim, spec.v_dim)
    return spec


def _check_full(layer: ProbedLayer, group: GroupPlan) -> RouteKind:
    _check_kv(layer, group, "full_attention")
    return RouteKind.ATTENTION


def _check_sliding(layer: ProbedLayer, group: GroupPlan) -> RouteKind:
    spec = cast(SlidingWindowSpec, _check_kv(layer, group, "sliding_attention"))
    _mismatch(layer, group, "window", layer.window, spec.window)
    _mismatch(layer, group, "sink_tokens", layer.sink_tokens, spec.sink_tokens)
    return RouteKind.ATTENTION


def _check_chunked(layer: ProbedLayer, group: GroupPlan) -> RouteKind:
    spec = cast(ChunkedLocalSpec, _check_kv(layer, group, "chunked_attention"))
    _mismatch(layer, group, "chunk_size", layer.window, spec.chunk_size)
    return RouteKind.ATTENTION


def _check_mla(layer: ProbedLayer, group: GroupPlan) -> RouteKind:
    spec = cast(MLASpec, group.spec)
    if layer.kv is None or not layer.mla:
        raise _error(layer, group, "spec kind", "a non-MLA spec", spec.kind.value)
    _, rank, rope = layer.kv
    _mismatch(layer, group, "kv_lora_rank", rank, spec.kv_lora_rank)
    _mismatch(layer, group, "qk_rope_head_dim", rope, spec.qk_rope_head_dim)
    return RouteKind.MLA


def _check_state(layer: ProbedLayer, group: GroupPlan) -> RouteKind:
    if not layer.states:
        raise _error(layer, group, "spec kind", "a per-token kind", group.spec.kind.value)
    return RouteKind.STATE


#: spec kind -> check of a layer against a group of that kind.
_CHECKS: dict[CacheKind, Callable[[ProbedLayer, GroupPlan], RouteKind]] = {
    CacheKind.FULL: _check_full,
    CacheKind.SLIDING: _check_sliding,
    CacheKind.CHUNKED: _check_chunked,
    CacheKind.MLA: _check_mla,
    CacheKind.STATE: _check_state,
}


def _state_tensors(layer: ProbedLayer, group: GroupPlan) -> tuple[StateTensorRoute, ...]:
    spec = cast(StateSpec, group.spec)
    stored = {
        "conv": [t for t in spec.tensors if t.name.startswith("conv")],
        "recurrent": [t for t in spec.tensors if not t.name.startswith("conv")],
    }
    measured = {role: [s for s in layer.states if s.role == role] for role in ("conv", "recurrent")}
    routes: list[StateTensorRoute] = []
    for role in ("conv", "recurrent"):
        names = [t.name for t in stored[role]]
        if len(stored[role]) != len(measured[role]):
            raise BindingError(
                f"layout: group {group.group_id} stores {role} tensors {names} for layer "
                f"{layer.layer}, but transformers keeps {len(measured[role])} {role} state(s) "
                f"with shapes {[s.shape for s in measured[role]]}"
            )
        for tensor, state in zip(stored[role], measured[role], strict=True):
            ok = tensor.shape == state.shape or (
                role == "conv"
                and tensor.shape[:-1] == state.shape[:-1]
                and tensor.shape[-1] == state.shape[-1] - 1
            )
            if not ok:
                raise BindingError(
                    f"layout: group {group.group_id} stores {role} tensor {tensor.name!r} of "
                    f"layer {layer.layer} with shape {tensor.shape}; transformers keeps "
                    f"{state.shape}"
                )
            routes.append(
                StateTensorRoute(
                    tensor.name, role, state.state_idx, state.shape, state.dtype, tensor.shape
                )
            )
    return tuple(routes)


def bind_layout(probe: ModelProbe, layout: MemoryLayout) -> ModelBinding:
    """Check ``layout`` against ``probe`` and build the routing table (see the module doc).

    Raises :class:`BindingError`; mutates nothing.
    """
    owner: dict[tuple[int, int], GroupPlan] = {}
    served: dict[int, list[tuple[int, GroupPlan]]] = {}
    for group in layout.groups:
        for layer_idx, slot in group.members:
            if not 0 <= layer_idx < len(probe.layers):
                raise BindingError(
                    f"layout: group {group.group_id} has member layer {layer_idx}; the model "
                    f"has layers 0..{len(probe.layers) - 1}"
                )
            if (layer_idx, slot) in owner:
                raise BindingError(
                    f"layout: layer {layer_idx} slot {slot} is a member of groups "
                    f"{owner[layer_idx, slot].group_id} and {group.group_id}"
                )
            owner[layer_idx, slot] = group
            served.setdefault(layer_idx, []).append((slot, group))
    tokens: dict[int, TokenRoute] = {}
    states: dict[int, StateRoute] = {}
    for layer in probe.layers:
        found = served.get(layer.layer, [])
        caches = layer.kv is not None or bool(layer.states)
        if not found:
            if caches:
                raise BindingError(
                    f"layout: layer {layer.layer} ({layer.layer_type}) caches data but is a "
                    "member of no group"
                )
            continue
        for slot, group in sorted(found, key=lambda item: item[0]):
            check = _CHECKS.get(group.spec.kind)
            if check is None or not caches:
                raise BindingError(
                    f"layout: group {group.group_id} ({group.spec.kind.value}) serves layer "
                    f"{layer.layer} ({layer.layer_type}), which caches nothing of that kind"
                )
            kind = check(layer, group)
            want = 1 if kind is RouteKind.STATE and layer.kv is not None else 0
            if slot != want:
                raise BindingError(
                    f"layout: group {group.group_id} has member (layer {layer.layer}, slot "
                    f"{slot}); that layer's {'state' if kind is RouteKind.STATE else 'K/V'} "
                    f"is its cache slot {want}"
                )
            num_ids = group_block_ids(layout, group.group_id)
            routes: dict[int, Any] = states if kind is RouteKind.STATE else tokens
            if layer.layer in routes:
                raise BindingError(
                    f"layout: layer {layer.layer} ({layer.layer_type}) has two "
                    f"{'state' if kind is RouteKind.STATE else 'per-token'} groups, "
                    f"{routes[layer.layer].group.group_id} and {group.group_id}"
                )
            if kind is RouteKind.STATE:
                states[layer.layer] = StateRoute(
                    layer.layer, slot, group, num_ids, _state_tensors(layer, group)
                )
            else:
                tokens[layer.layer] = TokenRoute(kind, layer.layer, slot, group, num_ids)
        token = tokens.get(layer.layer)
        if token is not None and token.kind is RouteKind.MLA and layer.layer in states:
            raise BindingError(
                f"layout: layer {layer.layer} ({layer.layer_type}) has MLA and a recurrent "
                "state; the runner does not page a latent next to a state in one layer"
            )
        for what, present, routed in (
            ("K/V", layer.kv is not None, tokens),
            ("a recurrent state", bool(layer.states), states),
        ):
            if present and layer.layer not in routed:
                raise BindingError(
                    f"layout: layer {layer.layer} ({layer.layer_type}) caches {what} but no "
                    "group serves it"
                )
    shared: dict[int, int] = {}
    for layer in probe.layers:
        if layer.kv_source is None:
            continue
        source = tokens.get(layer.kv_source)
        if source is None or source.kind is not RouteKind.ATTENTION:
            raise BindingError(
                f"layout: layer {layer.layer} ({layer.layer_type}) reads layer "
                f"{layer.kv_source}'s K/V, which no attention group pages"
            )
        shared[layer.layer] = layer.kv_source
    return ModelBinding(tokens=tokens, states=states, num_layers=len(probe.layers), shared=shared)
