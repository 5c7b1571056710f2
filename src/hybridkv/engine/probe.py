"""Measure what a transformers model really caches, layer by layer.

:func:`probe_model` runs one two-token forward pass with a stock ``DynamicCache`` and reads
back, per layer, the layer type transformers assigns (``full_attention``,
``sliding_attention``, ``linear_attention``, ``conv``, ``dummy``, ...), the per-token K/V shapes
the cache layer stored and the per-request conv / recurrent state tensors.  The runner checks a
memory layout against this measurement (:mod:`hybridkv.engine.binding`), so a spec derived from
``config.json`` that disagrees with the code that actually runs is caught before any step.

:func:`probe_model_spec` turns the measurement into a :class:`~hybridkv.specs.ModelSpec`
(state tensors named as :mod:`hybridkv.models` names them: ``conv``, and ``ssm`` for Mamba or
``recurrent`` otherwise; shapes as transformers keeps them).  MLA is
recognised by a ``kv_lora_rank`` in the config and a one-head cached latent.

The probe's attention outputs are zeros (no paged step exists yet): the forward only has to
reach every cache layer.  The model is left as it was (its attention implementation is
switched for the pass and restored); the pass runs under ``no_grad``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, NamedTuple, cast

import torch
from transformers.cache_utils import (
    CacheLayerMixin,
    DynamicCache,
    LinearAttentionCacheLayerMixin,
    get_layer_types_and_kwargs,
)

from hybridkv.engine.attention import PAGED_ATTENTION, active_step, register_paged_attention
from hybridkv.engine.errors import BindingError
from hybridkv.specs import (
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
)

__all__ = [
    "STATE_MIXERS",
    "ModelProbe",
    "ProbedLayer",
    "ProbedState",
    "cache_argument",
    "output_cache",
    "probe_model",
    "probe_model_spec",
    "with_attention_sinks",
]

#: model_type -> the recurrent mixer its state layers run.
STATE_MIXERS: dict[str, StateMixer] = {
    "qwen3_next": StateMixer.GATED_DELTANET,
    "qwen3_5_text": StateMixer.GATED_DELTANET,
    "olmo_hybrid": StateMixer.GATED_DELTANET,
    "granitemoehybrid": StateMixer.MAMBA2,
    "nemotron_h": StateMixer.MAMBA2,
    "bamba": StateMixer.MAMBA2,
    "falcon_h1": StateMixer.MAMBA2,
    "zamba2": StateMixer.MAMBA2,
    "jamba": StateMixer.MAMBA1,
    "lfm2": StateMixer.SHORT_CONV,
    "lfm3": StateMixer.SHORT_CONV,
    "kimi_linear": StateMixer.KDA,
}


class ProbedState(NamedTuple):
    """One state tensor of a layer: ``role`` is ``conv`` or ``recurrent``, ``state_idx`` its
    state index in transformers' ``LinearAttentionLayer``, ``shape`` per request (no batch)."""

    role: str
    state_idx: int
    shape: tuple[int, ...]
    dtype: torch.dtype


class ProbedLayer(NamedTuple):
    """What decoder layer ``layer`` caches, as measured.

    ``kv`` is ``(heads, key_dim, value_dim)`` of the per-token cache (for MLA: ``(1,
    kv_lora_rank, rope_dim)``), ``None`` for layers without one.  ``window`` is the sliding
    window or attention chunk of sliding / chunked layers.
    """

    layer: int
    layer_type: str
    window: int | None
    kv: tuple[int, int, int] | None
    kv_dtype: torch.dtype | None
    mla: bool
    states: tuple[ProbedState, ...]
    sinks: bool = False
    #: A KV-shared layer (gemma4's last layers): it computes no K/V and attends over this
    #: earlier layer's (the last one of its type that stores them for sharing).
    kv_source: int | None = None
    #: StreamingLLM attention sinks: leading tokens a sliding-window layer reads besides its
    #: window.  Not measured (no transformers model has them): set by
    #: :func:`with_attention_sinks` when the engine is asked for them.
    sink_tokens: int = 0


