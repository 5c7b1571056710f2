"""docs/output.md lists exactly the keys ``simulate --json``, ``report.json`` and
``simulate --disaggregate --json`` print: each documented table is compared with the keys
of a real (small) run, so the page and the output change together."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from hybridkv.cli.main import main

DOC = Path(__file__).resolve().parents[1] / "docs" / "output.md"


def _tables() -> dict[str, list[set[str]]]:
    """Per ``##`` section, the key sets of its tables, in order (a row's first cell may
    name several keys: ``a``, ``b``)."""
    out: dict[str, list[set[str]]] = {}
    section, rows = "", None
    for line in DOC.read_text().splitlines():
        if line.startswith("## "):
            section = line[3:].strip()
            rows = None
            continue
        if line.startswith("| key |"):
            rows = set()
            out.setdefault(section, []).append(rows)
            continue
        if rows is not None and line.startswith("| `"):
            rows.update(re.findall(r"`([a-z_0-9]+)`", line.split("|")[1]))
        elif rows is not None and not line.startswith("|---"):
            rows = None
    return out


def _json(capsys: pytest.CaptureFixture[str], *argv: str) -> object:
    assert main(list(argv)) == 0
    return json.loads(capsys.readouterr().out)


SIM = ["simulate", "gpt-oss-20b", "--trace", "synthetic:agent", "--memory", "700MiB"]
SIM += ["--max-model-len", "16384", "--requests", "12", "--quiet"]


def test_simulate_json_and_report_keys_are_the_documented_ones(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    tables = _tables()
    summary, tier, *_ = tables["`simulate --json`"]
    top, result, point = tables["`report.json` (`simulate --report DIR`)"]
    runs = _json(capsys, *SIM, "--strategy", "arena", "--host-memory", "1GiB", "--json")
    assert isinstance(runs, list) and len(runs) == 1
    assert set(runs[0]) == summary
    assert set(runs[0]["tiers"]["host"]) == tier
    assert main([*SIM, "--strategy", "all", "--report", str(tmp_path)]) == 0
    capsys.readouterr()
    report = json.loads((tmp_path / "report.json").read_text())
    assert set(report) == top
    for r in report["results"]:
        assert set(r) == result and set(r["summary"]) == summary
        assert r["timeline"] and all(set(p) == point for p in r["timeline"])


def test_disaggregated_json_keys_are_the_documented_ones(
    capsys: pytest.CaptureFixture[str],
) -> None:
    (keys,) = _tables()["`simulate --disaggregate --json`"]
    argv = ["simulate", "gpt-oss-20b", "--trace", "synthetic:chat", "--strategy", "arena"]
    out = _json(capsys, *argv, "--disaggregate", "--requests", "6", "--quiet", "--json")
    assert isinstance(out, dict) and set(out) == keys
