"""Deriving an attention-only decoder that has no registry entry, from the fields configs share.

Most decoder-only architectures transformers ships store nothing but softmax-attention K/V and
describe it with the same fields: ``num_hidden_layers``, ``num_attention_heads``,
``num_key_value_heads`` (absent: multi-head), ``head_dim`` (absent or null:
``hidden_size // num_attention_heads``), and which layers are full, sliding or chunked.  The
layer kinds follow transformers' own cache rule (``get_layer_types_and_kwargs`` in
``cache_utils``): ``layer_types`` when the config has it (``moe`` / ``mlp`` entries store
nothing).  Without it, a model type listed in :data:`~hybridkv.models.generic_rules.GENERIC_TYPES`
gets the layer kinds (and the absent-field defaults) its transformers config class builds in
``__post_init__``; any other model type is all full attention, and is refused when it has a
window (not switched off by ``use_sliding_window: false`` or 0), a chunk size or a
layer-pattern field, since only its config class knows which layers those apply to.
``tests/test_models_generic.py`` checks the result against the caches transformers allocates
for every architecture it lists.

A config that carries the fields of another cache kind (MLA latents, recurrent or conv state,
KV sharing, compressed attention, cross-attention, looped layers) or of an encoder-decoder is
refused: deriving it as plain attention would be wrong, so it needs a registry entry.  The
derived spec says in its notes that it took this path.  No torch.
"""

from __future__ import annotations

from hybridkv.errors import UnsupportedModelTypeError
from hybridkv.models.attention import (
    AttentionShape,
    attention_spec,
    default_head_dim,
    kv_heads,
)
from hybridkv.models.config import ConfigView, DeriveContext
from hybridkv.models.generic_rules import GENERIC_TYPES, REFUSED_TYPES, unknown_pattern_refusal
from hybridkv.specs import LayerSpec, NoCacheSpec

__all__ = ["GENERIC_LAYER_TYPES", "derive_generic", "generic_refusal"]

#: Layer types the generic path understands (transformers' normalised names).
GENERIC_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention", "moe", "mlp")
_NO_CACHE = ("moe", "mlp")

#: Config fields that mean "this model caches something plain attention does not describe".
_FOREIGN_FIELDS: dict[str, str] = {
    "kv_lora_rank": "multi-head latent attention",
    "linear_num_value_heads": "linear attention state",
    "linear_num_heads": "linear attention state",
    "mamba_d_state": "Mamba state",
    "mamba_n_heads": "Mamba state",
    "ssm_state_size": "SSM state",
    "state_size": "recurrent state",
    "conv_L_cache": "short-conv state",
    "num_kv_shared_layers": "KV sharing between layers",
    "kv_sharing_modes": "KV sharing between layers",
    "compress_ratios": "compressed attention",
    "block_types": "recurrent blocks",
    "attention_window_size": "recurrent blocks with local attention",
    # attention geometry under names of its own: the shared rule would misread it
    "num_kv_heads": "a KV head count under its own name",
    "multi_query": "multi-query attention under its own flag",
    "dim_head": "a head size under its own name",
    "kv_channels": "a head size under its own name",
    # an encoder (BERT family) with a language-model head is no decoder-only model
    "type_vocab_size": "an encoder's token-type embeddings",
    "attn_layers": "LSH / local attention layers (Reformer)",
    "v_head_dim": "a value head size of its own",
    # mllama: these layers cache the image's K/V (fixed size), not per-token K/V
    "cross_attention_layers": "cross-attention layers caching image K/V, not per-token K/V",
    # minimax_m3_vl_text: sparse-attention layers with an indexer cache
    "sparse_attention_config": "sparse attention layers with an indexer cache",
}
#: Fields whose mere presence (even 0 or empty) marks a family the shared rule misreads.
_FOREIGN_KEYS: dict[str, str] = {
    "num_kv_shared_layers": "KV sharing between layers",
    # dory: recurrent layers run n_recurrent_loops times; "per_loop" (the default) keeps a KV
    # cache per loop, "last_loop" shares one across loops
    "n_recurrent_loops": "looped recurrent layers with a KV cache per loop",
    "recurrent_kv_cache_mode": "looped recurrent layers with a KV cache per loop",
}