class ModelProbe(NamedTuple):
    """The measurement of one model.

    ``reads_cache_length``: the modeling code calls ``past_key_values.get_seq_length()``
    inside its layers even with explicit ``position_ids`` (llama4's NoPE layers derive a query
    temperature from it), so one forward pass must only hold requests with the same number of
    computed tokens, one per batch row.
    """

    model_type: str
    layers: tuple[ProbedLayer, ...]
    reads_cache_length: bool = False

    @property
    def has_state(self) -> bool:
        return any(layer.states for layer in self.layers)


class _ZeroAttention:
    """A stand-in step for the probe pass: attention outputs zeros of the right shape, and
    records which layers pass learned sinks."""

    def __init__(self) -> None:
        self.sinks: set[int] = set()

    def attention(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        scaling: float,
        softcap: float | None,
        sinks: torch.Tensor | None,
        sliding_window: int | None,
    ) -> torch.Tensor:
        if sinks is not None:
            self.sinks.add(int(getattr(module, "layer_idx", -1)))
        b, h, length, _ = query.shape
        return query.new_zeros((b, length, h, value.shape[-1]))


def _states(layer: Any) -> tuple[ProbedState, ...]:
    out: list[ProbedState] = []
    for role, store in (("conv", layer.conv_states), ("recurrent", layer.recurrent_states)):
        for idx in sorted(store):
            tensor = store[idx]
            if tensor is not None:
                out.append(ProbedState(role, idx, tuple(tensor.shape[1:]), tensor.dtype))
    return tuple(out)


class _CountingCache(DynamicCache):
    """A stock ``DynamicCache`` that counts ``get_seq_length`` calls during the pass."""

    def __init__(self, config: Any) -> None:
        super().__init__(config=config)
        self.length_reads = 0

    def get_seq_length(self, layer_idx: int = 0) -> int:
        self.length_reads += 1
        return int(super().get_seq_length(layer_idx))


def _kv_sources(model: torch.nn.Module) -> dict[int, int]:
    """KV-shared layer -> the layer whose K/V it reads: the modules transformers marks
    ``is_kv_shared_layer`` read what the last earlier module of their ``layer_type`` marked
    ``store_full_length_kv`` stored (gemma4).  Raises :class:`BindingError` for a shared layer
    with no such source."""
    reuse: dict[int, Any] = {}
    store: list[tuple[int, Any]] = []
    for module in model.modules():
        idx = getattr(module, "layer_idx", None)
        if not isinstance(idx, int):
            continue
        if getattr(module, "is_kv_shared_layer", False) is True:
            reuse[idx] = getattr(module, "layer_type", None)
        elif getattr(module, "store_full_length_kv", False) is True:
            store.append((idx, getattr(module, "layer_type", None)))
    out: dict[int, int] = {}
    for layer, kind in reuse.items():
        sources = [j for j, other in store if other == kind and j < layer]
        if not sources:
            raise BindingError(
                f"probe: layer {layer} ({kind}) shares K/V but no earlier {kind} layer stores them"
            )
        out[layer] = max(sources)
    return out


