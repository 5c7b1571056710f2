"""Linear-attention and short-conv hybrids: qwen3_next / qwen3_5 / olmo_hybrid (gated
DeltaNet), kimi_linear (KDA + MLA), lfm2 (short convolution + attention), lfm3 (short
convolution + sliding + full).

Layer kinds: ``linear_attention`` (a delta-rule layer with conv + recurrent state), ``conv``
(LFM2/LFM3's short convolution, conv state only), ``sliding_attention`` (LFM3) and
``full_attention`` (softmax attention, or MLA for kimi_linear).  State shapes and dtypes: see
:mod:`hybridkv.models.states`.
"""

from __future__ import annotations

from hybridkv.errors import ConfigError
from hybridkv.models.attention import AttentionShape, attention_spec, default_head_dim, kv_heads
from hybridkv.models.config import Architecture, ConfigView, DeriveContext
from hybridkv.models.hybrid_ssm import CacheFactory, assemble_layers
from hybridkv.models.mla import mla_spec
from hybridkv.models.states import gated_deltanet_state, kda_state, short_conv_state
from hybridkv.specs import DType, LayerSpec

__all__ = ["ARCHITECTURES"]


def _types_or(cfg: ConfigView, n: int, default: list[str]) -> list[str]:
    found = cfg.opt_str_list("layer_types")
    if found is None:
        return default
    cfg.check_length("layer_types", found, n)
    return found


def _derive_qwen3_next(cfg: ConfigView, ctx: DeriveContext) -> list[LayerSpec]:
    """Qwen3-Next / Qwen3.5: gated DeltaNet layers, every ``full_attention_interval``-th full.

    Qwen3.5 checkpoints carry ``mamba_ssm_dtype`` (float32), the recurrent-state dtype.
    """
    n = cfg.num_layers()
    interval = cfg.req_int("full_attention_interval")
    default = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n)]
    return _gated_deltanet_layers(cfg, ctx, _types_or(cfg, n, default))


def _olmo_hybrid_view(cfg: ConfigView) -> ConfigView:
    """``cfg`` with the head counts and sizes ``OlmoHybridConfig.__post_init__`` derives when a
    field is absent or null: ``linear_num_key_heads`` / ``linear_num_value_heads`` /
    ``num_key_value_heads`` = ``num_attention_heads``, ``linear_key_head_dim`` =
    ``int(0.75 * hidden_size / linear_num_key_heads)``, ``linear_value_head_dim`` = twice that.
    """
    heads = cfg.req_int("num_attention_heads")
    resolved: dict[str, int] = {}
    key_heads = cfg.opt_int("linear_num_key_heads") or heads
    resolved["linear_num_key_heads"] = key_heads
    resolved["linear_num_value_heads"] = cfg.opt_int("linear_num_value_heads") or heads
    resolved["num_key_value_heads"] = cfg.opt_int("num_key_value_heads") or heads
    key_dim = cfg.opt_int("linear_key_head_dim")
    if key_dim is None:
        # transformers' own float expression, so rounding agrees exactly
        key_dim = int(0.75 * cfg.req_int("hidden_size") / key_heads)
    resolved["linear_key_head_dim"] = key_dim
    resolved["linear_value_head_dim"] = cfg.opt_int("linear_value_head_dim") or 2 * key_dim
    return ConfigView(cfg.model_type, {**cfg.data, **resolved}, cfg.defaults)


def _olmo_hybrid_default_types(n: int) -> list[str]:
    # OlmoHybridConfig: full attention where i % 4 == 3; the last layer when that gives none
    types = ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(n)]
    if "full_attention" not in types:
        types[-1] = "full_attention"
    return types


def _derive_olmo_hybrid(cfg: ConfigView, ctx: DeriveContext) -> list[LayerSpec]:
    """OLMo hybrid: gated DeltaNet layers and full attention, by ``layer_types`` (default 3 : 1).

    Absent head counts and sizes follow ``OlmoHybridConfig`` (see :func:`_olmo_hybrid_view`).
    """
    view = _olmo_hybrid_view(cfg)
    n = view.num_layers()
    return _gated_deltanet_layers(view, ctx, _types_or(view, n, _olmo_hybrid_default_types(n)))