def generic_refusal(model_type: str, data: dict[str, object]) -> str | None:
    """Why ``data`` cannot be derived generically, or None when it can."""
    if data.get("is_encoder_decoder"):
        return "it is an encoder-decoder model"
    if model_type in REFUSED_TYPES:
        return REFUSED_TYPES[model_type]
    found = sorted(
        {k for k in _FOREIGN_FIELDS if data.get(k) not in (None, 0, [], False)}
        | {k for k in _FOREIGN_KEYS if k in data}
    )
    if found:
        kinds = sorted({{**_FOREIGN_FIELDS, **_FOREIGN_KEYS}[k] for k in found})
        return f"it has fields of {', '.join(kinds)} ({', '.join(found)})"
    for key in ("num_hidden_layers", "num_attention_heads"):
        if not isinstance(data.get(key), int):
            return f"it has no integer {key!r}"
    types = data.get("layer_types")
    if types is not None:
        if not isinstance(types, list | tuple) or not all(isinstance(t, str) for t in types):
            return "its layer_types is not a list of names"
        unknown = sorted({t for t in types if t not in GENERIC_LAYER_TYPES})
        if unknown:
            return f"its layer_types name {', '.join(unknown)}"
    return None


def derive_generic(cfg: ConfigView, ctx: DeriveContext) -> list[LayerSpec]:
    """Attention layers from the shared fields (see the module docstring).

    Raises :class:`UnsupportedModelTypeError` when :func:`generic_refusal` finds a reason,
    and :class:`~hybridkv.errors.ConfigError` for missing or invalid fields.
    """
    reason = generic_refusal(cfg.model_type, dict(cfg.data))
    if reason is not None:
        raise UnsupportedModelTypeError(
            f"config.model_type: {cfg.model_type!r} has no registry entry and cannot be derived "
            f"from the shared attention fields: {reason}"
        )
    ctx.note(
        f"{cfg.model_type}: no registry entry; derived generically from num_hidden_layers, "
        "num_attention_heads, num_key_value_heads, head_dim, layer_types / sliding_window / "
        "attention_chunk_size (transformers' cache rule)"
    )
    n = cfg.num_layers()
    # transformers drops the window when use_sliding_window is false (qwen2_moe, ...) and
    # reads 0 as "no window"
    raw_window = cfg.raw("sliding_window")
    window = (
        None
        if cfg.raw("use_sliding_window") is False or raw_window in (None, 0)
        else cfg.opt_int("sliding_window")
    )
    chunk = cfg.opt_int("attention_chunk_size")
    types = cfg.opt_str_list("layer_types")
    known = GENERIC_TYPES.get(cfg.model_type)
    if types is None:
        refusal = unknown_pattern_refusal(cfg, window, known=known is not None)
        if refusal is not None:
            raise refusal
    if types is None and known is not None:
        types = known.layer_rule(cfg, n, window)
        if known.rule:
            ctx.note(
                f"{cfg.model_type}: the config has no layer_types; layer kinds follow "
                f"transformers' {cfg.model_type} config class ({known.rule})"
            )
    elif types is None:
        types = ["full_attention"] * n
    cfg.check_length("layer_types", types, n)
    shape = AttentionShape(
        num_kv_heads=kv_heads(cfg),
        head_dim=default_head_dim(cfg),
        window=window,
        chunk=chunk,
    )
    layers = [
        LayerSpec(
            index=i,
            layer_type=t,
            caches=(NoCacheSpec(),)
            if t in _NO_CACHE
            else (attention_spec(cfg, ctx, t, shape, layer=i),),
        )
        for i, t in enumerate(types)
    ]
    used = [
        f"{key}={cfg.defaults[key]!r}"
        for key in ("num_key_value_heads", "head_dim")
        if key not in cfg.data and key in cfg.defaults
    ]
    if used:
        ctx.note(
            f"{cfg.model_type}: the config omits {', '.join(k.split('=')[0] for k in used)}; "
            f"transformers' class default used ({', '.join(used)})"
        )
    return layers