def probe_model(model: torch.nn.Module) -> ModelProbe:
    """Run the probe pass (see the module docstring).

    The pass runs with the paged attention implementation (switched on for the pass and
    restored after), so transformers builds no masks and any ``get_seq_length`` call comes
    from the modeling code itself (:attr:`ModelProbe.reads_cache_length`).  Raises
    :class:`BindingError` when the model has no transformers config.
    """
    config: Any = getattr(model, "config", None)
    if config is None:
        raise BindingError(f"model: {type(model).__name__} has no transformers config")
    text = config.get_text_config(decoder=True)
    layer_types, layer_kwargs = get_layer_types_and_kwargs(text)
    device = next(model.parameters()).device
    cache = _CountingCache(config)
    ids = torch.zeros((1, 2), dtype=torch.long, device=device)
    positions = torch.arange(2, device=device)[None]
    zero = _ZeroAttention()
    register_paged_attention()
    previous = config._attn_implementation
    set_impl: Any = getattr(model, "set_attn_implementation")  # noqa: B009
    try:
        if previous != PAGED_ATTENTION:
            set_impl(PAGED_ATTENTION)
        with torch.no_grad(), active_step(zero):
            model(
                input_ids=ids,
                position_ids=positions,
                use_cache=True,
                **{cache_argument(model): cache},
            )
    finally:
        if previous != PAGED_ATTENTION:
            set_impl(previous)
    kv_lora_rank = getattr(text, "kv_lora_rank", None)
    sources = _kv_sources(model)
    layers: list[ProbedLayer] = []
    for i, (layer_type, kwargs) in enumerate(zip(layer_types, layer_kwargs, strict=True)):
        layer = cache.layers[i]
        kv: tuple[int, int, int] | None = None
        kv_dtype: torch.dtype | None = None
        if isinstance(layer, CacheLayerMixin) and layer.keys is not None and layer.keys.numel():
            values = cast(torch.Tensor, layer.values)
            kv = (int(layer.keys.shape[1]), int(layer.keys.shape[-1]), int(values.shape[-1]))
            kv_dtype = layer.keys.dtype
        states = _states(layer) if isinstance(layer, LinearAttentionCacheLayerMixin) else ()
        mla = kv is not None and kv[0] == 1 and kv_lora_rank is not None and kv[1] == kv_lora_rank
        window = kwargs.get("sliding_window")
        layers.append(
            ProbedLayer(
                layer=i,
                layer_type=str(layer_type),
                window=None if window is None else int(window),
                kv=kv,
                kv_dtype=kv_dtype,
                mla=mla,
                states=states,
                sinks=i in zero.sinks,
                kv_source=sources.get(i),
            )
        )
    return ModelProbe(
        model_type=str(text.model_type),
        layers=tuple(layers),
        reads_cache_length=cache.length_reads > 0,
    )


def _dtype(dtype: torch.dtype) -> DType:
    return DType.parse(str(dtype))


def _attention_spec(layer: ProbedLayer) -> CacheSpec:
    if layer.kv is None or layer.kv_dtype is None:
        raise BindingError(
            f"probe: layer {layer.layer} ({layer.layer_type}) cached no keys in the probe pass"
        )
    heads, k_dim, v_dim = layer.kv
    dtype = _dtype(layer.kv_dtype)
    if layer.mla:
        return MLASpec(kv_lora_rank=k_dim, qk_rope_head_dim=v_dim, dtype=dtype)
    common: dict[str, Any] = {
        "num_kv_heads": heads,
        "head_dim": k_dim,
        "v_head_dim": None if v_dim == k_dim else v_dim,
        "dtype": dtype,
        "learned_sinks": layer.sinks,
    }
    windowed = _WINDOWED.get(layer.layer_type)
    if windowed is not None and layer.window is not None:
        if layer.sink_tokens:  # only sliding layers have them
            common["sink_tokens"] = layer.sink_tokens
        return windowed(layer.window, common)
    return FullAttentionSpec(**common)


def cache_argument(model: Any) -> str:
    """The keyword ``model``'s forward takes its cache under: ``cache`` (transformers 5.24
    on, where ``past_key_values`` is deprecated) or ``past_key_values`` (before)."""
    forward = getattr(model, "forward", None)
    try:
        params = inspect.signature(forward).parameters if forward is not None else {}
    except (TypeError, ValueError):  # a forward without a readable signature
        params = {}
    return "cache" if "cache" in params else "past_key_values"


