"""Mamba hybrids: jamba (Mamba1), bamba, granitemoehybrid, nemotron_h, falcon_h1, zamba2 (Mamba2).

Layer kinds use transformers' normalised names: ``linear_attention`` (a Mamba layer, one
:class:`~hybridkv.specs.StateSpec`), ``full_attention`` (one attention cache), ``hybrid`` (both,
attention in slot 0 and the Mamba state in slot 1), ``mlp`` / ``moe`` (no cache).  Legacy names
in checkpoints (``mamba``, ``attention``, nemotron_h's ``M * - E`` pattern) are mapped first.

State shapes and dtypes: see :mod:`hybridkv.models.states`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from hybridkv.errors import ConfigError
from hybridkv.models.attention import AttentionShape, attention_spec, default_head_dim, kv_heads
from hybridkv.models.config import MAX_LAYERS, Architecture, ConfigView, DeriveContext
from hybridkv.models.states import mamba1_state, mamba2_state
from hybridkv.specs import CacheSpec, DType, LayerSpec, NoCacheSpec, StateSpec

__all__ = ["ARCHITECTURES", "assemble_layers", "normalise_layer_type"]

#: Legacy layer-type names -> transformers' normalised names.
_LEGACY_NAMES: dict[str, str] = {
    "mamba": "linear_attention",
    "attention": "full_attention",
    "M": "linear_attention",
    "*": "full_attention",
    "-": "mlp",
    "E": "moe",
}


def normalise_layer_type(name: str) -> str:
    """Map a legacy layer-type name (``mamba``, ``attention``, ``M``, ``*``...) to the new one."""
    return _LEGACY_NAMES.get(name, name)


CacheFactory = Callable[[], tuple[CacheSpec, ...]]


def assemble_layers(
    cfg: ConfigView, layer_types: list[str], table: Mapping[str, CacheFactory]
) -> list[LayerSpec]:
    """One LayerSpec per layer; ``table`` maps a layer type to its caches.

    Each factory runs at most once (its specs are shared by every layer of that type), and only
    when a layer of that type exists, so a tp size that cannot shard attention heads is only an
    error for a model that has attention layers.  Raises :class:`ConfigError` for a layer type
    not in ``table``.
    """
    built: dict[str, tuple[CacheSpec, ...]] = {}
    layers: list[LayerSpec] = []
    for i, layer_type in enumerate(layer_types):
        factory = table.get(layer_type)
        if factory is None:
            raise ConfigError(
                f"{cfg.model_type} config: layer {i} has layer type {layer_type!r}; valid: "
                f"{', '.join(table)}"
            )
        if layer_type not in built:
            built[layer_type] = factory()
        layers.append(LayerSpec(index=i, layer_type=layer_type, caches=built[layer_type]))
    return layers


def _no_cache() -> tuple[CacheSpec, ...]:
    return (NoCacheSpec(),)


def _table(
    attention: Callable[[], CacheSpec] | None, state: Callable[[], StateSpec]
) -> dict[str, CacheFactory]:
    table: dict[str, CacheFactory] = {
        "linear_attention": lambda: (state(),),
        "mlp": _no_cache,
        "moe": _no_cache,
    }
    if attention is not None:
        attn = attention
        table["full_attention"] = lambda: (attn(),)
        table["hybrid"] = lambda: (attn(), state())
    return table


def _full_attention(
    cfg: ConfigView, ctx: DeriveContext, *, num_kv_heads: int, head_dim: int
) -> Callable[[], CacheSpec]:
    shape = AttentionShape(num_kv_heads=num_kv_heads, head_dim=head_dim)
    return lambda: attention_spec(cfg, ctx, "full_attention", shape, layer=0)


def _mamba_head_dim(cfg: ConfigView, key: str, intermediate: int, n_heads: int) -> int:
    """``mamba_d_head``-style field, where ``"auto"`` (or absent) means intermediate / heads."""
    value = cfg.raw(key)
    if value is None or value == "auto":
        if intermediate % n_heads:
            raise ConfigError(
                f"{cfg.model_type} config: mamba intermediate size {intermediate} is not a "
                f"multiple of the mamba head count {n_heads}"
            )
        return intermediate // n_heads
    head_dim = cfg.req_int(key)
    if head_dim * n_heads != intermediate:
        raise ConfigError(
            f"{cfg.model_type} config: field {key!r}={head_dim} times {n_heads} mamba heads "
            f"must equal the mamba intermediate size {intermediate}"
        )
    return head_dim


def _derive_jamba(cfg: ConfigView, ctx: DeriveContext) -> list[LayerSpec]:
    """Jamba: attention where ``i % attn_layer_period == attn_layer_offset``, Mamba1 elsewhere."""
    n = cfg.num_layers()
    period = cfg.req_int("attn_layer_period")
    offset = cfg.req_int("attn_layer_offset", minimum=0)
    if offset >= period:
        raise ConfigError(
            f"jamba config: field 'attn_layer_offset' must be smaller than attn_layer_period="
            f"{period}, got {offset}"
        )
    types = ["full_attention" if i % period == offset else "linear_attention" for i in range(n)]
    intermediate = cfg.req_int("mamba_expand") * cfg.req_int("hidden_size")

    def state() -> StateSpec:
        return mamba1_state(
            ctx,
            model_type=cfg.model_type,
            intermediate=intermediate,
            d_conv=cfg.req_int("mamba_d_conv"),
            d_state=cfg.req_int("mamba_d_state"),
        )

    attention = _full_attention(
        cfg, ctx, num_kv_heads=kv_heads(cfg), head_dim=default_head_dim(cfg)
    )
    return assemble_layers(cfg, types, _table(attention, state))


def _mamba2_from_prefixed(
    cfg: ConfigView, ctx: DeriveContext, *, intermediate: int
) -> Callable[[], StateSpec]:
    """Mamba2 state from bamba/granite/falcon-style ``mamba_*`` fields."""
    n_heads = cfg.req_int("mamba_n_heads")
    head_dim = _mamba_head_dim(cfg, "mamba_d_head", intermediate, n_heads)
    return lambda: mamba2_state(
        ctx,
        model_type=cfg.model_type,
        n_heads=n_heads,
        head_dim=head_dim,
        n_groups=cfg.req_int("mamba_n_groups"),
        d_state=cfg.req_int("mamba_d_state"),
        d_conv=cfg.req_int("mamba_d_conv"),
    )


def _derive_bamba(cfg: ConfigView, ctx: DeriveContext) -> list[LayerSpec]:
    """Bamba: attention at ``attn_layer_indices``, Mamba2 elsewhere."""
    n = cfg.num_layers()
    attn = set(cfg.opt_int_list("attn_layer_indices") or [])
    types = ["full_attention" if i in attn else "linear_attention" for i in range(n)]
    intermediate = cfg.req_int("mamba_expand") * cfg.req_int("hidden_size")
    state = _mamba2_from_prefixed(cfg, ctx, intermediate=intermediate)
    attention = _full_attention(
        cfg, ctx, num_kv_heads=kv_heads(cfg), head_dim=default_head_dim(cfg)
    )
    return assemble_layers(cfg, types, _table(attention, state))


def _derive_granite_hybrid(cfg: ConfigView, ctx: DeriveContext) -> list[LayerSpec]:
    """Granite 4.0-H: ``layer_types`` (``mamba`` / ``attention``), all Mamba2 by default."""
    n = cfg.num_layers()
    found = cfg.opt_str_list("layer_types") or cfg.opt_str_list("layers_block_type")
    types = ["linear_attention"] * n if found is None else [normalise_layer_type(t) for t in found]
    cfg.check_length("layer_types", types, n)
    intermediate = cfg.req_int("mamba_expand") * cfg.req_int("hidden_size")
    state = _mamba2_from_prefixed(cfg, ctx, intermediate=intermediate)
    attention = _full_attention(
        cfg, ctx, num_kv_heads=kv_heads(cfg), head_dim=default_head_dim(cfg)
    )
    return assemble_layers(cfg, types, _table(attention, state))


def _nemotron_layer_types(cfg: ConfigView, ctx: DeriveContext) -> list[str]:
    """One type per entry of ``layers_block_type`` / ``layer_types`` / ``hybrid_override_pattern``.

    As in ``NemotronHConfig`` (whose ``num_hidden_layers`` is the pattern's length), a
    ``num_hidden_layers`` that disagrees is ignored, with a note.
    """
    found = cfg.opt_str_list("layers_block_type") or cfg.opt_str_list("layer_types")
    key = "layers_block_type" if cfg.has("layers_block_type") else "layer_types"
    if found is None:
        key = "hybrid_override_pattern"
        pattern = cfg.opt_str("hybrid_override_pattern")
        if pattern is None:
            raise cfg.missing(
                "hybrid_override_pattern", "or layers_block_type: one entry per layer"
            )
        unknown = sorted(set(pattern) - set("M*-E"))
        if unknown:
            raise ConfigError(
                f"nemotron_h config: field 'hybrid_override_pattern' has characters {unknown}; "
                "valid: M (mamba2), * (attention), - (mlp), E (moe)"
            )
        found = list(pattern)
    types = [normalise_layer_type(t) for t in found]
    if not types:
        raise ConfigError(
            f"nemotron_h config: field {key!r} is empty; it needs one entry per layer"
        )
    if len(types) > MAX_LAYERS:
        raise ConfigError(
            f"nemotron_h config: field {key!r} has {len(types)} entries; at most {MAX_LAYERS} "
            "layers are supported"
        )
    declared = cfg.opt_int("num_hidden_layers", maximum=MAX_LAYERS)
    if declared is not None and declared != len(types):
        ctx.note(
            f"nemotron_h: num_hidden_layers={declared} disagrees with the {len(types)} entries "
            f"of {key}; {len(types)} layers derived (transformers' NemotronHConfig takes the "
            f"length of {key} and ignores num_hidden_layers)"
        )
    return types


def _nemotron_head_dim(cfg: ConfigView) -> int:
    """The checkpoint's ``head_dim``, else its ``attention_head_dim`` (the name remote-code
    Nemotron-H configs use), else NemotronHConfig's class default (128, declared in the
    defaults; not ``hidden_size // num_attention_heads``)."""
    if cfg.data.get("head_dim") is None:
        alias = cfg.opt_int("attention_head_dim")
        if alias is not None:
            return alias
    return cfg.req_int("head_dim")


