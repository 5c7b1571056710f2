"""``hybridkv models``: catalog table, per-layer table, JSON output and errors."""

from __future__ import annotations

import json

import pytest

from hybridkv.cli.main import main
from hybridkv.models import catalog_names


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["models", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_catalog_table(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys)
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[0].split()[:4] == ["NAME", "HF", "ID", "MODEL"]
    gpt = next(line for line in lines if line.startswith("gpt-oss-20b "))
    assert gpt.split() == [
        "gpt-oss-20b",
        "openai/gpt-oss-20b",
        "gpt_oss",
        "24",
        "48",
        "KiB",
        "0",
        "B",
        "12",
        "sliding(128)",
        "+",
        "12",
        "full",
    ]
    for name in catalog_names():
        assert any(line.startswith(name + " ") for line in lines)


def test_catalog_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "--json")
    assert code == 0
    rows = json.loads(out)
    assert [row["name"] for row in rows] == catalog_names()
    nemotron = next(row for row in rows if row["name"] == "Nemotron-H-8B")
    assert nemotron == {
        "name": "Nemotron-H-8B",
        "model_type": "nemotron_h",
        "num_layers": 52,
        "kinds": {"mamba2": 24, "none": 24, "full": 4},
        "bytes_per_token": 4 * 2 * 8 * 128 * 2,
        "state_bytes": 24 * (10240 * 4 * 2 + 128 * 64 * 128 * 4),
        "max_position_embeddings": 8192,
        "hf_id": "nvidia/Nemotron-H-8B-Base-8K",
    }


def test_one_model_table(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "falcon-h1-7b", "--tp", "2")
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == "Falcon-H1-7B (tiiuae/Falcon-H1-7B-Instruct): falcon_h1, 44 layers, tp=2"
    assert lines[2].split() == ["0", "hybrid", "full", "1", "kv", "x", "128,", "bf16", "512", "0"]
    state_bytes = str(2048 * 4 * 2 + 12 * 128 * 256 * 4)
    expected = ["mamba2", "conv", "2048x4", "bf16,", "ssm", "12x128x256", "fp32", "0", state_bytes]
    assert lines[3].split() == expected
    assert "caches: 44 full + 44 mamba2" in out


def test_one_model_json_with_kv_dtype(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "openai/gpt-oss-20b", "--json", "--kv-cache-dtype", "fp8")
    assert code == 0
    data = json.loads(out)
    assert data["hf_id"] == "openai/gpt-oss-20b"
    assert data["name"] == "gpt-oss-20b"
    assert len(data["layers"]) == 24
    assert data["layers"][0]["caches"][0]["dtype"] == "float8_e4m3fn"
    assert data["notes"] == ["kv_cache_dtype=float8_e4m3fn applies to attention/MLA caches only"]


def test_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "gpt-oss-2b")
    assert code == 2 and out == ""
    assert err.startswith("hybridkv models: error: model: 'gpt-oss-2b' is neither")
    code, _, err = run(capsys, "gpt-oss-20b", "--tp", "3")
    assert code == 2
    assert "tp_size=3 cannot shard num_key_value_heads=8" in err


def test_catalog_with_mtp_adds_the_mtp_layers_where_a_checkpoint_has_them(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = run(capsys, "--json")
    plain = {s["name"]: s for s in json.loads(out)}
    code, out, err = run(capsys, "--mtp", "--json")
    assert code == 0 and err == ""
    rows = {s["name"]: s for s in json.loads(out)}
    assert rows["DeepSeek-V3"]["num_layers"] == plain["DeepSeek-V3"]["num_layers"] + 1 == 62
    assert rows["DeepSeek-V3"]["bytes_per_token"] > plain["DeepSeek-V3"]["bytes_per_token"]
    assert rows["DeepSeek-V3"]["mtp_layers"] == 1
    assert rows["DeepSeek-V3"]["note"] == "+1 MTP layer"
    assert rows["gpt-oss-20b"] == {**plain["gpt-oss-20b"], "mtp_layers": 0}
    code, out, err = run(capsys, "--mtp")
    line = next(x for x in out.splitlines() if x.startswith("DeepSeek-V3 "))
    assert line.split()[3] == "62" and line.endswith("+1 MTP layer")
    assert out.splitlines()[0].split()[-1] == "NOTE"
    plain_line = next(x for x in out.splitlines() if x.startswith("gpt-oss-20b "))
    assert plain_line.rstrip().endswith("12 full")  # nothing noted without MTP layers
    assert "with MTP layers where the checkpoint has them" in out


def test_catalog_at_a_tp_some_models_cannot_use_lists_the_others(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = run(capsys, "--tp", "3", "--json")
    assert code == 0 and err == ""
    rows = {s["name"]: s for s in json.loads(out)}
    assert rows["gpt-oss-20b"] == {
        "name": "gpt-oss-20b",
        "hf_id": "openai/gpt-oss-20b",
        "note": "gpt_oss: tp_size=3 cannot shard num_key_value_heads=8; use a tp_size that "
        "divides 8 or is a multiple of it",
    }
    # MLA's latent is not split: any tp serves
    assert rows["DeepSeek-V3"]["model_type"] == "deepseek_v3" and "note" not in rows["DeepSeek-V3"]
    code, out, err = run(capsys, "--tp", "3")
    line = next(x for x in out.splitlines() if x.startswith("gpt-oss-20b "))
    assert line.split()[2:7] == ["-"] * 5 and line.endswith("is a multiple of it")
