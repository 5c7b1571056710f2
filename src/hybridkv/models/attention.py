"""Softmax-attention architectures: full, sliding-window and chunked-local layers.

Covers llama, mistral, mixtral, qwen2, qwen3, gemma2, gemma3_text, cohere2, olmo3, gpt_oss
and llama4_text, plus :func:`attention_spec`, the per-layer builder the hybrid families reuse.

Layer kinds come from ``layer_types`` (transformers' normalised names ``full_attention``,
``sliding_attention``, ``chunked_attention``) when the config has it, otherwise from the same
rule the transformers config class applies in ``__post_init__`` (documented per function).
A sliding layer keeps a window of ``sliding_window`` tokens; a chunked layer attends within
aligned chunks of ``attention_chunk_size`` tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from hybridkv.errors import ConfigError
from hybridkv.models.config import Architecture, ConfigView, DeriveContext
from hybridkv.models.parallel import kv_heads_per_rank
from hybridkv.specs import (
    AttentionSpec,
    ChunkedLocalSpec,
    FullAttentionSpec,
    LayerSpec,
    SlidingWindowSpec,
)

__all__ = ["ARCHITECTURES", "AttentionShape", "attention_spec", "default_head_dim", "kv_heads"]


@dataclass(frozen=True, kw_only=True, slots=True)
class AttentionShape:
    """Per-layer attention geometry before tensor-parallel sharding (all counts unsharded).

    ``window`` is used by sliding layers, ``chunk`` by chunked layers; ``learned_sinks`` marks
    per-head sink logits (gpt-oss).
    """

    num_kv_heads: int
    head_dim: int
    window: int | None = None
    chunk: int | None = None
    learned_sinks: bool = False


def _full(ctx: DeriveContext, shape: AttentionShape, heads: int, cfg: ConfigView) -> AttentionSpec:
    return FullAttentionSpec(
        num_kv_heads=heads,
        head_dim=shape.head_dim,
        dtype=ctx.kv_dtype,
        learned_sinks=shape.learned_sinks,
    )


def _sliding(
    ctx: DeriveContext, shape: AttentionShape, heads: int, cfg: ConfigView
) -> AttentionSpec:
    if shape.window is None:
        raise cfg.missing("sliding_window", "a layer is 'sliding_attention' but no window is set")
    return SlidingWindowSpec(
        num_kv_heads=heads,
        head_dim=shape.head_dim,
        dtype=ctx.kv_dtype,
        window=shape.window,
        learned_sinks=shape.learned_sinks,
    )


def _chunked(
    ctx: DeriveContext, shape: AttentionShape, heads: int, cfg: ConfigView
) -> AttentionSpec:
    if shape.chunk is None:
        raise cfg.missing(
            "attention_chunk_size", "a layer is 'chunked_attention' but no chunk size is set"
        )
    return ChunkedLocalSpec(
        num_kv_heads=heads,
        head_dim=shape.head_dim,
        dtype=ctx.kv_dtype,
        chunk_size=shape.chunk,
        learned_sinks=shape.learned_sinks,
    )


_BUILDERS: dict[str, Callable[[DeriveContext, AttentionShape, int, ConfigView], AttentionSpec]] = {
    "full_attention": _full,
    "sliding_attention": _sliding,
    "chunked_attention": _chunked,
}


def attention_spec(
    cfg: ConfigView, ctx: DeriveContext, layer_type: str, shape: AttentionShape, *, layer: int
) -> AttentionSpec:
    """The cache spec of one attention layer of kind ``layer_type``, per tensor-parallel rank.

    Raises :class:`ConfigError` for an unknown ``layer_type`` (naming the layer), a missing
    window / chunk size, or a tp size that cannot shard the KV heads.
    """
    builder = _BUILDERS.get(layer_type)
    if builder is None:
        raise ConfigError(
            f"{cfg.model_type} config: layer {layer} has layer type {layer_type!r}; valid "
            f"attention layer types: {', '.join(_BUILDERS)}"
        )
    heads = kv_heads_per_rank(
        shape.num_kv_heads, ctx.tp_size, field="num_key_value_heads", model_type=cfg.model_type
    )
    queries = cfg.raw("num_attention_heads")
    if type(queries) is int and queries > 0 and queries % ctx.tp_size:
        # Found by review: tp=3 of 4 query heads planned one rank's cache without a word.
        raise ConfigError(
            f"{cfg.model_type}: tp_size={ctx.tp_size} does not divide "
            f"num_attention_heads={queries}; engines give every rank the same number of query "
            f"heads, so use a tp_size that divides {queries}"
        )
    if heads * ctx.tp_size > shape.num_kv_heads:
        ctx.note(
            f"tp_size={ctx.tp_size} > {shape.num_kv_heads} KV heads: each rank holds one "
            "replicated KV head"
        )
    return builder(ctx, shape, heads, cfg)


def kv_heads(cfg: ConfigView) -> int:
    """``num_key_value_heads``, defaulting to ``num_attention_heads`` (MHA)."""
    found = cfg.opt_int("num_key_value_heads")
    if found is None:
        return cfg.req_int("num_attention_heads")
    heads = cfg.opt_int("num_attention_heads")
    if heads is not None and (found < 1 or heads % found):
        raise ConfigError(
            f"{cfg.model_type} config: num_key_value_heads={found} does not divide "
            f"num_attention_heads={heads}; grouped-query attention shares each KV head among "
            "the same number of query heads"
        )
    return found


def default_head_dim(cfg: ConfigView) -> int:
    """``head_dim`` when set, else ``hidden_size // num_attention_heads``."""
    found = cfg.opt_int("head_dim")
    if found is not None:
        return found
    return _hidden_per_head(cfg)