def output_cache(output: Any) -> Any:
    """The cache a transformers forward returned: ``output.cache`` (5.24 on) or
    ``output.past_key_values`` (before; kept there as a deprecated alias)."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values


def with_attention_sinks(probe: ModelProbe, sink_tokens: int) -> ModelProbe:
    """``probe`` with every sliding-window layer also reading the first ``sink_tokens`` tokens
    (StreamingLLM attention sinks: the engine keeps those blocks and its attention reads them;
    the model's own masks do not, so outputs differ from the model's by design).

    Raises :class:`BindingError` for a negative count or a model without sliding-window layers.
    """
    if not isinstance(sink_tokens, int) or isinstance(sink_tokens, bool) or sink_tokens < 0:
        raise BindingError(f"attention_sinks: must be an integer >= 0, got {sink_tokens!r}")
    if not sink_tokens:
        return probe
    sliding = {"sliding_attention", "hybrid_sliding"}
    if not any(layer.layer_type in sliding and layer.kv is not None for layer in probe.layers):
        types = sorted({layer.layer_type for layer in probe.layers})
        raise BindingError(
            f"attention_sinks: {sink_tokens} sink tokens need sliding-window layers; model_type "
            f"{probe.model_type!r} has layer types {', '.join(types)}"
        )
    layers = tuple(
        layer._replace(sink_tokens=sink_tokens)
        if layer.layer_type in sliding and layer.kv is not None
        else layer
        for layer in probe.layers
    )
    return probe._replace(layers=layers)


#: transformers layer type -> the spec of a windowed attention layer (window / chunk size).
_WINDOWED: dict[str, Callable[[int, dict[str, Any]], CacheSpec]] = {
    "sliding_attention": lambda window, kw: SlidingWindowSpec(window=window, **kw),
    "chunked_attention": lambda window, kw: ChunkedLocalSpec(chunk_size=window, **kw),
    "hybrid_sliding": lambda window, kw: SlidingWindowSpec(window=window, **kw),
}


def _state_spec(probe: ModelProbe, layer: ProbedLayer) -> CacheSpec:
    mixer = STATE_MIXERS.get(probe.model_type)
    if mixer is None:
        raise BindingError(
            f"probe: model_type {probe.model_type!r} has state layers but no known mixer; "
            f"known: {', '.join(sorted(STATE_MIXERS))}"
        )
    tensors = tuple(
        StateTensor(
            name=_state_name(mixer, s),
            shape=s.shape,
            dtype=_dtype(s.dtype),
        )
        for s in layer.states
    )
    return StateSpec(mixer=mixer, tensors=tensors)


def _state_name(mixer: StateMixer, state: ProbedState) -> str:
    base = state.role
    if state.role == "recurrent" and mixer in (StateMixer.MAMBA1, StateMixer.MAMBA2):
        base = "ssm"
    return base if state.state_idx == 0 else f"{base}_{state.state_idx}"


def probe_model_spec(probe: ModelProbe, *, name: str | None = None) -> ModelSpec:
    """A :class:`ModelSpec` of exactly what the probed model caches.

    A layer that keeps attention K/V and a recurrent state (transformers' ``hybrid`` layers,
    falcon_h1) gets two caches: the attention spec (slot 0), then the state spec (slot 1), as
    :mod:`hybridkv.models` derives them.  Raises :class:`BindingError` for a state mixer it
    does not know.
    """
    layers: list[LayerSpec] = []
    for layer in probe.layers:
        caches: list[CacheSpec] = []
        if layer.kv is not None:
            caches.append(_attention_spec(layer))
        if layer.states:
            caches.append(_state_spec(probe, layer))
        if not caches and layer.kv_source is not None:
            caches.append(NoCacheSpec(reason=NoCacheReason.KV_SHARED, source_layer=layer.kv_source))
        layers.append(
            LayerSpec(
                index=layer.layer,
                layer_type=layer.layer_type,
                caches=tuple(caches) or (NoCacheSpec(),),
            )
        )
    return ModelSpec(
        name=name or probe.model_type,
        model_type=probe.model_type,
        layers=tuple(layers),
        notes=("measured by hybridkv.engine.probe",),
    )
