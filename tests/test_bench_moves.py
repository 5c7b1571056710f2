"""benchmarks/bench_moves.py runs end to end on the CPU (a small arena) and both ways of
copying compaction's moves leave identical bytes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def test_bench_moves_copies_agree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(BENCH))
    import bench_moves

    out = tmp_path / "r.json"
    args = ["--model", "gpt-oss-20b", "--memory", "64MiB", "--max-model-len", "1024"]
    args += ["--moves", "4", "--repeats", "1"]
    result = bench_moves.main([*args, "--out", str(out)])
    assert json.loads(out.read_text())["config"]["moves"] == 4
    # gpt-oss-20b: a full-attention and a sliding-window group, in both layout kinds
    assert [(r["kind"], r["group"]) for r in result["rows"]] == [
        ("cross_layer", 0),
        ("cross_layer", 1),
        ("per_layer", 0),
        ("per_layer", 1),
    ]
    assert all(r["identical"] and r["moves"] == 4 for r in result["rows"])
    with pytest.raises(SystemExit):
        bench_moves.main(["--moves", "0"])
    sys.modules.pop("bench_moves", None)