def _hidden_per_head(cfg: ConfigView) -> int:
    hidden = cfg.req_int("hidden_size")
    heads = cfg.req_int("num_attention_heads")
    if hidden % heads:
        raise ConfigError(
            f"{cfg.model_type} config: hidden_size={hidden} is not a multiple of "
            f"num_attention_heads={heads}; set head_dim explicitly"
        )
    return hidden // heads


def _layer_types(cfg: ConfigView, num_layers: int, default: Callable[[int], str]) -> list[str]:
    """``layer_types`` from the config (checked for length) or ``default(i)`` per layer."""
    found = cfg.opt_str_list("layer_types")
    if found is None:
        return [default(i) for i in range(num_layers)]
    cfg.check_length("layer_types", found, num_layers)
    return found


def uniform_attention_layers(
    cfg: ConfigView, ctx: DeriveContext, layer_types: list[str], shape: AttentionShape
) -> list[LayerSpec]:
    """One LayerSpec per entry of ``layer_types``, all sharing ``shape``."""
    return [
        LayerSpec(index=i, layer_type=t, caches=(attention_spec(cfg, ctx, t, shape, layer=i),))
        for i, t in enumerate(layer_types)
    ]


def _derive_llama(cfg: ConfigView, ctx: DeriveContext) -> list[LayerSpec]:
    """Llama: every layer full attention (unless ``layer_types`` says otherwise)."""
    n = cfg.num_layers()
    types = _layer_types(cfg, n, lambda i: "full_attention")
    shape = AttentionShape(
        num_kv_heads=kv_heads(cfg),
        head_dim=default_head_dim(cfg),
        window=cfg.opt_int("sliding_window"),
    )
    return uniform_attention_layers(cfg, ctx, types, shape)


def _derive_mistral(cfg: ConfigView, ctx: DeriveContext) -> list[LayerSpec]:
    """Mistral / Mixtral: all layers slide over ``sliding_window`` when it is set, else full."""
    n = cfg.num_layers()
    window = cfg.opt_int("sliding_window")
    kind = "full_attention" if window is None else "sliding_attention"
    types = _layer_types(cfg, n, lambda i: kind)
    shape = AttentionShape(
        num_kv_heads=kv_heads(cfg), head_dim=default_head_dim(cfg), window=window
    )
    return uniform_attention_layers(cfg, ctx, types, shape)


