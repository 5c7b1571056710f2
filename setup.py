"""Optional compiled build of the torch-free cache bookkeeping (everything else: pyproject.toml).

``HYBRIDKV_COMPILE=1 pip install --no-build-isolation .`` compiles ``KVCacheManager``, the
block pools, the per-kind managers, the coordinator, hashing and their data types with mypyc
(the environment needs mypy, setuptools and wheel, e.g. the ``test`` extra); any other
install is pure Python.  Both builds behave the same on every valid input (CI runs the cache,
scheduler, simulator and engine-exactness tests on both); the compiled one checks argument
types at each call, so a value of the wrong type is a ``TypeError`` there (a ``bool`` passed
for an ``int`` reads as 0 / 1) where the pure build raises the library's typed error.
``hybridkv.cache.compiled()`` says which build is running.
"""

from __future__ import annotations

import os
from pathlib import Path

from setuptools import setup

#: Interpreted in every build: tier and admission policies (tests and users subclass them;
#: ``tier_orders`` holds the tiers' own class) and the exception types.
INTERPRETED = {"__init__.py", "tiers.py", "tier_orders.py", "admission.py", "errors.py"}


def _ext_modules() -> list[object]:
    if os.environ.get("HYBRIDKV_COMPILE", "0") != "1":
        return []
    try:
        from mypyc.build import mypycify
    except ImportError as exc:
        raise SystemExit(
            "HYBRIDKV_COMPILE=1: mypyc is not importable in the build environment; install "
            "mypy (e.g. the test extra) and build with pip's --no-build-isolation"
        ) from exc

    root = Path("src/hybridkv/cache")
    files = sorted(
        str(p)
        for p in [*root.glob("*.py"), *root.glob("kinds/*.py")]
        if not (p.parent == root and p.name in INTERPRETED)
    )
    return list(mypycify(files, opt_level="3"))


setup(ext_modules=_ext_modules())