def _derive_nemotron_h(cfg: ConfigView, ctx: DeriveContext) -> list[LayerSpec]:
    """Nemotron-H: one layer per pattern entry (M mamba2, * attention, - mlp, E moe)."""
    types = _nemotron_layer_types(cfg, ctx)
    flag = cfg.opt_str("mamba_ssm_cache_dtype")
    ssm_flag = (
        None if flag is None else DType.parse(flag, field="nemotron_h config.mamba_ssm_cache_dtype")
    )

    def state() -> StateSpec:
        return mamba2_state(
            ctx,
            model_type=cfg.model_type,
            n_heads=cfg.req_int("mamba_num_heads"),
            head_dim=cfg.req_int("mamba_head_dim"),
            n_groups=cfg.first_int("mamba_n_groups", "n_groups") or 1,
            d_state=cfg.req_int("ssm_state_size"),
            d_conv=cfg.first_int("mamba_d_conv", "conv_kernel") or 4,
            ssm_dtype_flag=ssm_flag,
        )

    attention = _full_attention(
        cfg, ctx, num_kv_heads=kv_heads(cfg), head_dim=_nemotron_head_dim(cfg)
    )
    return assemble_layers(cfg, types, _table(attention, state))


def _derive_falcon_h1(cfg: ConfigView, ctx: DeriveContext) -> list[LayerSpec]:
    """Falcon-H1: every layer runs attention and Mamba2 in parallel (two caches per layer).

    The Mamba intermediate size is ``mamba_d_ssm`` (``null`` means ``mamba_expand * hidden``).
    """
    n = cfg.num_layers()
    d_ssm = cfg.opt_int("mamba_d_ssm")
    intermediate = (
        cfg.req_int("mamba_expand") * cfg.req_int("hidden_size") if d_ssm is None else d_ssm
    )
    state = _mamba2_from_prefixed(cfg, ctx, intermediate=intermediate)
    attention = _full_attention(
        cfg, ctx, num_kv_heads=kv_heads(cfg), head_dim=default_head_dim(cfg)
    )
    return assemble_layers(cfg, ["hybrid"] * n, _table(attention, state))