def _gated_deltanet_layers(
    cfg: ConfigView, ctx: DeriveContext, types: list[str]
) -> list[LayerSpec]:
    """Gated DeltaNet (``linear_attention``) and ``full_attention`` layers, one per entry."""
    shape = AttentionShape(num_kv_heads=kv_heads(cfg), head_dim=default_head_dim(cfg))
    flag = cfg.opt_str("mamba_ssm_dtype")
    ssm_flag = (
        None
        if flag is None
        else DType.parse(flag, field=f"{cfg.model_type} config.mamba_ssm_dtype")
    )
    table: dict[str, CacheFactory] = {
        "linear_attention": lambda: (
            gated_deltanet_state(
                ctx,
                model_type=cfg.model_type,
                num_k_heads=cfg.req_int("linear_num_key_heads"),
                num_v_heads=cfg.req_int("linear_num_value_heads"),
                head_k_dim=cfg.req_int("linear_key_head_dim"),
                head_v_dim=cfg.req_int("linear_value_head_dim"),
                d_conv=cfg.req_int("linear_conv_kernel_dim"),
                ssm_dtype_flag=ssm_flag,
            ),
        ),
        "full_attention": lambda: (
            attention_spec(cfg, ctx, "full_attention", shape, layer=types.index("full_attention")),
        ),
    }
    return assemble_layers(cfg, types, table)


def _kimi_layer_types(cfg: ConfigView, n: int) -> list[str]:
    """``layer_types``, else ``linear_attn_config``'s 1-based ``full_attn_layers`` / ``kda_layers``.

    Without either, transformers' default: full attention where ``i > 0 and i % 4 == 0``.
    """
    found = cfg.opt_str_list("layer_types")
    if found is not None:
        cfg.check_length("layer_types", found, n)
        return found
    linear = ConfigView(cfg.model_type, cfg.opt_mapping("linear_attn_config") or {})
    full = linear.opt_int_list("full_attn_layers", minimum=1)
    kda = linear.opt_int_list("kda_layers", minimum=1)
    if full is None or kda is None:
        return ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n)]
    types: list[str | None] = [None] * n
    for layers, kind in ((full, "full_attention"), (kda, "linear_attention")):
        for one_based in layers:
            if one_based > n:
                raise ConfigError(
                    f"kimi_linear config: linear_attn_config names layer {one_based} (1-based) "
                    f"but the model has {n} layers"
                )
            types[one_based - 1] = kind
    unset = [i + 1 for i, t in enumerate(types) if t is None]
    if unset:
        raise ConfigError(
            f"kimi_linear config: linear_attn_config lists neither full_attn_layers nor "
            f"kda_layers for layers {unset} (1-based)"
        )
    return [t for t in types if t is not None]


def _kimi_linear_field(cfg: ConfigView, nested: str, flat: str) -> int:
    """A KDA field from ``linear_attn_config`` (checkpoint layout) or its flat alias."""
    linear = ConfigView(cfg.model_type, cfg.opt_mapping("linear_attn_config") or {})
    value = linear.opt_int(nested)
    return cfg.req_int(flat) if value is None else value


def _derive_kimi_linear(cfg: ConfigView, ctx: DeriveContext) -> list[LayerSpec]:
    """Kimi Linear: KDA layers (conv + recurrent state) and MLA layers (latent cache)."""
    n = cfg.num_layers()
    types = _kimi_layer_types(cfg, n)
    table: dict[str, CacheFactory] = {
        "linear_attention": lambda: (
            kda_state(
                ctx,
                model_type=cfg.model_type,
                num_heads=_kimi_linear_field(cfg, "num_heads", "linear_num_heads"),
                head_dim=_kimi_linear_field(cfg, "head_dim", "linear_head_dim"),
                d_conv=_kimi_linear_field(cfg, "short_conv_kernel_size", "linear_conv_kernel_dim"),
            ),
        ),
        "full_attention": lambda: (mla_spec(cfg, ctx),),
    }
    return assemble_layers(cfg, types, table)


