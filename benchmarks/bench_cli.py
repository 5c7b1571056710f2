"""Command-line checks every benchmark script makes before it spends minutes running: the
JSON result path is a writable file (its folder created), and counts are in range.  Each
failure is argparse's one-line error with exit status 2."""

from __future__ import annotations

import argparse
import os
from pathlib import Path


def out_path(parser: argparse.ArgumentParser, value: str | Path, flag: str = "--out") -> Path:
    """``value`` as the path the run will write, its folder created now; a directory, a
    folder that cannot be made or a file that cannot be written is refused."""
    path = Path(value)
    if path.is_dir():
        parser.error(f"{flag}: {path} is a directory; give a file path")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        parser.error(f"{flag}: cannot create the folder {path.parent} ({exc.strerror})")
    if not os.access(path.parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        parser.error(f"{flag}: {path} is not writable")
    return path


def at_least(parser: argparse.ArgumentParser, flag: str, value: int | None, low: int = 1) -> None:
    """Refuse ``value`` below ``low`` (None: the option was not given)."""
    if value is not None and value < low:
        parser.error(f"{flag}: must be at least {low}, got {value}")
