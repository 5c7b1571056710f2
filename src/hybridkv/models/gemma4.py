"""Gemma 4 text: per-layer head sizes and KV-shared layers.

* Layer kinds: ``layer_types``, or 5 sliding : 1 full; the last layer is always full.
* Sliding layers use ``head_dim`` / ``num_key_value_heads``; full ("global") layers use
  ``global_head_dim`` (default 512) and, when ``attention_k_eq_v`` is set,
  ``num_global_key_value_heads``.  A ``per_layer_config`` (what transformers' ``to_dict()``
  writes: ``{"<layer>": {"head_dim": ..., "num_key_value_heads": ...}}``) overrides both.
  With ``attention_k_eq_v`` the V projection is dropped but the cache still stores K and V.
* KV sharing: the last ``num_kv_shared_layers`` layers compute no K/V; each reads the cache of
  the last earlier (non-shared) layer of the same kind and stores nothing itself:
  ``NoCacheSpec(reason=kv_shared, source_layer=that layer)``.

Example: 8 layers ``S S F S F S S F`` with ``num_kv_shared_layers=3``: layers 5 and 6 (sliding)
read layer 3, layer 7 (full) reads layer 4.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridkv.errors import ConfigError
from hybridkv.models.attention import AttentionShape, attention_spec, kv_heads
from hybridkv.models.config import Architecture, ConfigView, DeriveContext
from hybridkv.specs import LayerSpec, NoCacheReason, NoCacheSpec

__all__ = ["ARCHITECTURES"]


def _layer_types(cfg: ConfigView, n: int) -> list[str]:
    found = cfg.opt_str_list("layer_types")
    if found is None:
        types = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n)]
    else:
        cfg.check_length("layer_types", found, n)
        types = list(found)
    if types:
        types[-1] = "full_attention"  # transformers forces the last layer to be global
    return types


def _overrides(cfg: ConfigView, n: int) -> dict[int, Mapping[str, Any]]:
    """Per-layer field overrides keyed by layer index (``per_layer_config`` or global fields)."""
    explicit = cfg.opt_mapping("per_layer_config")
    if explicit is not None:
        out: dict[int, Mapping[str, Any]] = {}
        for key, value in explicit.items():
            try:
                index = int(key)
            except (TypeError, ValueError):
                raise ConfigError(
                    f"{cfg.model_type} config: per_layer_config key {key!r} is not a layer index"
                ) from None
            if not 0 <= index < n or not isinstance(value, Mapping):
                raise ConfigError(
                    f"{cfg.model_type} config: per_layer_config[{key!r}] must map a layer in "
                    f"0..{n - 1} to an object, got {value!r}"
                )
            out[index] = value
        return out
    global_fields: dict[str, Any] = {"head_dim": cfg.req_int("global_head_dim")}
    if cfg.req_bool("attention_k_eq_v", default=False):
        global_heads = cfg.opt_int("num_global_key_value_heads")
        if global_heads is not None:
            global_fields["num_key_value_heads"] = global_heads
    return {i: global_fields for i, t in enumerate(_layer_types(cfg, n)) if t == "full_attention"}


def _shared_sources(cfg: ConfigView, types: list[str]) -> dict[int, int]:
    """KV-shared layer -> the layer whose cache it reads."""
    n = len(types)
    shared = cfg.req_int("num_kv_shared_layers", minimum=0)
    if shared >= n:
        raise ConfigError(
            f"{cfg.model_type} config: field 'num_kv_shared_layers' must be smaller than "
            f"num_hidden_layers={n}, got {shared}"
        )
    first = n - shared
    sources: dict[int, int] = {}
    for i in range(first, n):
        producers = [j for j in range(first) if types[j] == types[i]]
        if not producers:
            raise ConfigError(
                f"{cfg.model_type} config: KV-shared layer {i} ({types[i]}) has no earlier "
                f"{types[i]} layer to read; lower num_kv_shared_layers={shared}"
            )
        sources[i] = producers[-1]
    return sources


def _derive_gemma4(cfg: ConfigView, ctx: DeriveContext) -> list[LayerSpec]:
    n = cfg.num_layers()
    types = _layer_types(cfg, n)
    overrides = _overrides(cfg, n)
    sources = _shared_sources(cfg, types)
    base_heads = kv_heads(cfg)
    base_head_dim = cfg.req_int("head_dim")
    window = cfg.opt_int("sliding_window")
    layers: list[LayerSpec] = []
    for i, layer_type in enumerate(types):
        if i in sources:
            cache = NoCacheSpec(reason=NoCacheReason.KV_SHARED, source_layer=sources[i])
            layers.append(LayerSpec(index=i, layer_type=layer_type, caches=(cache,)))
            continue
        layer_cfg = ConfigView(cfg.model_type, overrides.get(i, {}))
        head_dim = layer_cfg.opt_int("head_dim") or base_head_dim
        heads = layer_cfg.opt_int("num_key_value_heads") or base_heads
        shape = AttentionShape(
            num_kv_heads=heads,
            head_dim=head_dim,
            window=layer_cfg.opt_int("sliding_window") or window,
        )
        spec = attention_spec(cfg, ctx, layer_type, shape, layer=i)
        layers.append(LayerSpec(index=i, layer_type=layer_type, caches=(spec,)))
    return layers


ARCHITECTURES: dict[str, Architecture] = {
    "gemma4_text": Architecture(
        _derive_gemma4,
        {
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "head_dim": 256,
            "global_head_dim": 512,
            "sliding_window": 512,
            "num_kv_shared_layers": 0,
        },
        "attention",
    ),
}
