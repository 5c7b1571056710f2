"""What a new user's review of the CLI found (2026-11-29), one test per finding; each fails on
the code before the fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridkv.cli.main import main
from hybridkv.errors import ConfigError
from hybridkv.models import spec_from_config
from hybridkv.models.catalog import catalog_config
from hybridkv.units import SizeError, format_bytes_si, parse_rate


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def write_config(tmp_path: Path, **fields: object) -> str:
    cfg = {**catalog_config("Llama-3.1-8B"), **fields}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


@pytest.mark.parametrize(
    ("argv", "field"),
    [
        (["models"], ("max_position_embeddings", 2**63)),
        (["plan", "--memory", "1000GiB", "--max-model-len", "4096"], ("head_dim", 1e308)),
    ],
)
def test_huge_config_integers_are_one_line_errors(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, argv: list[str], field: tuple[str, object]
) -> None:
    # Both ended in an OverflowError traceback (exit 1).
    path = write_config(tmp_path, **{field[0]: field[1]})
    code, out, err = run(capsys, argv[0], path, *argv[1:])
    assert code == 2 and out == ""
    assert err == (
        f"hybridkv {argv[0]}: error: llama config: field {field[0]!r} must be an integer in "
        f"[1, 2147483647], got {field[1]!r}\n"
    )


def test_rates_refuse_bits_and_take_per_second() -> None:
    assert parse_rate("50GB") == parse_rate("50GB/s") == parse_rate(" 50 GB / s ") == 50 * 10**9
    assert parse_rate("12.5GiB/s") == int(12.5 * 2**30)
    assert parse_rate(7) == 7
    for text, hint in (("400Gb", "50GB"), ("400gb/s", "50GB"), ("8Mib", "1.049MB")):
        with pytest.raises(SizeError) as info:
            parse_rate(text, field="--link-bandwidth")
        assert str(info.value) == (
            f"--link-bandwidth: {text.removesuffix('/s')!r} reads as bits per second "
            f"(lowercase b); give bytes per second, e.g. {hint}"
        )
    with pytest.raises(SizeError, match="size must be positive"):
        parse_rate("0")
    assert format_bytes_si(50 * 10**9) == "50GB"
    assert format_bytes_si(1500) == "1.5kB"
    assert format_bytes_si(999) == "999B"
    assert format_bytes_si(12_345 * 10**12) == "12345TB"


def test_link_bandwidth_in_bits_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    # `--link-bandwidth 400Gb` used to run with a 373 GiB/s link, 8x the 400 Gb/s meant.
    argv = ["simulate", "gpt-oss-20b", "--requests", "2", "--disaggregate", "--quiet"]
    code, out, err = run(capsys, *argv, "--link-bandwidth", "400Gb")
    assert code == 2 and out == ""
    assert err.startswith("hybridkv simulate: error: --link-bandwidth: '400Gb' reads as bits")
    code, out, _ = run(capsys, *argv, "--link-bandwidth", "50GB/s")
    assert code == 0 and "link 46.6 GiB/s" in out


def _tiny_trace(tmp_path: Path) -> str:
    rows = [
        {"timestamp": 0, "input_length": 1000, "output_length": 500, "hash_ids": [1, 2]},
        {"timestamp": 0, "input_length": 1199, "output_length": 5, "hash_ids": [3, 4, 5]},
        {"timestamp": 0, "input_length": 100, "output_length": 5, "hash_ids": [6]},
    ]
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.mark.parametrize("disaggregate", [False, True])
def test_outputs_cut_at_max_model_len_are_counted_and_warned(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, disaggregate: bool
) -> None:
    # They counted as finished with no word, while the header quoted the trace's outputs.
    argv = ["simulate", "gpt-oss-20b", "--trace", _tiny_trace(tmp_path), "--max-model-len"]
    argv += ["1200", "--strategy", "arena", "--json"] + (["--disaggregate"] if disaggregate else [])
    code, out, err = run(capsys, *argv)
    assert code == 0
    data = json.loads(out)
    summary = data if disaggregate else data[0]
    assert summary["finished"] == 3 and summary["truncated"] == 2
    assert (
        "warning: 2 of 3 requests had their outputs cut at max_model_len 1200 tokens (prompt "
        "plus output); they finish early and count as finished; raise --max-model-len to run "
        "them in full"
    ) in err
    code, _, err = run(capsys, *argv, "--quiet")
    assert code == 0 and err == ""


def test_no_warning_before_a_range_error(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "plan", "--max-model-len", "99999999999999")
    assert code == 2 and out == ""
    assert err == (
        "hybridkv plan: error: --max-model-len: 99999999999999 is larger than the maximum "
        "16777216\n"
    )
    code, _, err = run(capsys, "plan", "--max-model-len", "300000")
    assert code == 0 and err.startswith("hybridkv plan: warning: --max-model-len 300000 is above")


def test_model_that_is_not_a_regular_file(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "models", "/dev/null")
    assert code == 2 and out == ""
    assert err == (
        "hybridkv models: error: model: '/dev/null' is not a regular file or a directory; give "
        "a path to a config.json (or the directory holding it), or a catalog name\n"
    )


def test_a_size_split_by_a_space_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "plan", "--memory", "16", "GiB")
    assert code == 2 and out == ""
    assert err == (
        "hybridkv plan: error: model: 'GiB' is a size unit, not a model; a size is one word "
        "without a space (--memory 16GiB, or quoted: --memory '16 GiB')\n"
    )


def test_strategy_all_failures_name_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "plan", "gpt-oss-20b", "--memory", "3.1GiB", "--strategy", "all")
    assert code == 0
    line = next(x for x in out.splitlines() if x.startswith("pools: "))
    assert line.startswith("pools: --memory: 3.1 GiB (3328599654 B) holds no request")


@pytest.mark.parametrize(("name", "tp", "heads"), [("gemma-3-1b", 3, 4), ("Qwen2.5-7B", 8, 28)])
def test_tp_must_divide_the_query_heads(name: str, tp: int, heads: int) -> None:
    # Planned one rank's cache of a split no engine can run (vLLM refuses it too).
    cfg = catalog_config(name)
    with pytest.raises(ConfigError) as info:
        spec_from_config(cfg, tp_size=tp)
    assert f"tp_size={tp} does not divide num_attention_heads={heads}" in str(info.value)
    assert spec_from_config(cfg, tp_size=2).tp_size == 2