def _derive_qwen(cfg: ConfigView, ctx: DeriveContext) -> list[LayerSpec]:
    """Qwen2/Qwen3: ``sliding_window`` (class default 4096) only counts with ``use_sliding_window``.

    Without ``layer_types``, layers ``i >= max_window_layers`` slide and the rest are full.
    """
    n = cfg.num_layers()
    window = (
        cfg.opt_int("sliding_window") if cfg.req_bool("use_sliding_window", default=False) else None
    )
    max_window_layers = cfg.req_int("max_window_layers", minimum=0)
    types = _layer_types(
        cfg,
        n,
        lambda i: (
            "sliding_attention"
            if window is not None and i >= max_window_layers
            else "full_attention"
        ),
    )
    shape = AttentionShape(
        num_kv_heads=kv_heads(cfg), head_dim=default_head_dim(cfg), window=window
    )
    return uniform_attention_layers(cfg, ctx, types, shape)


def _alternating(pattern: int) -> Callable[[int], str]:
    """transformers' ``sliding if (i + 1) % pattern else full`` layer rule."""
    return lambda i: "sliding_attention" if (i + 1) % pattern else "full_attention"


def _derive_gemma2(cfg: ConfigView, ctx: DeriveContext) -> list[LayerSpec]:
    """Gemma2: sliding and full layers alternate, starting with sliding."""
    types = _layer_types(cfg, cfg.num_layers(), _alternating(2))
    shape = AttentionShape(
        num_kv_heads=kv_heads(cfg),
        head_dim=default_head_dim(cfg),
        window=cfg.opt_int("sliding_window"),
    )
    return uniform_attention_layers(cfg, ctx, types, shape)


def _derive_gemma3(cfg: ConfigView, ctx: DeriveContext) -> list[LayerSpec]:
    """Gemma3 text: ``sliding_window_pattern - 1`` sliding layers, then one full (5:1 default)."""
    pattern = cfg.req_int("sliding_window_pattern")
    types = _layer_types(cfg, cfg.num_layers(), _alternating(pattern))
    shape = AttentionShape(
        num_kv_heads=kv_heads(cfg),
        head_dim=default_head_dim(cfg),
        window=cfg.opt_int("sliding_window"),
    )
    return uniform_attention_layers(cfg, ctx, types, shape)


def _derive_cohere2(cfg: ConfigView, ctx: DeriveContext) -> list[LayerSpec]:
    """Cohere2: 3 sliding : 1 full by default; head size is always hidden / heads."""
    pattern = cfg.req_int("sliding_window_pattern")
    types = _layer_types(cfg, cfg.num_layers(), _alternating(pattern))
    shape = AttentionShape(
        num_kv_heads=kv_heads(cfg),
        head_dim=_hidden_per_head(cfg),
        window=cfg.opt_int("sliding_window"),
    )
    return uniform_attention_layers(cfg, ctx, types, shape)


def _derive_olmo3(cfg: ConfigView, ctx: DeriveContext) -> list[LayerSpec]:
    """OLMo 3: 3 sliding : 1 full by default."""
    types = _layer_types(cfg, cfg.num_layers(), _alternating(4))
    shape = AttentionShape(
        num_kv_heads=kv_heads(cfg),
        head_dim=default_head_dim(cfg),
        window=cfg.opt_int("sliding_window"),
    )
    return uniform_attention_layers(cfg, ctx, types, shape)


