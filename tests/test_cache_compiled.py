"""Which build of the bookkeeping is under test: CI runs the cache, scheduler, simulator and
engine-exactness tests a second time on the compiled build (``HYBRIDKV_COMPILE=1``, see
setup.py) with ``HYBRIDKV_EXPECT_COMPILED=1``, and this test fails if that run imported the
pure-Python modules instead."""

from __future__ import annotations

import importlib
import os

import pytest

from hybridkv.cache import compiled

COMPILED = ["manager", "coordinator", "pool_arena", "pool_shared", "kinds.attention", "hashing"]
INTERPRETED = ["tiers", "tier_orders", "admission", "errors"]


def _is_extension(module: str) -> bool:
    path = str(importlib.import_module(f"hybridkv.cache.{module}").__file__)
    return not path.endswith(".py")


def test_the_build_under_test_is_the_one_expected() -> None:
    want = os.environ.get("HYBRIDKV_EXPECT_COMPILED")
    if want is None:
        pytest.skip("HYBRIDKV_EXPECT_COMPILED not set: either build is fine")
    assert compiled() is (want == "1")
    assert [_is_extension(m) for m in COMPILED] == [want == "1"] * len(COMPILED)
    # Tier and admission policies and the exception types are interpreted in both builds.
    assert not any(_is_extension(m) for m in INTERPRETED)


def test_version_names_the_build(capsys: pytest.CaptureFixture[str]) -> None:
    from hybridkv.cli.main import main

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    build = "compiled bookkeeping" if compiled() else "pure Python"
    assert capsys.readouterr().out == f"hybridkv 0.1.0 ({build})\n"
