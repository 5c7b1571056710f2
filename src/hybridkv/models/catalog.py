"""The built-in model catalog and :func:`resolve_model` (catalog name, HF id or config path).

Catalog names and Hugging Face ids match case-insensitively: ``"gpt-oss-20b"``,
``"GPT-OSS-20B"`` and ``"openai/gpt-oss-20b"`` name the same entry.
"""

from __future__ import annotations

import copy
import difflib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridkv.errors import UnknownModelError, brief_repr
from hybridkv.models.catalog_data import CATALOG_DATA
from hybridkv.models.hub_cache import hub_cache_dir, hub_config_path
from hybridkv.models.registry import spec_from_config
from hybridkv.specs import DType, ModelSpec

__all__ = [
    "DEFAULT_MODEL",
    "CatalogEntry",
    "catalog_config",
    "catalog_entries",
    "catalog_entry",
    "catalog_names",
    "resolve_model",
]

#: The model CLI commands use when none is named: a state hybrid (gated DeltaNet + full
#: attention), the kind of model whose cache layout matters most.
DEFAULT_MODEL = "Qwen3-Next-80B-A3B"


@dataclass(frozen=True, kw_only=True)
class CatalogEntry:
    """One catalog model: display ``name``, Hugging Face ``hf_id`` and its ``config`` fields.

    ``config`` is shared and must not be mutated; :func:`catalog_config` hands out copies.
    """

    name: str
    hf_id: str
    config: Mapping[str, Any]

    @property
    def model_type(self) -> str:
        """The declared ``model_type`` (a wrapper's own, e.g. ``gemma3``)."""
        return str(self.config.get("model_type", ""))


_ENTRIES: tuple[CatalogEntry, ...] = tuple(
    CatalogEntry(name=name, hf_id=hf_id, config=config) for name, hf_id, config in CATALOG_DATA
)
_BY_KEY: dict[str, CatalogEntry] = {
    key.lower(): entry for entry in _ENTRIES for key in (entry.name, entry.hf_id)
}


def catalog_entries() -> tuple[CatalogEntry, ...]:
    """Every catalog entry, in catalog order."""
    return _ENTRIES


def catalog_names() -> list[str]:
    """Every catalog name, in catalog order."""
    return [entry.name for entry in _ENTRIES]


#: Unit words a size split by a space leaves as a separate argument (``--memory 16 GiB``).
_UNIT_WORDS = frozenset(
    ("b", "kb", "mb", "gb", "tb", "kib", "mib", "gib", "tib", "k", "m", "g", "t")
)


def _unknown(model: str) -> UnknownModelError:
    keys = [e.name for e in _ENTRIES] + [e.hf_id for e in _ENTRIES]
    lowered = {k.lower(): k for k in keys}
    close = [
        lowered[m] for m in difflib.get_close_matches(model.lower(), list(lowered), n=4, cutoff=0.5)
    ]
    hint = f"; close matches: {', '.join(close)}" if close else ""
    path = Path(model).expanduser()
    if path.is_dir():  # meant as a checkpoint directory
        return UnknownModelError(
            f"model: {model!r} is a directory without a config.json; give a directory that "
            "holds one, a path to a config.json, or a catalog name"
        )
    if path.exists():  # a device, a pipe, a socket: there, but nothing to read a config from
        return UnknownModelError(
            f"model: {model!r} is not a regular file or a directory; give a path to a "
            "config.json (or the directory holding it), or a catalog name"
        )
    if model.endswith(".json") or model.startswith(("/", "./", "../", "~")):  # meant as a path
        return UnknownModelError(
            f"model: {model!r} does not exist; give a path to a config.json (or the "
            "directory holding it), or a catalog name"
        )
    if model.lower() in _UNIT_WORDS:  # `--memory 16 GiB`: the unit went to the model argument
        return UnknownModelError(
            f"model: {model!r} is a size unit, not a model; a size is one word without a "
            "space (--memory 16GiB, or quoted: --memory '16 GiB')"
        )
    return UnknownModelError(
        f"model: {model!r} is neither a catalog name, a path to a config.json nor a model "
        f"id in the local Hugging Face cache ({hub_cache_dir()}){hint}; catalog: "
        f"{', '.join(catalog_names())}"
    )


def catalog_entry(name: str) -> CatalogEntry:
    """The entry named ``name`` (catalog name or HF id, any case).  Raises UnknownModelError."""
    if not isinstance(name, str):
        raise UnknownModelError(
            f"name: expected a catalog name or Hugging Face id (a str), got {brief_repr(name)}; "
            f"catalog: {', '.join(catalog_names())}"
        )
    entry = _BY_KEY.get(name.strip().lower())
    if entry is None:
        raise _unknown(name)
    return entry


def catalog_config(name: str) -> dict[str, Any]:
    """A deep copy of the config of catalog entry ``name``; raises UnknownModelError."""
    return copy.deepcopy(dict(catalog_entry(name).config))


def resolve_model(
    model: str | os.PathLike[str],
    *,
    tp_size: int = 1,
    kv_cache_dtype: str | DType | None = None,
    ssm_state_dtype: str | DType | None = None,
    mtp: bool = False,
) -> ModelSpec:
    """The :class:`ModelSpec` of a catalog model (name or HF id), of a config file / directory
    (a ``str`` or an :class:`os.PathLike`, which is always read as a path),
    or of a Hugging Face id ``org/name`` found in the local hub cache
    (:mod:`hybridkv.models.hub_cache`; nothing is downloaded).  ``mtp``: with the checkpoint's
    multi-token-prediction layers (see :func:`spec_from_config`).

    Catalog names win over paths, paths over the hub cache.  Raises
    :class:`~hybridkv.errors.UnknownModelError` (with close catalog matches) when ``model`` is
    none of these, and whatever :func:`spec_from_config` raises for a bad config or setting.
    """
    if isinstance(model, os.PathLike):  # a path, never a catalog name or hub id
        text = os.fspath(model)
        if isinstance(text, str) and text.strip():
            path = Path(os.path.expanduser(text))
            if not (path.is_file() or (path.is_dir() and (path / "config.json").is_file())):
                raise _unknown(text)
            return spec_from_config(
                path,
                tp_size=tp_size,
                kv_cache_dtype=kv_cache_dtype,
                name=(path.parent if path.is_file() else path).name or str(path),
                ssm_state_dtype=ssm_state_dtype,
                mtp=mtp,
            )
    if not isinstance(model, str) or not model.strip():
        raise UnknownModelError(
            f"model: got {model!r}; give a catalog name (catalog_names()), a path to a "
            "config.json or its directory, or a Hugging Face id in the local hub cache"
        )
    entry = _BY_KEY.get(model.strip().lower())
    if entry is not None:
        return spec_from_config(
            entry.config,
            tp_size=tp_size,
            kv_cache_dtype=kv_cache_dtype,
            name=entry.name,
            ssm_state_dtype=ssm_state_dtype,
            mtp=mtp,
        )
    path = Path(os.path.expanduser(model))
    if path.is_file() or (path.is_dir() and (path / "config.json").is_file()):
        name = (path.parent if path.is_file() else path).name or str(path)
    else:
        cached = hub_config_path(model)
        if cached is None:
            raise _unknown(model)
        path, name = cached, model.strip()
    return spec_from_config(
        path,
        tp_size=tp_size,
        kv_cache_dtype=kv_cache_dtype,
        name=name,
        ssm_state_dtype=ssm_state_dtype,
        mtp=mtp,
    )
