"""Finding a Hugging Face model id's ``config.json`` in the local hub cache (no network).

``huggingface_hub`` stores a repository ``org/name`` under ``<cache>/models--org--name/``:
``refs/main`` holds the commit of the ``main`` branch and ``snapshots/<commit>/`` the files of
that commit.  The cache is ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else
``~/.cache/huggingface/hub``.  The ``main`` snapshot wins; without one, the most recently
modified snapshot holding a ``config.json``.  Nothing is downloaded.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["hub_cache_dir", "hub_config_path"]


def hub_cache_dir() -> Path:
    """The hub cache directory, from the environment as ``huggingface_hub`` reads it."""
    explicit = os.environ.get("HF_HUB_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    home = os.environ.get("HF_HOME")
    if home:
        return Path(home).expanduser() / "hub"
    return Path("~/.cache/huggingface/hub").expanduser()


def hub_config_path(model_id: str) -> Path | None:
    """``config.json`` of ``org/name`` in the local hub cache, or None when it is not there."""
    parts = model_id.strip().split("/")
    if len(parts) != 2 or not all(parts) or any(p in (".", "..") for p in parts):
        return None
    repo = hub_cache_dir() / f"models--{parts[0]}--{parts[1]}"
    snapshots = repo / "snapshots"
    if not snapshots.is_dir():
        return None
    ref = repo / "refs" / "main"
    if ref.is_file():
        main = snapshots / ref.read_text().strip() / "config.json"
        if main.is_file():
            return main
    found = [p for p in snapshots.glob("*/config.json") if p.is_file()]
    return max(found, key=lambda p: p.stat().st_mtime) if found else None
