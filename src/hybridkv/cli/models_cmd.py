"""``hybridkv models``: list the built-in catalog, or show one model's per-layer cache specs.

Examples::

    hybridkv models                      # catalog table
    hybridkv models --json               # the same, machine-readable
    hybridkv models gpt-oss-20b          # per-layer table of one model
    hybridkv models ./my-model --tp 2    # a config.json / model directory, per tp rank
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

from hybridkv.cli.common import (
    add_kv_cache_dtype,
    add_model,
    add_mtp,
    add_tp,
    check_positive,
    model_name,
)
from hybridkv.errors import ConfigError, HybridKVError, UnknownModelError
from hybridkv.models import CatalogEntry, catalog_entries, catalog_entry, resolve_model
from hybridkv.models.registry import parse_cache_dtype
from hybridkv.models.summary import cache_detail, cache_label, format_kind_counts, kind_counts
from hybridkv.specs import DType, ModelSpec
from hybridkv.units import format_bytes

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model(parser, default_help="none: list the catalog")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    add_tp(parser)
    add_kv_cache_dtype(parser)
    add_mtp(parser)


def _table(rows: Sequence[Sequence[str]], right: frozenset[int] = frozenset()) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        cells = [
            cell.rjust(widths[i]) if i in right else cell.ljust(widths[i])
            for i, cell in enumerate(row)
        ]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def _model_summary(spec: ModelSpec) -> dict[str, Any]:
    return {
        "name": spec.name,
        "model_type": spec.model_type,
        "num_layers": spec.num_layers,
        "kinds": kind_counts(spec),
        "bytes_per_token": sum(c.bytes_per_token for _, _, c in spec.entries()),
        "state_bytes": sum(c.state_bytes for _, _, c in spec.entries()),
        "max_position_embeddings": spec.max_position_embeddings,
    }


def _catalog_row(entry: CatalogEntry, args: argparse.Namespace) -> dict[str, Any]:
    """One catalog model's summary at the listing's flags; a model those flags do not fit
    (a --tp that cannot split it, MTP layers that cannot be modelled) gets a ``note`` instead
    of failing the whole listing.  With ``--mtp`` every other row says how many MTP layers it
    gained (``mtp_layers``; noted in the table where there are any): a model whose config
    declares none is listed as it is."""
    mtp_layers: int | None = None
    try:
        spec = resolve_model(entry.name, tp_size=args.tp, kv_cache_dtype=args.kv_cache_dtype)
        if args.mtp:
            try:
                with_mtp = resolve_model(
                    entry.name, tp_size=args.tp, kv_cache_dtype=args.kv_cache_dtype, mtp=True
                )
            except ConfigError as exc:
                if "declares no MTP module" not in str(exc):
                    raise
                mtp_layers = 0
            else:
                mtp_layers = with_mtp.num_layers - spec.num_layers
                spec = with_mtp
    except HybridKVError as exc:
        return {"name": entry.name, "hf_id": entry.hf_id, "note": str(exc)}
    row = {**_model_summary(spec), "hf_id": entry.hf_id}
    if mtp_layers is not None:
        row["mtp_layers"] = mtp_layers
        if mtp_layers:
            row["note"] = f"+{mtp_layers} MTP layer{'s' if mtp_layers > 1 else ''}"
    return row


def _list_catalog(args: argparse.Namespace) -> int:
    summaries = [_catalog_row(entry, args) for entry in catalog_entries()]
    if args.json:
        print(json.dumps(summaries, indent=2))
        return 0
    notes = any("note" in s for s in summaries)
    head = ["NAME", "HF ID", "MODEL TYPE", "LAYERS", "KV/TOKEN", "STATE", "CACHES"]
    rows = [[*head, "NOTE"] if notes else head]
    for s in summaries:
        if "model_type" not in s:  # the flags do not fit this model
            cells = [s["name"], s["hf_id"], "-", "-", "-", "-", "-"]
        else:
            cells = [
                s["name"],
                s["hf_id"],
                s["model_type"],
                str(s["num_layers"]),
                format_bytes(s["bytes_per_token"]),
                format_bytes(s["state_bytes"]),
                format_kind_counts(s["kinds"]),
            ]
        rows.append([*cells, s.get("note", "")] if notes else cells)
    print(_table(rows, right=frozenset({3, 4, 5})))
    mtp = " with MTP layers where the checkpoint has them" if args.mtp else ""
    print(
        f"\nKV/TOKEN: bytes per token if every per-token cache kept every token; STATE: "
        f"recurrent state per request.  Per rank at tp={args.tp}{mtp}."
    )
    return 0


def _hf_id(model: str) -> str | None:
    try:
        return catalog_entry(model).hf_id
    except UnknownModelError:  # a config path, not a catalog entry
        return None


def _show_model(args: argparse.Namespace, name: str) -> int:
    spec = resolve_model(name, tp_size=args.tp, kv_cache_dtype=args.kv_cache_dtype, mtp=args.mtp)
    if args.json:
        print(json.dumps({**spec.to_dict(), "hf_id": _hf_id(name)}, indent=2))
        return 0
    rows = [["LAYER", "TYPE", "KIND", "DETAIL", "BYTES/TOKEN", "STATE BYTES"]]
    for layer in spec.layers:
        for slot, cache in enumerate(layer.caches):
            rows.append(
                [
                    str(layer.index) if slot == 0 else "",
                    layer.layer_type if slot == 0 else "",
                    cache_label(cache),
                    cache_detail(cache),
                    str(cache.bytes_per_token),
                    str(cache.state_bytes),
                ]
            )
    summary = _model_summary(spec)
    hf_id = _hf_id(name)
    print(
        f"{spec.name}" + (f" ({hf_id})" if hf_id else "") + f": {spec.model_type}, "
        f"{spec.num_layers} layers, tp={spec.tp_size}"
    )
    print(_table(rows, right=frozenset({0, 4, 5})))
    print(f"\ncaches: {format_kind_counts(summary['kinds'])}")
    print(
        f"per request: {format_bytes(summary['bytes_per_token'])}/token if every token were "
        f"kept, {format_bytes(summary['state_bytes'])} recurrent state"
    )
    for tokens in sorted({4096, spec.max_position_embeddings or 4096}):
        print(f"resident at {tokens} tokens: {format_bytes(spec.resident_bytes(tokens))}")
    for note in spec.notes:
        print(f"note: {note}")
    return 0


def run(args: argparse.Namespace) -> int:
    """List the catalog (no model given) or show one model; returns the exit code."""
    check_positive(args, ("tp",))
    name = model_name(args, "")
    if not name:
        if args.kv_cache_dtype not in (None, "auto"):  # a bad name fails once, not per row
            parse_cache_dtype(args.kv_cache_dtype, "--kv-cache-dtype", DType.FP32)
        return _list_catalog(args)
    return _show_model(args, name)
