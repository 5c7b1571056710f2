from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from hybridkv.cli.main import main
from hybridkv.errors import PlanError
from hybridkv.models import resolve_model
from hybridkv.plan import Strategy
from hybridkv.sim import ModelProfile, SimConfig, load_model_config, simulate
from hybridkv.sim.report import write_report
from hybridkv.sim.simulator import _need_function
from hybridkv.workloads import SyntheticOptions, synthetic_workload


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


@pytest.fixture(scope="module")
def results() -> list:  # type: ignore[type-arg]
    model = resolve_model("gpt-oss-20b")
    profile = ModelProfile.from_config(load_model_config("gpt-oss-20b"))
    work = synthetic_workload("chat", SyntheticOptions(num_requests=40, seed=5))
    out = []
    for strategy in Strategy:
        cfg = SimConfig(memory_bytes=1 << 30, max_model_len=16384, strategy=strategy)
        out.append(simulate(model, profile, work, cfg))
    return out


def test_every_request_finishes_and_tokens_add_up(results: list) -> None:  # type: ignore[type-arg]
    work = synthetic_workload("chat", SyntheticOptions(num_requests=40, seed=5))
    for r in results:
        assert r.finished + len(r.rejected) == r.num_requests == 40
        assert r.output_tokens == work.output_tokens
        assert r.prompt_tokens == work.prompt_tokens
        # every prompt token is served from cache or computed; recompute only adds
        assert r.cached_tokens + r.computed_tokens >= r.prompt_tokens + r.output_tokens - 40
        assert 0.0 <= r.hit_rate <= 1.0
        assert len(r.ttft_s) == 40
        assert all(t >= 0 for t in r.ttft_s)


def test_shared_prefix_workload_hits(results: list) -> None:  # type: ignore[type-arg]
    arena = results[0]
    assert arena.strategy == "arena"
    assert arena.hit_rate > 0.3
    assert arena.peak_used_bytes <= arena.plan.memory_bytes


def test_need_function_matches_model_rule() -> None:
    for name in ("gpt-oss-20b", "gemma-3-27b", "Qwen3-Next-80B-A3B", "DeepSeek-V3"):
        model = resolve_model(name)
        need = _need_function(model)
        for n in (0, 1, 127, 128, 129, 1024, 4097, 100_000):
            assert need(n) == model.resident_bytes(n)


def test_report_files(results: list, tmp_path: Path) -> None:  # type: ignore[type-arg]
    out = write_report(results, tmp_path / "rep", title="t")
    for name in ("hit_rate.png", "memory.png", "group_usage.png"):
        w, h = _png_size(out / name)
        assert w > 300 and h > 200
    data = json.loads((out / "report.json").read_text())
    assert [r["summary"]["strategy"] for r in data["results"]] == ["arena", "uniform", "pools"]
    assert data["results"][0]["timeline"]
    assert "hit_rate.png" in (out / "index.html").read_text()


def test_model_that_cannot_fit_one_request() -> None:
    model = resolve_model("Llama-3.1-8B")
    profile = ModelProfile.from_config(load_model_config("Llama-3.1-8B"))
    work = synthetic_workload("docs", SyntheticOptions(num_requests=2))
    with pytest.raises(PlanError, match="holds no request of max_model_len 8192"):
        simulate(model, profile, work, SimConfig(memory_bytes=64 << 20, max_model_len=8192))


def test_cli_simulate_small(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code = main(["simulate", "--requests", "12", "--strategy", "arena", "--quiet", "--json"])
    assert code == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary[0]["finished"] == 12


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["simulate", "--trace", "synthetic:nope"], "unknown synthetic workload 'nope'"),
        (["simulate", "--memory", "lots"], "--memory: cannot parse 'lots'"),
        (["simulate", "--model", "no-such-model"], "no-such-model"),
        (["simulate", "--requests", "0"], "--requests: must be a positive integer"),
    ],
)
def test_cli_simulate_errors(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*argv, "--quiet"]) == 2
    err = capsys.readouterr().err
    assert needle in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_cli_simulate_malformed_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1}\n')
    assert main(["simulate", "--trace", str(trace), "--quiet"]) == 2
    assert "t.jsonl:1: missing field 'hash_ids'" in capsys.readouterr().err
