"""Per-layer cache specs from Hugging Face model configs, and a catalog of real models.  No torch.

Quick start::

    >>> from hybridkv.models import resolve_model
    >>> spec = resolve_model("gpt-oss-20b")
    >>> spec.num_layers, spec.layers[1].caches[0].bytes_per_token
    (24, 2048)

:func:`spec_from_config` accepts a config dict, a ``config.json`` path or a model directory;
:func:`resolve_model` also accepts a catalog name or Hugging Face id.  Both return a
:class:`hybridkv.specs.ModelSpec` as one tensor-parallel rank sees it.
"""

from __future__ import annotations

from hybridkv.models.catalog import (
    DEFAULT_MODEL,
    CatalogEntry,
    catalog_config,
    catalog_entries,
    catalog_entry,
    catalog_names,
    resolve_model,
)
from hybridkv.models.registry import ARCHITECTURES, spec_from_config, supported_model_types

__all__ = [
    "ARCHITECTURES",
    "DEFAULT_MODEL",
    "CatalogEntry",
    "catalog_config",
    "catalog_entries",
    "catalog_entry",
    "catalog_names",
    "resolve_model",
    "spec_from_config",
    "supported_model_types",
]
