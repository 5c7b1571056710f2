"""benchmarks/bench_tiers.py runs end to end on the CPU (tiny sizes) and every round trip,
host and disk, the sweep's too, gives back identical bytes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def test_bench_tiers_round_trips_are_identical(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(BENCH))
    import bench_tiers

    out = tmp_path / "r.json"
    args = ["--blocks", "6", "--layers", "1", "--heads", "2", "--head-dim", "8"]
    args += ["--repeats", "1", "--sweep", "1,2", "--disk-dir", str(tmp_path), "--out", str(out)]
    result = bench_tiers.main(args)
    assert json.loads(out.read_text())["config"]["sweep"] == "1,2"
    rows = result["rows"] + result["disk_rows"] + result["sweep"]
    assert len(rows) == 2 + 2 + 4
    assert all(r["round_trip_identical"] for r in rows)
    assert [r["bytes"] // r["blocks"] for r in result["sweep"]] == [1024, 1024, 2048, 2048]
    for r in result["rows"] + result["sweep"]:  # the breakdown: every block is rows of a table
        assert r["store_host_us"] > 0 and r["load_host_us"] > 0
        assert r["one_run_ratio"] is not None and r["one_run_ratio"] > 0
    with pytest.raises(SystemExit):
        bench_tiers.main(["--sweep", "0"])
    sys.modules.pop("bench_tiers", None)
