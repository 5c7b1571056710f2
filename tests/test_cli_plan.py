"""``hybridkv plan`` through the real entry point, plus the table helpers it uses."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import hybridkv.models
from hybridkv.cli.format import compact_ranges, duration, percent, render_table
from hybridkv.cli.main import main
from hybridkv.plan import Plan, make_plan
from hybridkv.specs import ModelSpec
from hybridkv.units import SizeError, parse_bytes
from test_plan_factories import swa_full_model

TINY = ["--memory", "17384", "--max-model-len", "32", "--block-size", "4"]
TINY_ARENA = [*TINY, "--chunk-alignment", "1024"]


@pytest.fixture
def tiny(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Make every model name resolve to the 4-layer sliding/full model; record the calls."""
    calls: list[dict[str, Any]] = []

    def resolve(name: str, **kwargs: Any) -> ModelSpec:
        calls.append({"name": name, **kwargs})
        if name == "long":
            return ModelSpec.from_dict(
                {**swa_full_model().to_dict(), "max_position_embeddings": 64}
            )
        return swa_full_model()

    monkeypatch.setattr(hybridkv.models, "resolve_model", resolve)
    return calls


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["plan", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_table_and_summary(tiny: list[dict[str, Any]], capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(capsys, "tiny", *TINY_ARENA)
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[0] == (
        "model tiny (tiny, 4 layers, tp 1); strategy arena; memory 17 KiB (17384 B); "
        "max_model_len 32"
    )
    assert lines[2] == (
        "arena: 16 chunks of 1 KiB (1024 B), chunk 0: null blocks in its first 256 B, "
        "blocks 1..3 lent to group 0 for good; the last 768 B past them: blocks 64..66 lent to "
        "group 0 for good"
    )
    assert lines[4].split() == [
        "group", "kind", "window", "layers", "members", "block", "kernel", "page", "block",
        "bytes", "blocks/req", "blocks/chunk",
    ]  # fmt: skip
    assert lines[5].split() == ["0", "sliding_window", "8", "0,2", "2", "4", "4", "128", "B",
                                "256", "B", "4", "4"]  # fmt: skip
    assert lines[6].split() == ["1", "full_attention", "-", "1,3", "2", "4", "4", "128", "B",
                                "256", "B", "8", "4"]  # fmt: skip
    assert "capacity       5 requests x 32 tokens = 160 tokens" in lines
    assert lines[9].startswith("waste          488 B (2.81%): padded_layers 0 B,")
    assert "physical need  12.5 KiB of 17 KiB (utilisation 73.6%)" in lines
    assert tiny == [{"name": "tiny", "tp_size": 1, "kv_cache_dtype": None, "mtp": False}]


def test_uniform_shows_pool_blocks(
    tiny: list[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = _run(capsys, "tiny", *TINY, "--strategy", "uniform")
    assert code == 0
    assert "pool 0: 67 blocks of 256 B, block 0 reserved, groups 0,1" in out
    assert "pool blocks" in out


def test_json_matches_the_library(
    tiny: list[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = _run(capsys, "tiny", *TINY_ARENA, "--json")
    assert code == 0
    plan = Plan.from_dict(json.loads(out))
    expected = make_plan(
        swa_full_model(), memory_bytes=17384, max_model_len=32, block_size=4, chunk_alignment=1024
    )
    assert plan == expected


def test_all_strategies_side_by_side(
    tiny: list[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = _run(capsys, "tiny", *TINY_ARENA, "--strategy", "all")
    assert code == 0
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()[2:7]}
    assert rows["strategy"] == ["requests", "tokens", "waste", "waste", "%", "utilisation", "%"]
    # chunk tails 1000 B less the tail host's 768 B + the null region 256 B (chunk 0's other
    # 768 B are group 0's too)
    assert rows["arena"] == ["5", "160", "488", "B", "2.81%", "73.6%"]
    assert rows["uniform"] == ["5", "160", "488", "B", "2.81%", "73.6%"]
    assert rows["pools"] == ["4", "128", "1000", "B", "5.75%", "58.9%"]
    assert rows["naive"] == ["4", "128", "6", "KiB", "35.34%", "58.9%"]
    code, out, _ = _run(capsys, "tiny", *TINY_ARENA, "--strategy", "all", "--json")
    data = json.loads(out)
    assert sorted(data["plans"]) == ["arena", "pools", "uniform"]
    assert data["naive"]["max_concurrent_requests"] == 4


def test_options_reach_the_planner(
    tiny: list[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    args = [*TINY, "--strategy", "pools", "--pool-ratios", "1,1", "--tp", "2", "--kv-cache-dtype"]
    code, out, _ = _run(capsys, "x", *args, "fp8", "--kernel-block-size", "2", "--json")
    assert code == 0
    data = json.loads(out)
    assert data["options"]["pool_ratios"] == [1.0, 1.0]
    assert [p["num_blocks"] for p in data["layout"]["pools"]] == [33, 33]
    assert {g["kernel_block_size"] for g in data["layout"]["groups"]} == {2}
    assert tiny[-1] == {"name": "x", "tp_size": 2, "kv_cache_dtype": "fp8", "mtp": False}


def test_max_model_len_defaults(
    tiny: list[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = _run(capsys, "long", "--memory", "1GiB", "--json")
    assert code == 0
    assert json.loads(out)["max_model_len"] == 64
    code, out, _ = _run(capsys, "tiny", "--memory", "1GiB", "--json")
    assert json.loads(out)["max_model_len"] == 131072


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--memory", "lots"], "--memory: cannot parse 'lots'"),
        (["--memory", "0"], "--memory: size must be positive"),
        (["--block-size", "0"], "--block-size: must be a positive integer, got 0"),
        (["--kernel-block-size", "3"], "--kernel-block-size: 3 does not divide block_size 4"),
        (["--max-model-len", "0"], "--max-model-len: must be a positive integer, got 0"),
        (["--pool-ratios", "1,x", "--strategy", "pools"], "--pool-ratios: cannot parse"),
        (["--pool-ratios", "1,2"], "--pool-ratios: only the pools strategy takes ratios"),
        (["--pool-ratios", "1", "--strategy", "pools"], "--pool-ratios: got 1 ratios"),
        (["--tp", "0"], "--tp: must be a positive integer, got 0"),
        (["--memory", "1000"], "--memory: 1000 B holds no request"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    tiny: list[dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
    args: list[str],
    message: str,
) -> None:
    code, out, err = _run(capsys, "tiny", *TINY, *args)
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1
    assert err.startswith(f"hybridkv plan: error: {message}")


def test_argparse_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--strategy", "bogus"])
    assert exc.value.code == 2
    assert "invalid choice: 'bogus'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--block-size", "four"])
    assert exc.value.code == 2


def test_default_catalog_model(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(capsys)
    assert (code, err) == (0, "")
    assert out.startswith(
        "model Qwen3-Next-80B-A3B (qwen3_next, 48 layers, tp 1); strategy arena; memory 8 GiB"
    )
    assert "max_model_len 131072" in out.splitlines()[0]
    assert "capacity       2 requests x 131072 tokens" in out


def test_unknown_model(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(capsys, "no-such-model-xyz")
    assert code == 2
    assert err.startswith("hybridkv plan: error: ")
    assert err.count("\n") == 1


def test_compact_ranges() -> None:
    assert compact_ranges([]) == ""
    assert compact_ranges([3]) == "3"
    assert compact_ranges([0, 1]) == "0,1"
    assert compact_ranges([0, 1, 2, 3, 5]) == "0..3,5"
    assert compact_ranges(range(0, 24, 2)) == "0,2,4,...,22"
    assert compact_ranges([5, 11, 17, 23, 29, 35]) == "5,11,17,...,35"
    assert compact_ranges([0, 2, 4, 6]) == "0,2,4,6"
    assert compact_ranges([0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 12]) == "0..4,6..10,12"
    assert compact_ranges([4, 2, 2, 0]) == "0,2,4"


def test_render_table() -> None:
    text = render_table(["a", "bb"], [["1", "22"], ["333", "4"]], align="rl")
    assert text.splitlines() == ["  a  bb", "  1  22", "333  4"]
    assert render_table(["x"], []) == "x"
    with pytest.raises(ValueError, match="align"):
        render_table(["a"], [], align="c")
    with pytest.raises(ValueError, match="rows"):
        render_table(["a", "b"], [["1"]])


def test_percent() -> None:
    assert percent(0.1234) == "12.34%"
    assert percent(0.5, 1) == "50.0%"


def test_a_max_model_len_beyond_the_model_is_planned_with_a_warning(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = _run(capsys, "--max-model-len", "1000000", "--memory", "1TiB")
    assert code == 0
    assert err == (
        "hybridkv plan: warning: --max-model-len 1000000 is above Qwen3-Next-80B-A3B's own "
        "limit of 262144 positions (max_position_embeddings)\n"
    )
    assert "max_model_len 1000000" in out.splitlines()[0]
    code, out, err = _run(capsys, "--max-model-len", "262144", "--memory", "1TiB")
    assert (code, err) == (0, "")


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("1000", 1000),
        ("8G", 8 * 10**9),
        ("8g", 8 * 10**9),
        ("1.3kB", 1300),
        ("1.5GiB", 3 * 2**29),
        ("3.2GiB", 3435973836),  # a fraction of a unit is rounded down to whole bytes
        ("1.0001kB", 1000),
        ("2.9999999999999999999999999999999GiB", 3 * 2**30 - 1),  # past 28 digits: still down
        (" 40 GiB ", 40 * 2**30),
    ],
)
def test_sizes_parse_to_whole_bytes(text: str, value: int) -> None:
    assert parse_bytes(text, field="--memory") == value


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("1.5", "--memory: '1.5' is not a whole number of bytes"),
        ("0.5B", "--memory: '0.5B' is not a whole number of bytes"),
        ("-1GiB", "--memory: size must be positive, got '-1GiB'"),
        ("0", "--memory: size must be positive, got '0'"),
        ("12XB", "--memory: cannot parse '12XB' as a size; use a number with an optional unit"),
    ],
)
def test_sizes_that_are_not_whole_positive_bytes_are_refused(text: str, message: str) -> None:
    with pytest.raises(SizeError) as info:
        parse_bytes(text, field="--memory")
    assert str(info.value).startswith(message)


def test_the_state_split_line_says_what_was_split(capsys: pytest.CaptureFixture[str]) -> None:
    """The header names the state groups the split made (a split beyond the layers makes one
    group a layer); a model without state layers refuses the option it would ignore."""
    code, out, _ = _run(capsys, "Qwen3-Next-80B-A3B", "--state-split", "37")
    assert code == 0
    assert out.splitlines()[1].endswith("; 36 state layers in 36 groups (--state-split 37)")
    code, out, _ = _run(capsys, "Qwen3-Next-80B-A3B", "--state-split", "4")
    assert out.splitlines()[1].endswith("; 36 state layers in 4 groups (--state-split 4)")
    code, out, err = _run(capsys, "gpt-oss-20b", "--state-split", "4")
    assert (code, out) == (2, "")
    assert err == (
        "hybridkv plan: error: --state-split 4: only applies to models with recurrent-state "
        "layers; gpt-oss-20b has none\n"
    )
    code, out, _ = _run(capsys, "gpt-oss-20b")
    assert code == 0 and "state layers" not in out.splitlines()[1]


def test_what_the_config_leaves_out_is_said(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """No max_position_embeddings: the length planned for is said on stderr; a model type
    without a registry entry and no dtype: the spec's notes are printed with the plan."""
    config = {
        "model_type": "somethingnew",
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config), encoding="utf-8")
    code, out, err = _run(capsys, str(path), "--memory", "1GiB")
    assert code == 0
    assert err == (
        f"hybridkv plan: note: {tmp_path.name}'s config names no max_position_embeddings; "
        "planning for 131072 tokens (give --max-model-len)\n"
    )
    assert "note: somethingnew: no registry entry; derived generically" in out
    assert "note: the config names no dtype (dtype, torch_dtype): bfloat16 assumed" in out
    code, out, err = _run(capsys, str(path), "--memory", "1GiB", "--max-model-len", "4096")
    assert code == 0 and err == ""


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0.0123, "12.30 ms"),
        (0.999, "999.00 ms"),
        (1.0, "1.0 s"),
        (119.9, "119.9 s"),
        (120.0, "2.0 min"),
        (7200.0, "2.0 h"),
        (1e9, "11574.1 days"),
    ],
)
def test_durations_read_in_their_unit(seconds: float, text: str) -> None:
    """A simulated link of 1 B/s printed 61603840000.02 ms per request (found by a review)."""
    assert duration(seconds) == text


def test_shared_state_chunks_plans_what_a_tiered_cache_runs_on(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Nemotron-H-8B at 16 GiB: one state slot per chunk by default (pages padded 1.15%),
    # 8 slots a chunk with --shared-state-chunks (tests/test_plan_arena.py), in both outputs.
    base = ["plan", "Nemotron-H-8B", "--memory", "16GiB", "--max-model-len", "131072", "--json"]
    chunks = {}
    for flag in ([], ["--shared-state-chunks"]):
        assert main([*base, *flag]) == 0
        data = json.loads(capsys.readouterr().out)
        chunks[bool(flag)] = data["layout"]["arena"]["chunk_bytes"]
        assert data["options"]["one_slot_chunks"] is not bool(flag)
        assert main([*base, *flag, "--strategy", "all"]) == 0
        every = json.loads(capsys.readouterr().out)
        arena = every["plans"]["arena"]["layout"]["arena"]
        assert arena["chunk_bytes"] == chunks[bool(flag)]
    assert chunks == {False: 25952256, True: 205258752}
