"""A dependency-free progress line on stderr (redrawn on a terminal, every 10% otherwise)."""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["Progress"]


class Progress:
    """``Progress("arena")(done, total)`` reports progress; ``close()`` ends the line."""

    def __init__(self, label: str, *, stream: TextIO | None = None, enabled: bool = True) -> None:
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.tty = self.stream.isatty()
        self._last = 0.0
        self._last_decile = -1
        self._start = time.perf_counter()
        self._drawn = False

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled or total <= 0:
            return
        now = time.perf_counter()
        frac = done / total
        if self.tty:
            if now - self._last < 0.1 and done < total:
                return
            width = 30
            fill = int(width * frac)
            bar = "#" * fill + "." * (width - fill)
            elapsed = now - self._start
            self.stream.write(f"\r{self.label:>8} [{bar}] {done}/{total} {elapsed:5.1f}s")
            self.stream.flush()
            self._drawn = True
        else:
            decile = int(frac * 10)
            if decile == self._last_decile:
                return
            self._last_decile = decile
            elapsed = now - self._start
            self.stream.write(f"{self.label}: {done}/{total} ({frac:.0%}, {elapsed:.1f}s)\n")
            self.stream.flush()
        self._last = now

    def close(self) -> None:
        if self.enabled and self.tty and self._drawn:
            self.stream.write("\n")
            self.stream.flush()