def _derive_zamba2(cfg: ConfigView, ctx: DeriveContext) -> list[LayerSpec]:
    """Zamba2: Mamba2 layers; ``hybrid`` layers add a shared-weight attention block.

    The attention block's weights are shared, but each hybrid layer keeps its own KV cache.
    Its head size is ``2 * hidden_size / num_attention_heads`` (attention runs on the
    concatenation of the hidden state and the original embedding).
    """
    n = cfg.num_layers()
    found = cfg.opt_str_list("layers_block_type") or cfg.opt_str_list("layer_types")
    if found is None:
        raise cfg.missing("layers_block_type", "one of 'mamba' / 'hybrid' per layer")
    types = [normalise_layer_type(t) for t in found]
    cfg.check_length("layers_block_type", types, n)
    hidden = cfg.req_int("hidden_size")
    heads = cfg.req_int("num_attention_heads")
    intermediate = cfg.req_int("mamba_expand") * hidden
    n_heads = cfg.req_int("n_mamba_heads")
    head_dim = _mamba_head_dim(cfg, "mamba_headdim", intermediate, n_heads)

    def state() -> StateSpec:
        return mamba2_state(
            ctx,
            model_type=cfg.model_type,
            n_heads=n_heads,
            head_dim=head_dim,
            n_groups=cfg.req_int("mamba_ngroups"),
            d_state=cfg.req_int("mamba_d_state"),
            d_conv=cfg.req_int("mamba_d_conv"),
        )

    attention = _full_attention(cfg, ctx, num_kv_heads=kv_heads(cfg), head_dim=2 * hidden // heads)
    table = _table(attention, state)
    del table["full_attention"]  # zamba2 has no attention-only layers
    return assemble_layers(cfg, types, table)


_MAMBA2_DEFAULTS: Mapping[str, Any] = {
    "mamba_n_heads": 128,
    "mamba_n_groups": 1,
    "mamba_d_state": 256,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
}

ARCHITECTURES: dict[str, Architecture] = {
    "jamba": Architecture(
        _derive_jamba,
        {
            "num_key_value_heads": 8,
            "attn_layer_period": 8,
            "attn_layer_offset": 4,
            "mamba_d_state": 16,
            "mamba_d_conv": 4,
            "mamba_expand": 2,
        },
        "hybrid-ssm",
    ),
    "bamba": Architecture(
        _derive_bamba, {**_MAMBA2_DEFAULTS, "num_key_value_heads": 8}, "hybrid-ssm"
    ),
    "granitemoehybrid": Architecture(_derive_granite_hybrid, _MAMBA2_DEFAULTS, "hybrid-ssm"),
    "nemotron_h": Architecture(
        _derive_nemotron_h,
        {
            "num_key_value_heads": 8,
            "head_dim": 128,
            "mamba_num_heads": 128,
            "mamba_head_dim": 64,
            "n_groups": 8,
            "ssm_state_size": 128,
            "conv_kernel": 4,
        },
        "hybrid-ssm",
    ),
    "falcon_h1": Architecture(
        _derive_falcon_h1,
        {**_MAMBA2_DEFAULTS, "num_key_value_heads": 8, "mamba_d_ssm": 1024},
        "hybrid-ssm",
    ),
    "zamba2": Architecture(
        _derive_zamba2,
        {
            "n_mamba_heads": 8,
            "mamba_ngroups": 1,
            "mamba_d_state": 64,
            "mamba_d_conv": 4,
            "mamba_expand": 2,
        },
        "hybrid-ssm",
    ),
}
