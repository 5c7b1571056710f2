"""Parsing and formatting of byte sizes (``40GiB``, ``512MB``, ``1.5 TiB``)."""

from __future__ import annotations

import math
import re
from decimal import Decimal, localcontext

from hybridkv.errors import HybridKVError

__all__ = [
    "MAX_BYTES",
    "SizeError",
    "format_bytes",
    "format_bytes_exact",
    "format_bytes_si",
    "parse_bytes",
    "parse_rate",
]


class SizeError(HybridKVError, ValueError):
    """A byte size could not be parsed."""


_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}

#: The largest size accepted: 2^64 bytes (16 EiB), past any address space or disk.
MAX_BYTES = 1 << 64

_SIZE_RE = re.compile(r"^\s*(-?)\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str | int, *, field: str = "size", allow_zero: bool = False) -> int:
    """Parse ``text`` (``"40GiB"``, ``"512 MB"``, ``"1000"``) into a positive number of bytes.

    Decimal units (kB, MB, GB, TB) are powers of 1000, binary ones (KiB, MiB, GiB, TiB) powers
    of 1024.  A fraction of a unit is rounded down to whole bytes (``3.2GiB`` is 3435973836
    bytes); a fraction of a byte (``1.5``, ``0.5B``) is refused.  Raises :class:`SizeError`
    naming ``field`` when the text is not a positive size (``allow_zero``: not a size >= 0) or
    is past :data:`MAX_BYTES`.
    """
    if isinstance(text, int):
        value = text
    else:
        match = _SIZE_RE.match(text)
        if match is None or match.group(3).lower() not in _UNITS:
            raise SizeError(
                f"{field}: cannot parse {text!r} as a size; use a number with an optional unit "
                "(B, kB or k, MB or M, GB or G, TB or T: powers of 1000; KiB, MiB, GiB, TiB: "
                "powers of 1024), e.g. '40GiB'"
            )
        unit = _UNITS[match.group(3).lower()]
        with localcontext() as ctx:  # exact: the default 28 digits could round up
            ctx.prec = len(match.group(2)) + 16
            exact = Decimal(match.group(2)) * unit
        if unit == 1 and exact != exact.to_integral_value():
            raise SizeError(f"{field}: {text!r} is not a whole number of bytes")
        value = -int(exact) if match.group(1) else int(exact)  # int() rounds towards 0
    if value < 0 or (value == 0 and not allow_zero):
        raise SizeError(f"{field}: size must be positive, got {text!r}")
    if value > MAX_BYTES:
        raise SizeError(
            f"{field}: {text!r} is more than any machine addresses; give at most 16777216 TiB "
            "(2^64 B)"
        )
    return value


_PER_SECOND_RE = re.compile(r"\s*/\s*s\s*$")


def parse_rate(text: str | int, *, field: str = "bandwidth") -> int:
    """Parse a transfer rate in bytes per second: :func:`parse_bytes`'s sizes, optionally
    followed by ``/s`` (``"50GB"``, ``"50 GB/s"``, ``"12.5GiB/s"``).

    A unit that ends in a lowercase ``b`` after a prefix (``Gb``, ``gb``, ``Mb``, ``Gib``)
    reads as bits where rates are concerned (a "400 Gb/s" link moves 50 GB/s), so it is
    refused with the byte figure rather than taken as bytes, eight times too fast."""
    if isinstance(text, str):
        text = _PER_SECOND_RE.sub("", text)
        size = _SIZE_RE.match(text)
        if size is not None and not size.group(1):
            unit = size.group(3)
            if len(unit) >= 2 and unit[-1] == "b" and unit[:-1].lower() + "b" in _UNITS:
                per_second = parse_bytes(size.group(2) + unit[:-1] + "B", field=field) // 8
                raise SizeError(
                    f"{field}: {text.strip()!r} reads as bits per second (lowercase b); give "
                    f"bytes per second, e.g. {format_bytes_si(per_second)}"
                )
    return parse_bytes(text, field=field)


def format_bytes_si(num: int) -> str:
    """``num`` bytes in the largest decimal unit that keeps three significant digits
    (``50000000000`` -> ``'50GB'``, ``1500`` -> ``'1.5kB'``): a form :func:`parse_bytes`
    reads back."""
    for unit, size in (("TB", 1000**4), ("GB", 1000**3), ("MB", 1000**2), ("kB", 1000)):
        if num >= size:
            value = num / size
            return f"{value:.4g}{unit}" if value < 1000 else f"{value:.0f}{unit}"
    return f"{num}B"


def _three_digits(value: float) -> str:
    # ``:.3g`` switches to exponent notation from 1000 up; a binary unit never reaches 1024.
    return f"{value:.0f}" if value >= 1000 else f"{value:.3g}"


def format_bytes_exact(num: int) -> str:
    """``format_bytes(num)`` followed by the exact count in brackets, unless they say the same:
    ``'3 GiB (3225550848 B)'``, but ``'1000 B'``."""
    rounded = format_bytes(num)
    exact = f"{num} B"
    return rounded if rounded == exact else f"{rounded} ({exact})"


def format_bytes(num: float) -> str:
    """Format a byte count with a binary unit and about three significant digits.

    ``format_bytes(40 * 2**30) == '40 GiB'``, ``format_bytes(1000 * 2**20) == '1000 MiB'``;
    what no float holds, or a non-finite value, in bytes as given.
    """
    sign = "-" if num < 0 else ""
    try:
        value = float(abs(num))
    except OverflowError:  # an int past any float: say it exactly
        return f"{num} B"
    if not math.isfinite(value):
        return f"{num} B"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024:
            return (
                f"{sign}{value:.0f} {unit}"
                if unit == "B"
                else f"{sign}{_three_digits(value)} {unit}"
            )
        value /= 1024
    return f"{sign}{_three_digits(value)} TiB"
