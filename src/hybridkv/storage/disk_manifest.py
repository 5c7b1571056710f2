"""The manifest of a disk-cache directory: who made it, checked before anything is read.

``manifest.json`` holds the format version, the capacity and the fingerprint of the engine
that made the directory (:mod:`hybridkv.storage.disk_slots`).  A directory whose manifest
differs is refused by :func:`check_manifest` with the first field that differs, so a cache
made for another model, dtype, layout, hasher or capacity is never read as this one's data.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hybridkv.errors import StorageError

__all__ = ["DiskCacheError", "check_manifest"]


class DiskCacheError(StorageError):
    """A disk-cache directory that cannot be used: not a directory, not writable, too small a
    disk, in use by another process, or made for another model, layout or capacity."""


def check_manifest(manifest: Path, want: dict[str, Any]) -> None:
    """Raise :class:`DiskCacheError` unless ``manifest`` holds exactly ``want``: naming the
    differing fields (the most telling first) and the first value that differs."""
    try:
        have = json.loads(manifest.read_text())
    except (OSError, ValueError) as exc:
        raise DiskCacheError(
            f"disk cache: {manifest} is unreadable ({exc}); use an empty directory"
        ) from exc
    if have == want:
        return
    keys = set(have) | set(want) if isinstance(have, dict) else set(want)
    old = have if isinstance(have, dict) else {}
    diff = sorted(
        (k for k in keys if old.get(k) != want.get(k)),
        key=lambda k: (_PRIORITY.get(k, len(_PRIORITY)), k),
    ) or ["?"]
    where, theirs, mine = _first_difference(old.get(diff[0]), want.get(diff[0]))
    field = diff[0] + where
    hint = _HINTS.get(diff[0], "")
    raise DiskCacheError(
        f"disk cache: {manifest.parent} holds a cache made for another "
        f"{', '.join(diff)} (it has {field}={_short(theirs)}, this engine "
        f"{field}={_short(mine)}{hint}); use another directory or empty it"
    )


#: Which differing manifest field a refusal names first (the rest alphabetically after).
_PRIORITY = {"model": 0, "dtype": 1, "hasher": 2, "format": 3, "capacity_bytes": 4}

#: What a manifest field is in the user's terms, where its name does not say.
_HINTS = {
    "weights": "; the model's weights differ: another checkpoint, or a module built otherwise",
    "capacity_bytes": (
        "; that is the disk tier's size, --disk-memory or disk_memory_bytes: give the size "
        "the cache was made with"
    ),
}


def _first_difference(have: Any, want: Any, path: str = "") -> tuple[str, Any, Any]:
    """The path (``.groups[1].block_size``) of the first leaf where ``have`` and ``want``
    differ, and the two values there."""
    if isinstance(have, dict) and isinstance(want, dict):
        for key in sorted(set(have) | set(want), key=str):
            if have.get(key) != want.get(key):
                return _first_difference(have.get(key), want.get(key), f"{path}.{key}")
    if isinstance(have, list) and isinstance(want, list) and len(have) == len(want):
        for i, (a, b) in enumerate(zip(have, want, strict=True)):
            if a != b:
                return _first_difference(a, b, f"{path}[{i}]")
    return path, have, want


def _short(value: Any) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= 60 else text[:57] + "..."
