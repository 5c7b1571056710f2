"""hybridkv.units: byte sizes as people write them and as the library prints them."""

from __future__ import annotations

import math
from typing import Any

import pytest

from hybridkv.cli.main import main
from hybridkv.units import SizeError, format_bytes, format_bytes_exact, parse_bytes


@pytest.mark.parametrize(
    ("num", "text"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (40 * 2**30, "40 GiB"),
        (1000 * 2**20, "1000 MiB"),
        (-3 * 2**20, "-3 MiB"),
        (10**400, f"{10**400} B"),  # past any float: said exactly (it raised OverflowError)
        (math.inf, "inf B"),
        (math.nan, "nan B"),
    ],
)
def test_format_bytes(num: float, text: str) -> None:
    assert format_bytes(num) == text


def test_a_vanishing_pool_ratio_is_a_one_line_error(capsys: Any) -> None:
    # found by a review: the refusal's own message raised OverflowError formatting the bytes
    # the split would need
    assert main(["plan", "--strategy", "pools", "--pool-ratios", "1e-300,1"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert err.startswith("hybridkv plan: error: --pool-ratios: the fixed split by pool_ratios:")
    assert "this split needs more than any machine addresses" in err


def test_format_bytes_exact_brackets_only_a_rounded_count() -> None:
    assert format_bytes_exact(3225550848) == "3 GiB (3225550848 B)"
    assert format_bytes_exact(1536) == "1.5 KiB (1536 B)"
    assert format_bytes_exact(1000) == "1000 B"
    assert format_bytes_exact(0) == "0 B"


def test_parse_bytes_allows_zero_only_when_asked() -> None:
    assert parse_bytes("0GiB", allow_zero=True) == parse_bytes("0.0 TB", allow_zero=True) == 0
    with pytest.raises(SizeError, match="size must be positive"):
        parse_bytes("0GiB")
    with pytest.raises(SizeError, match="cannot parse '0foo'"):
        parse_bytes("0foo", allow_zero=True)
