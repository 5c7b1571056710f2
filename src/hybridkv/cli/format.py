"""Plain-text helpers for CLI output: aligned tables, compact integer ranges, percentages.

Pure string functions; nothing here prints.

>>> compact_ranges([0, 2, 4, 6, 8, 10])
'0,2,4,...,10'
>>> compact_ranges([0, 1, 2, 3, 5])
'0..3,5'
>>> print(render_table(["a", "bb"], [["1", "22"], ["333", "4"]], align="rl"))
  a  bb
  1  22
333  4
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["compact_ranges", "duration", "percent", "render_table"]

#: Runs with step 1 at least this long are written ``a..b``.
_MIN_UNIT_RUN = 3
#: Runs with a larger step at least this long are written ``a,a+s,a+2s,...,b`` (not ``..``,
#: which would read as every integer up to ``b``).
_MIN_STEP_RUN = 5


def compact_ranges(values: Sequence[int]) -> str:
    """Sorted, de-duplicated ``values`` with arithmetic runs abbreviated.

    A run of consecutive integers (3 or more) becomes ``first..last``; a run with a larger
    constant step (5 or more) becomes ``first,second,third,...,last``; anything else is listed.
    """
    items = sorted(set(values))
    parts: list[str] = []
    i = 0
    while i < len(items):
        j = i + 1
        if j < len(items):
            step = items[j] - items[i]
            while j + 1 < len(items) and items[j + 1] - items[j] == step:
                j += 1
            length = j - i + 1
            if step == 1 and length >= _MIN_UNIT_RUN:
                parts.append(f"{items[i]}..{items[j]}")
                i = j + 1
                continue
            if step > 1 and length >= _MIN_STEP_RUN:
                head = ",".join(str(v) for v in items[i : i + 3])
                parts.append(f"{head},...,{items[j]}")
                i = j + 1
                continue
        parts.append(str(items[i]))
        i += 1
    return ",".join(parts)


def duration(seconds: float) -> str:
    """A time in the unit that reads best: ``0.0123`` -> ``'12.30 ms'``, ``75`` -> ``'75.0
    s'``, ``7200`` -> ``'2.0 h'``, ``1e9`` -> ``'11574.1 days'``."""
    if seconds < 1:
        return f"{seconds * 1e3:.2f} ms"
    for unit, size in (("days", 86400.0), ("h", 3600.0), ("min", 60.0)):
        if seconds >= 2 * size:
            return f"{seconds / size:.1f} {unit}"
    return f"{seconds:.1f} s"


def percent(fraction: float, digits: int = 2) -> str:
    """``0.1234`` -> ``'12.34%'``."""
    return f"{100 * fraction:.{digits}f}%"


def render_table(
    headers: Sequence[str], rows: Sequence[Sequence[str]], *, align: str | None = None
) -> str:
    """Columns padded to their widest cell and separated by two spaces, no trailing blanks.

    ``align`` has one ``'l'`` or ``'r'`` per column (default: all left).  Raises
    ``ValueError`` when a row or ``align`` does not have one entry per header.
    """
    width = len(headers)
    spec = align if align is not None else "l" * width
    if len(spec) != width or any(a not in "lr" for a in spec):
        raise ValueError(f"align: need one of 'l'/'r' per column ({width}), got {align!r}")
    for row in rows:
        if len(row) != width:
            raise ValueError(f"rows: every row needs {width} cells, got {len(row)}: {row!r}")
    table = [list(headers), *(list(r) for r in rows)]
    widths = [max(len(r[c]) for r in table) for c in range(width)]
    lines = []
    for r in table:
        cells = [
            cell.rjust(w) if a == "r" else cell.ljust(w)
            for cell, w, a in zip(r, widths, spec, strict=True)
        ]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)
