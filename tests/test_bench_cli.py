"""The benchmark scripts refuse bad command lines with argparse's one-line error (exit 2)
before they run, and write where --out says; bench_pd counts a request's runs per group."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, ModuleType]]:
    monkeypatch.syspath_prepend(str(BENCH))
    import bench_engine
    import bench_pd
    import bench_tiers

    import bench_cli
    import bench_transfer

    yield {
        "cli": bench_cli,
        "engine": bench_engine,
        "pd": bench_pd,
        "tiers": bench_tiers,
        "transfer": bench_transfer,
    }
    for name in ("bench_cli", "bench_engine", "bench_pd", "bench_tiers", "bench_transfer"):
        sys.modules.pop(name, None)


def _refused(main: object, argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)  # type: ignore[operator]
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "Traceback" not in "\n".join(err)
    return err[-1]


def test_out_path_makes_the_folder_and_refuses_what_it_cannot_write(
    bench: dict[str, ModuleType], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cli = bench["cli"]
    parser = argparse.ArgumentParser(prog="b")
    got = cli.out_path(parser, tmp_path / "a" / "b" / "r.json")
    assert got == tmp_path / "a" / "b" / "r.json" and got.parent.is_dir() and not got.exists()
    with pytest.raises(SystemExit):
        cli.out_path(parser, tmp_path)
    assert (
        capsys.readouterr()
        .err.strip()
        .endswith(f"--out: {tmp_path} is a directory; give a file path")
    )
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(SystemExit):
        cli.out_path(parser, blocker / "r.json")
    assert f"--out: cannot create the folder {blocker}" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.at_least(parser, "--n", 0)
    assert capsys.readouterr().err.strip().endswith("--n: must be at least 1, got 0")
    cli.at_least(parser, "--n", None)  # not given
    cli.at_least(parser, "--n", 0, 0)


@pytest.mark.parametrize(
    ("script", "argv", "message"),
    [
        ("transfer", ["--repeats", "0"], "--repeats: must be at least 1, got 0"),
        ("transfer", ["--blocks", "-3"], "--blocks: must be at least 1, got -3"),
        ("transfer", ["--dtype", "foo"], "FullAttentionSpec.dtype: unknown dtype 'foo'"),
        ("tiers", ["--readers", "0"], "--readers: must be at least 1, got 0"),
        ("tiers", ["--disk-dir", "/nonexistent-hkv"], "--disk-dir: /nonexistent-hkv is not a"),
        ("pd", ["--repeats", "0"], "--repeats: must be at least 1, got 0"),
        ("pd", ["--state-layers", "0"], "--state-layers: must be at least 1, got 0"),
        ("engine", ["--repeats", "0"], "--repeats: must be at least 1, got 0"),
        ("engine", ["--override", "nonsense_key=3"], "lfm3's config has no field 'nonsense_key'"),
        ("engine", ["--model", "/x", "--override", "a=1"], "applies to the built-in tiny models"),
    ],
)
def test_bad_arguments_are_one_line_errors(
    bench: dict[str, ModuleType],
    capsys: pytest.CaptureFixture[str],
    script: str,
    argv: list[str],
    message: str,
) -> None:
    assert message in _refused(bench[script].main, argv, capsys)


def test_bench_pd_counts_runs_by_group_not_by_length(
    bench: dict[str, ModuleType], tmp_path: Path
) -> None:
    # One 512-byte attention block divides the 1,073,152-byte state slot: counting runs by
    # "a multiple of the block bytes" took the state's run for an attention one.
    out = tmp_path / "pd.json"
    argv = ["--blocks", "4", "--layers", "1", "--state-layers", "1", "--heads", "1"]
    argv += ["--head-dim", "8", "--repeats", "1", "--out", str(out)]
    row = bench["pd"].main(argv)["row"]
    assert (row["attention_runs"], row["state_runs"], row["exact"]) == (4, 1, True)
    assert json.loads(out.read_text())["row"] == row
