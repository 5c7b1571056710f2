"""The suite enforces lint, formatting and strict typing of the library."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _tool(name: str) -> str:
    exe = Path(sys.executable).parent / name
    if exe.exists():
        return str(exe)
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed; install the test extra: pip install -e '.[test]'")
    return found


@pytest.mark.parametrize(
    "cmd",
    [
        ["ruff", "check", "src", "tests", "benchmarks"],
        ["ruff", "format", "--check", "src", "tests", "benchmarks"],
        ["mypy", "--strict", "src/hybridkv"],
    ],
    ids=["ruff-check", "ruff-format", "mypy-strict"],
)
def test_static_checks(cmd: list[str]) -> None:
    proc = subprocess.run(
        [_tool(cmd[0]), *cmd[1:]], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_bookkeeping_layers_import_no_torch() -> None:
    code = (
        "import sys, hybridkv.specs, hybridkv.plan, hybridkv.models, hybridkv.cache;"
        "assert 'torch' not in sys.modules, 'torch imported by a bookkeeping layer'"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
