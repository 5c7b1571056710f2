"""The architecture registry and :func:`spec_from_config`, the entry point of model derivation.

``ARCHITECTURES`` maps a Hugging Face ``model_type`` to the function deriving its layer specs.
Add an architecture by writing a derivation in a family module and listing it there.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from hybridkv.errors import ConfigError, SpecError, UnsupportedModelTypeError
from hybridkv.models import attention, gemma4, hybrid_ssm, linear_attention, mla
from hybridkv.models.config import (
    MODEL_TYPE_ALIASES,
    Architecture,
    ConfigView,
    DeriveContext,
    load_config,
    model_dtype,
    select_text_config,
)
from hybridkv.models.generic import derive_generic, generic_refusal
from hybridkv.models.generic_rules import GENERIC_TYPES
from hybridkv.models.mtp import mtp_layers
from hybridkv.specs import DType, ModelSpec

__all__ = ["ARCHITECTURES", "parse_cache_dtype", "spec_from_config", "supported_model_types"]

logger = logging.getLogger(__name__)

#: model_type -> how to derive its layer specs (one registry for every family).
ARCHITECTURES: dict[str, Architecture] = {
    **attention.ARCHITECTURES,
    **gemma4.ARCHITECTURES,
    **mla.ARCHITECTURES,
    **hybrid_ssm.ARCHITECTURES,
    **linear_attention.ARCHITECTURES,
}


#: Any other attention-only decoder (see :mod:`hybridkv.models.generic`).
GENERIC = Architecture(derive_generic, {}, "generic")


def supported_model_types() -> list[str]:
    """Every ``model_type`` with a registry entry, sorted.  :func:`spec_from_config` also
    accepts any other attention-only decoder config (:mod:`hybridkv.models.generic`)."""
    return sorted(ARCHITECTURES)


def parse_cache_dtype(value: str | DType | None, field: str, model_dtype: DType) -> DType:
    """A cache dtype option: ``None`` or ``"auto"`` is ``model_dtype``, else a
    :meth:`DType.parse` name; a :class:`SpecError` naming ``field`` lists ``auto`` too."""
    if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
        return model_dtype
    try:
        return DType.parse(value, field=field)
    except SpecError as exc:  # "auto" is valid here too
        raise SpecError(str(exc).replace("; valid: ", "; valid: auto (the model's), ")) from None


def _tp(tp_size: object) -> int:
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size <= 0:
        raise ConfigError(f"tp_size: must be a positive integer, got {tp_size!r}")
    return tp_size


def _given_type(config: object) -> object:
    """The ``model_type`` a config dict names as written (None for anything else)."""
    return config.get("model_type") if isinstance(config, Mapping) else None


def spec_from_config(
    config: Mapping[str, Any] | str | os.PathLike[str],
    *,
    tp_size: int = 1,
    kv_cache_dtype: str | DType | None = None,
    name: str | None = None,
    ssm_state_dtype: str | DType | None = None,
    mtp: bool = False,
) -> ModelSpec:
    """Derive per-layer cache specs from a Hugging Face config, (per tensor-parallel rank).

    ``config`` is a config dict, a path to ``config.json`` or a directory containing one.  A
    multimodal wrapper (gemma3, gemma4, llama4 conditional generation) is read through its
    ``text_config``.  ``kv_cache_dtype`` (``None`` / ``"auto"`` = the model dtype from
    ``dtype`` / ``torch_dtype``, bfloat16 when unset) applies to attention and MLA caches only;
    ``ssm_state_dtype`` overrides recurrent-state tensors (default: what transformers caches,
    float32).  ``name`` defaults to the config's ``_name_or_path`` or its ``model_type``.

    A ``model_type`` without a registry entry is derived from the fields attention-only
    configs share (:mod:`hybridkv.models.generic`; the spec's notes say so).
    ``mtp=True`` appends the checkpoint's multi-token-prediction layers, tagged ``"mtp"``
    (:mod:`hybridkv.models.mtp`; a :class:`~hybridkv.errors.ConfigError` when it has none).

    Nothing is mutated.  Raises :class:`~hybridkv.errors.UnsupportedModelTypeError` for an
    unregistered ``model_type`` the generic path cannot derive (saying why),
    :class:`~hybridkv.errors.ConfigError` for a missing or invalid field or an impossible
    ``tp_size``, and
    :class:`~hybridkv.errors.SpecError` for an unknown dtype name.
    """
    tp = _tp(tp_size)
    raw = load_config(config)
    model_type, data = select_text_config(raw, ARCHITECTURES)
    arch = ARCHITECTURES.get(model_type)
    if arch is None:
        reason = generic_refusal(model_type, dict(data))
        if reason is not None:
            raise UnsupportedModelTypeError(
                f"config.model_type: {model_type!r} is not supported: it has no registry entry "
                f"and cannot be derived from the shared attention fields ({reason}); "
                f"registered: {', '.join(supported_model_types())}"
            )
        known = GENERIC_TYPES.get(model_type)
        arch = GENERIC if known is None else GENERIC._replace(defaults=known.defaults)
    dtype = model_dtype(data, model_type)
    ctx = DeriveContext(
        tp_size=tp,
        dtype=dtype,
        kv_dtype=parse_cache_dtype(kv_cache_dtype, "kv_cache_dtype", dtype),
        ssm_state_dtype=None
        if ssm_state_dtype is None
        else parse_cache_dtype(ssm_state_dtype, "ssm_state_dtype", dtype),
    )
    given = {_given_type(raw), _given_type(raw.get("text_config"))}
    for alias, target in MODEL_TYPE_ALIASES.items():
        if alias in given and model_type == target:
            ctx.note(f"model_type {alias!r} derived as {target!r} (its checkpoints' architecture)")
    view = ConfigView(model_type, data, arch.defaults)
    layers = arch.derive(view, ctx)
    if ctx.kv_dtype is not dtype:
        ctx.note(f"kv_cache_dtype={ctx.kv_dtype.value} applies to attention/MLA caches only")
    if data.get("dtype") is None and data.get("torch_dtype") is None:
        ctx.note(f"the config names no dtype (dtype, torch_dtype): {dtype.value} assumed")
    spec_name = name or str(raw.get("_name_or_path") or "") or model_type
    spec = ModelSpec(
        name=spec_name,
        model_type=model_type,
        layers=tuple(layers),
        tp_size=tp,
        max_position_embeddings=view.first_int("max_position_embeddings", "model_max_length"),
        notes=tuple(ctx.notes),
    )
    if mtp:
        spec = spec.with_draft(tuple(mtp_layers(view, layers)), tag="mtp")
    logger.debug("derived %s (%s): %d layers, tp=%d", spec_name, model_type, len(layers), tp)
    return spec