def _derive_lfm2(cfg: ConfigView, ctx: DeriveContext) -> list[LayerSpec]:
    """LFM2: ``conv`` layers (short conv state) and ``full_attention`` layers.

    Layer kinds come from ``layer_types``, else ``full_attn_idxs`` (0-based), else all full.
    """
    n = cfg.num_layers()
    idxs = cfg.opt_int_list("full_attn_idxs")
    full = set(range(n)) if idxs is None else set(idxs)
    types = _types_or(cfg, n, ["full_attention" if i in full else "conv" for i in range(n)])
    shape = AttentionShape(num_kv_heads=kv_heads(cfg), head_dim=default_head_dim(cfg))
    table: dict[str, CacheFactory] = {
        "conv": lambda: (
            short_conv_state(
                ctx,
                model_type=cfg.model_type,
                hidden_size=cfg.req_int("hidden_size"),
                l_cache=cfg.req_int("conv_L_cache"),
            ),
        ),
        "full_attention": lambda: (
            attention_spec(cfg, ctx, "full_attention", shape, layer=types.index("full_attention")),
        ),
    }
    return assemble_layers(cfg, types, table)


def _lfm3_default_type(i: int) -> str:
    # transformers' Lfm3Config rule: full at i % 4 == 2, sliding at i % 4 == 0 (i > 0), else conv.
    if i % 4 == 2:
        return "full_attention"
    return "sliding_attention" if i % 4 == 0 and i > 0 else "conv"


def _derive_lfm3(cfg: ConfigView, ctx: DeriveContext) -> list[LayerSpec]:
    """LFM3: ``conv`` layers (short conv state), ``sliding_attention`` layers (a window of
    ``sliding_window`` tokens) and ``full_attention`` layers.

    Layer kinds come from ``layer_types``, else transformers' default pattern (conv, conv, full,
    conv, sliding, conv, full, ... : full where ``i % 4 == 2``, sliding where ``i % 4 == 0``
    and ``i > 0``).  Sliding and full layers share one head geometry.
    """
    n = cfg.num_layers()
    types = _types_or(cfg, n, [_lfm3_default_type(i) for i in range(n)])
    shape = AttentionShape(
        num_kv_heads=kv_heads(cfg),
        head_dim=default_head_dim(cfg),
        window=cfg.opt_int("sliding_window"),
    )
    table: dict[str, CacheFactory] = {
        "conv": lambda: (
            short_conv_state(
                ctx,
                model_type=cfg.model_type,
                hidden_size=cfg.req_int("hidden_size"),
                l_cache=cfg.req_int("conv_L_cache"),
            ),
        ),
        "sliding_attention": lambda: (
            attention_spec(
                cfg, ctx, "sliding_attention", shape, layer=types.index("sliding_attention")
            ),
        ),
        "full_attention": lambda: (
            attention_spec(cfg, ctx, "full_attention", shape, layer=types.index("full_attention")),
        ),
    }
    return assemble_layers(cfg, types, table)


_GDN_DEFAULTS: dict[str, int] = {
    "head_dim": 256,
    "full_attention_interval": 4,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
}

ARCHITECTURES: dict[str, Architecture] = {
    "qwen3_next": Architecture(
        _derive_qwen3_next,
        {**_GDN_DEFAULTS, "num_attention_heads": 16, "num_key_value_heads": 2},
        "linear-attention",
    ),
    "qwen3_5_text": Architecture(
        _derive_qwen3_next,
        {**_GDN_DEFAULTS, "num_attention_heads": 16, "num_key_value_heads": 4},
        "linear-attention",
    ),
    "qwen3_5_moe_text": Architecture(
        _derive_qwen3_next,
        {**_GDN_DEFAULTS, "num_attention_heads": 16, "num_key_value_heads": 2},
        "linear-attention",
    ),
    # OLMo hybrid: its other head counts and sizes derive from these (_olmo_hybrid_view).
    "olmo_hybrid": Architecture(
        _derive_olmo_hybrid,
        {"hidden_size": 3840, "num_attention_heads": 30, "linear_conv_kernel_dim": 4},
        "linear-attention",
    ),
    "kimi_linear": Architecture(
        _derive_kimi_linear,
        {
            "kv_lora_rank": 512,
            "qk_rope_head_dim": 64,
            "linear_head_dim": 128,
            "linear_num_heads": 32,
            "linear_conv_kernel_dim": 4,
        },
        "linear-attention",
    ),
    "lfm2": Architecture(_derive_lfm2, {"num_key_value_heads": 8, "conv_L_cache": 3}, "short-conv"),
    "lfm3": Architecture(
        _derive_lfm3,
        {"num_key_value_heads": 4, "head_dim": 128, "conv_L_cache": 7, "sliding_window": 256},
        "short-conv",
    ),
}