def _derive_gpt_oss(cfg: ConfigView, ctx: DeriveContext) -> list[LayerSpec]:
    """gpt-oss: sliding (128) and full layers alternate; every layer has learned sinks."""
    types = _layer_types(cfg, cfg.num_layers(), _alternating(2))
    shape = AttentionShape(
        num_kv_heads=kv_heads(cfg),
        head_dim=default_head_dim(cfg),
        window=cfg.opt_int("sliding_window"),
        learned_sinks=True,
    )
    return uniform_attention_layers(cfg, ctx, types, shape)


def _derive_llama4(cfg: ConfigView, ctx: DeriveContext) -> list[LayerSpec]:
    """Llama 4 text: RoPE layers are chunked-local, NoPE layers (every 4th) are full.

    ``no_rope_layers[i]`` is 1 for a RoPE (chunked) layer; without it transformers uses
    ``(i + 1) % no_rope_layer_interval != 0``.  With ``attention_chunk_size: null`` every
    layer is full attention (``Llama4TextConfig.__post_init__``).
    """
    n = cfg.num_layers()
    rope_flags = cfg.opt_int_list("no_rope_layers")
    if not rope_flags:
        interval = cfg.req_int("no_rope_layer_interval")
        rope_flags = [int((i + 1) % interval != 0) for i in range(n)]
    cfg.check_length("no_rope_layers", rope_flags, n)
    flags = rope_flags
    # "attention_chunk_size": null switches chunking off: every layer is full attention
    chunk = cfg.opt_int("attention_chunk_size")
    types = _layer_types(
        cfg,
        n,
        lambda i: "chunked_attention" if flags[i] and chunk is not None else "full_attention",
    )
    shape = AttentionShape(num_kv_heads=kv_heads(cfg), head_dim=default_head_dim(cfg), chunk=chunk)
    return uniform_attention_layers(cfg, ctx, types, shape)


# Qwen2Config has no head_dim field (hidden_size // num_attention_heads); Qwen3Config's is 128.
# The 4096 window only counts when use_sliding_window is true.
_QWEN2_DEFAULTS: Mapping[str, Any] = {
    "num_key_value_heads": 32,  # the class default, not num_attention_heads
    "use_sliding_window": False,
    "sliding_window": 4096,
    "max_window_layers": 28,
}
_QWEN3_DEFAULTS: Mapping[str, Any] = {**_QWEN2_DEFAULTS, "head_dim": 128}
_GEMMA_DEFAULTS: Mapping[str, Any] = {
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "sliding_window": 4096,
}

#: model_type -> derivation, with the transformers defaults each relies on.
ARCHITECTURES: dict[str, Architecture] = {
    "llama": Architecture(_derive_llama, {}, "attention"),
    "mistral": Architecture(_derive_mistral, {"sliding_window": 4096}, "attention"),
    "mixtral": Architecture(_derive_mistral, {}, "attention"),
    "qwen2": Architecture(_derive_qwen, _QWEN2_DEFAULTS, "attention"),
    "qwen3": Architecture(_derive_qwen, _QWEN3_DEFAULTS, "attention"),
    "gemma2": Architecture(_derive_gemma2, _GEMMA_DEFAULTS, "attention"),
    "gemma3_text": Architecture(
        _derive_gemma3,
        {**_GEMMA_DEFAULTS, "sliding_window_pattern": 6, "max_position_embeddings": 131072},
        "attention",
    ),
    "cohere2": Architecture(
        _derive_cohere2, {"sliding_window": 4096, "sliding_window_pattern": 4}, "attention"
    ),
    "olmo3": Architecture(_derive_olmo3, {"sliding_window": 4096}, "attention"),
    "gpt_oss": Architecture(
        _derive_gpt_oss,
        {
            "head_dim": 64,
            "num_attention_heads": 64,
            "num_key_value_heads": 8,
            "sliding_window": 128,
        },
        "attention",
    ),
    "llama4_text": Architecture(
        _derive_llama4,
        {"head_dim": 128, "attention_chunk_size": 8192, "no_rope_layer_interval": 4},
        "attention",
    ),
}
