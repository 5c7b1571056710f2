"""The transformers ``Cache`` the runner passes to the model for one forward pass.

transformers' modeling code talks to its cache in three ways, and each gets its own layer:

* attention layers call ``update(key, value)`` and attend over what it returns:
  :class:`PassThroughLayer` returns the new tokens' K/V unchanged, and the paged attention
  function (:mod:`hybridkv.engine.attention`) writes and gathers them;
* MLA layers call ``update(kv_latent, k_rope)`` with the compressed latent of the new tokens:
  :class:`LatentLayer` writes it into the paged latent view and returns the latent of every
  token each query may see, which the module expands to per-head K/V itself (so the cache holds
  ``kv_lora_rank + rope_dim`` values per token, not the expanded heads);
* recurrent layers read and update conv / recurrent states: a stock ``LinearAttentionLayer``
  that :func:`load_states` fills from the state slots before the pass and
  :func:`collect_states` reads back after it (a :class:`StatePassThroughLayer` for a layer
  that also attends, as falcon_h1's).

Layers that cache nothing get transformers' ``DummyLayer``.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DummyLayer, LinearAttentionLayer

from hybridkv.engine.binding import StateRoute
from hybridkv.engine.errors import EngineError

__all__ = [
    "LatentLayer",
    "LatentPager",
    "PassThroughLayer",
    "StatePassThroughLayer",
    "UpdateListener",
    "build_cache",
    "collect_states",
    "dummy_layer",
    "load_states",
]


class LatentPager(Protocol):
    """What a :class:`LatentLayer` hands its latent to (the runner's forward step)."""

    def page_latent(
        self, layer: int, kv_latent: torch.Tensor, k_rope: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new tokens' latent, return the gathered latent of the visible tokens."""
        ...


class UpdateListener(Protocol):
    """Told which layer's cache the model updated last (the runner's forward step): a module
    that attends for several layers (zamba2's shared attention, ``layer_idx`` -1) names its
    layer only in the cache update that precedes its attention call."""

    updated_layer: int | None


class PassThroughLayer(CacheLayerMixin):  # type: ignore[no-untyped-call]
    """An attention layer's cache that keeps nothing: paging happens in the attention call.

    ``seq_length`` is what ``get_seq_length()`` reports: the computed tokens of every row of
    the pass (the runner only sets it when all rows agree).  An update tells ``listener``
    that layer ``layer`` is about to attend.
    """

    is_sliding = False

    def __init__(
        self, seq_length: int = 0, *, layer: int = -1, listener: UpdateListener | None = None
    ) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.is_initialized = True
        self.seq_length = seq_length
        self.layer = layer
        self.listener = listener

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.listener is not None:
            self.listener.updated_layer = self.layer
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return query_length, 0

    def get_seq_length(self) -> int:
        return self.seq_length

    def get_max_length(self) -> int:
        return -1


class LatentLayer(PassThroughLayer):  # type: ignore[no-untyped-call]
    """An MLA layer's cache: pages the latent through ``pager`` (see the module docstring)."""

    def __init__(self, layer: int, pager: LatentPager, seq_length: int = 0) -> None:
        super().__init__(seq_length, layer=layer)
        self.pager = pager

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.pager.page_latent(self.layer, key_states, value_states)


class StatePassThroughLayer(  # type: ignore[no-untyped-call, override]
    LinearAttentionLayer, PassThroughLayer
):
    """A layer with attention and a recurrent state (falcon_h1's ``hybrid`` layers): its states
    live as in a ``LinearAttentionLayer``, its attention passes through (paged elsewhere)."""

    def __init__(
        self,
        number_of_states: int,
        seq_length: int = 0,
        *,
        layer: int = -1,
        listener: UpdateListener | None = None,
    ) -> None:
        PassThroughLayer.__init__(self, seq_length, layer=layer, listener=listener)
        LinearAttentionLayer.__init__(self, number_of_states=number_of_states)

    def lazy_initialization(self, *args: Any, **kwargs: Any) -> None:
        if args:  # the attention update's (key, value): nothing to set up
            return None
        LinearAttentionLayer.lazy_initialization(self, **kwargs)
        return None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return PassThroughLayer.update(self, key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return query_length, 0

    def get_seq_length(self) -> int:
        return self.seq_length


def build_cache(layers: list[Any]) -> Cache:
    """A transformers ``Cache`` over prepared per-layer objects."""
    return Cache(layers=layers)


def dummy_layer() -> Any:
    """transformers' no-op cache layer, for layers that cache nothing."""
    return DummyLayer()  # type: ignore[no-untyped-call]


def load_states(
    route: StateRoute,
    slots: list[int] | None,
    views: Any,
    *,
    device: torch.device,
    attention: int | None = None,
    listener: UpdateListener | None = None,
) -> LinearAttentionLayer:
    """A ``LinearAttentionLayer`` holding the states of ``slots`` (one per batch row); with
    ``attention`` (the pass's sequence length), a :class:`StatePassThroughLayer` for a layer
    that also attends.

    ``slots=None`` means every row starts from scratch: the layer is left empty and
    transformers initialises it as in a first prefill.  The states are copied to ``device``
    (the model's).  Reads the views; writes nothing.
    """
    number = 1 + max((t.state_idx for t in route.tensors), default=0)
    made = (
        LinearAttentionLayer(number_of_states=number)
        if attention is None
        else StatePassThroughLayer(number, attention, layer=route.layer, listener=listener)
    )
    layer: Any = made
    if slots is None:
        return made
    layer.device = device
    for t in route.tensors:
        view = views.state(route.layer, route.slot, t.name)
        index = torch.tensor(slots, dtype=torch.long, device=view.device)
        stored = view.index_select(0, index).to(device)
        full = torch.zeros((len(slots), *t.hf_shape), dtype=t.hf_dtype, device=device)
        width = t.shape[-1]
        full[..., full.shape[-1] - width :] = stored.to(t.hf_dtype)
        if t.role == "conv":
            layer.dtype = t.hf_dtype
            layer.conv_states[t.state_idx] = full
            layer.conv_kernel_size[t.state_idx] = t.hf_shape[-1]
            layer.is_conv_states_initialized[t.state_idx] = True
        else:
            layer.recurrent_states[t.state_idx] = full
            layer.is_recurrent_states_initialized[t.state_idx] = True
        layer.has_previous_state[t.state_idx] = True
    return made


def collect_states(route: StateRoute, layer: LinearAttentionLayer) -> dict[str, torch.Tensor]:
    """The states a pass left in ``layer``, per stored tensor name, ``[rows, *stored shape]``.

    Raises :class:`EngineError` when transformers did not produce a state the route stores.
    """
    out: dict[str, torch.Tensor] = {}
    for t in route.tensors:
        store = layer.conv_states if t.role == "conv" else layer.recurrent_states
        tensor = store.get(t.state_idx)
        if tensor is None:
            raise EngineError(
                f"state: layer {route.layer} produced no {t.role} state {t.state_idx} "
                f"(stored as {t.name!r}) in this pass"
            )
        out[t.name] = tensor[..., tensor.shape[-1] - t.shape[-1] :]
    return out
