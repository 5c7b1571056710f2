"""The core install (no torch, no transformers) plans, lists models and simulates.

Each command runs in a fresh interpreter where importing torch or transformers fails, as on a
``pip install hybridkv`` without the ``engine`` extra.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

_BLOCK = """
import sys
from importlib.abc import MetaPathFinder

class _NoEngine(MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "transformers"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, _NoEngine())
from hybridkv.cli.main import main
code = main(sys.argv[1:])
assert "torch" not in sys.modules and "transformers" not in sys.modules
sys.exit(code)
"""


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _BLOCK, *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=300,
        check=False,
    )


@pytest.mark.parametrize(
    "args",
    [
        ("models",),
        ("models", "Jamba-v0.1"),
        ("plan", "--strategy", "all"),
        ("simulate", "--requests", "40", "--quiet"),
    ],
    ids=lambda a: " ".join(a),
)
def test_core_commands_need_no_torch(args: tuple[str, ...], tmp_path: Path) -> None:
    proc = _cli(*args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stdout


def test_simulate_report_needs_no_torch(tmp_path: Path) -> None:
    proc = _cli("simulate", "--requests", "30", "--quiet", "--report", "out", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "group_usage.png",
        "hit_rate.png",
        "index.html",
        "memory.png",
        "report.json",
    ]


def test_run_without_the_engine_extra_is_one_line(tmp_path: Path) -> None:
    proc = _cli("run", cwd=tmp_path)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hybridkv run: error:"), proc.stderr
    assert "hybridkv[engine]" in lines[0]
