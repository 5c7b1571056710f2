"""Every command answers bad input with one line on stderr and exit 2, before long work.

The table holds, per command, the arguments and a phrase the one-line message must contain.
Files the rows need (a binary trace, a gzip of garbage, a directory, ...) are made in a
temporary directory; ``{tmp}`` in an argument is replaced by its path.  ``hybridkv run``'s
own table lives in ``tests/test_engine_cli.py`` (it needs the engine extra).
"""

from __future__ import annotations

import gzip
import time
from pathlib import Path

import pytest

from hybridkv.cli.main import main

#: (command line, phrase of the error message)
BAD_INPUT: list[tuple[list[str], str]] = [
    # models
    (["models", "no-such-model"], "model: 'no-such-model' is neither a catalog name"),
    (["models", "gpt-oss-20b", "--tp", "0"], "--tp: must be a positive integer, got 0"),
    (["models", "gpt-oss-20b", "--kv-cache-dtype", "int4"], "unknown dtype 'int4'"),
    # the catalog listing noted it on every row and exited 0 (found by review)
    (["models", "--kv-cache-dtype", "int4"], "--kv-cache-dtype: unknown dtype 'int4'; valid: auto"),
    (["models", "{tmp}/empty_dir"], "empty_dir' is a directory without a config.json; give"),
    (["models", "{tmp}/missing.json"], "missing.json' does not exist; give a path to a config"),
    (["plan", "./no/such/dir"], "'./no/such/dir' does not exist; give a path to a config.json"),
    (["models", "{tmp}/binary.bin"], "binary.bin"),
    (["models", "gpt-oss-20b", "--model", "gemma-3-1b"], "name the model once"),
    # plan
    (["plan", "--memory", "12XB"], "--memory: cannot parse '12XB' as a size"),
    # a zero that is no size is not "no tier" (it read as none before: review)
    (["simulate", "--host-memory", "0foo"], "--host-memory: cannot parse '0foo' as a size"),
    (["plan", "--memory", "0"], "--memory: size must be positive"),
    (["plan", "--max-model-len", "0"], "--max-model-len: must be a positive integer, got 0"),
    (["plan", "--block-size", "-4"], "--block-size: must be a positive integer, got -4"),
    (["plan", "--kernel-block-size", "0"], "--kernel-block-size: must be a positive integer"),
    (["plan", "--tp", "0"], "--tp: must be a positive integer, got 0"),
    (["plan", "--strategy", "pools", "--pool-ratios", "a,b"], "cannot parse --pool-ratios"),
    (["plan", "--strategy", "pools", "--pool-ratios", "1,2,3"], "--pool-ratios: got 3 ratios"),
    (["plan", "--chunk-alignment=-1MiB"], "--chunk-alignment: size must be positive"),
    (["plan", "--memory=-1GiB"], "--memory: size must be positive, got '-1GiB'"),
    (  # accepted before and shown rounded (100000000000000000000 TiB; found by review)
        ["simulate", "--host-memory", "99999999999999999999TiB"],
        "--host-memory: '99999999999999999999TiB' is more than any machine addresses; give at "
        "most 16777216 TiB (2^64 B)",
    ),
    (["plan", "--memory", "1.5"], "--memory: '1.5' is not a whole number of bytes"),
    (
        ["plan", "--strategy", "uniform", "--chunk-alignment", "1MiB"],
        "--chunk-alignment 1MiB: only applies with --strategy arena (or all)",
    ),
    (["plan", "--chunk-alignment", "0"], "--chunk-alignment: size must be positive"),
    (["plan", "--state-split", "0"], "--state-split: must be a positive integer, got 0"),
    (["simulate", "--state-split", "-2"], "--state-split: must be a positive integer, got -2"),
    (["plan", "--state-split", "65"], "--state-split: 65 is larger than the maximum 64"),
    (["plan", "--memory", "1MiB"], "holds no request of max_model_len"),
    (
        ["plan", "--block-size", "100000"],
        "reserved null chunk (its cache data alone is 3299082240 B), 1.16 GiB more than given; "
        "give at least that much "
        "memory, a shorter max_model_len, a smaller block_size or a smaller chunk_alignment",
    ),
    (
        ["plan", "--chunk-alignment", "3GiB"],
        "one request needs 9 GiB (9663676416 B) including the reserved null chunk (its cache "
        "data alone is 3299082240 B), 1 GiB more than given",
    ),
    (
        ["plan", "Llama-3.3-70B", "--memory", "40GiB"],
        "one request needs 40 GiB (42954915840 B) including the reserved null chunk (its cache "
        "data alone is 42949672960 B), 5 MiB more than given",
    ),
    (["simulate", "--report", ""], "--report: give a directory to write the report to"),
    (["simulate", "--trace", ""], "trace: got an empty name; give a Mooncake-format trace"),
    (["models", ""], "--model: got an empty name; give a catalog name"),
    (["plan", "--model", " "], "--model: got an empty name"),
    (
        ["plan", "--kv-cache-dtype", "int4"],
        "unknown dtype 'int4'; valid: auto (the model's), bf16, bfloat16",
    ),
    (
        ["simulate", "--strategy", "arena", "--pool-ratios", "0.5,0.5"],
        "--pool-ratios 0.5,0.5: only the pools strategy takes ratios",
    ),
    (
        ["simulate", "--tier-admission", "all"],
        "--tier-admission all: only applies with --host-memory SIZE (not 0)",
    ),
    (  # found by a review: a disk tier alone takes every checkpoint, so it changed nothing
        ["simulate", "--disk-memory", "1GiB", "--tier-admission", "all"],
        "--tier-admission all: only applies with --host-memory SIZE (not 0)",
    ),
    (
        ["simulate", "--protect", "oracle"],
        "--protect oracle: only applies with --host-memory SIZE (not 0) or --disk-memory",
    ),
    (
        ["simulate", "--strategy", "arena", "--host-memory", "1GiB,1024MiB"],
        "--host-memory 1GiB,1024MiB: a sweep runs each size once; a size is repeated",
    ),
    (  # 0 is no host tier: nothing to protect (it used to run, protecting nothing)
        ["simulate", "--protect", "oracle", "--host-memory", "0"],
        "--protect oracle: only applies with --host-memory SIZE (not 0) or --disk-memory",
    ),
    (  # the tiers are what --disaggregate refuses, not the strategy given
        ["simulate", "--disaggregate", "--strategy", "arena", "--host-memory", "0,1GiB"],
        "--disaggregate: not with --host-memory / --disk-memory",
    ),
    (
        ["simulate", "--disaggregate", "--strategy", "all"],
        "--disaggregate: one strategy at a time, not --strategy all (leave it out for arena)",
    ),
    (  # the prefill budget is named, not --memory
        ["simulate", "--disaggregate", "--strategy", "arena", "--prefill-memory", "1B"],
        "--prefill-memory: 1 B holds no request of max_model_len",
    ),
    (
        ["simulate", "--protect", "oracle", "--host-memory", "1GiB", "--disaggregate"],
        "--protect oracle: not with --disaggregate",
    ),
    (
        ["simulate", "--disaggregate", "--strategy", "arena", "--report", "{tmp}/rep"],
        "rep: not with --disaggregate (it prints one summary)",
    ),
    (
        ["plan", "--strategy", "uniform", "--state-split", "4"],
        "--state-split 4: only applies with --strategy arena, pools or all",
    ),
    (
        ["simulate", "--strategy", "uniform", "--state-split", "4"],
        "--state-split 4: only applies with --strategy arena, pools or all",
    ),
    (["models", "{tmp}/model_type_5.json"], "config.model_type: must be a non-empty string, got 5"),
    (
        ["simulate", "--protect-share", "0.5"],
        "--protect-share 0.5: only applies with --protect oracle",
    ),
    (
        ["simulate", "--protect", "oracle", "--host-memory", "1GiB", "--protect-share", "0"],
        "--protect-share 0: the share of a tier protected sessions may fill must be a number "
        "in (0, 1]",
    ),
    (  # not rounded to the 1 it refuses (found by review)
        [
            "simulate",
            "--protect",
            "oracle",
            "--host-memory",
            "1GiB",
            "--protect-share",
            "1.0000001",
        ],
        "--protect-share 1.0000001: the share of a tier",
    ),
    (["plan", "--kv-cache-dtype", "int4"], "unknown dtype 'int4'"),
    (["plan", "no-such-model"], "'no-such-model' is neither a catalog name"),
    # simulate: every check before the first strategy runs
    (["simulate", "--memory", "12XB"], "--memory: cannot parse '12XB' as a size"),
    (
        ["simulate", "--memory", "1MiB"],
        "--memory 1 MiB: no strategy holds a request of --max-model-len 131072 in it; one "
        "request needs arena 3.08 GiB (3312451584 B), uniform 3.12 GiB (3347841024 B), pools "
        "4.72 GiB (5065408512 B); give at least that",
    ),
    (["simulate", "--strategy", "pools", "--memory", "1MiB"], "holds no request"),
    (["simulate", "--requests", "0"], "--requests: must be a positive integer, got 0"),
    (  # found by a review: 10^20 synthetic requests ran the host out of memory
        ["simulate", "--requests", "99999999999999999999"],
        "--requests: must be at most 1000000 (requests one run generates or reads), got "
        "99999999999999999999",
    ),
    (["simulate", "--seed", "-3"], "--seed: must be an integer in [0, 9223372036854775807]"),
    (
        ["simulate", "--eviction", "2q", "--strategy", "arena"],
        "--eviction: '2q' runs on free-list pools (strategies uniform and pools, and arenas",
    ),
    (  # found by a review: accepted and ignored
        ["simulate", "gpt-oss-20b", "--checkpoint-admission", "all"],
        "--checkpoint-admission all: only applies to models with recurrent-state layers; "
        "gpt-oss-20b has none",
    ),
    (
        ["simulate", "gemma-3-27b", "--checkpoint-when-full", "skip"],
        "--checkpoint-when-full skip: only applies to models with recurrent-state layers",
    ),
    (
        ["simulate", "gpt-oss-20b", "--checkpoint-life", "alone"],
        "--checkpoint-life alone: only applies to models with recurrent-state layers",
    ),
    (
        ["simulate", "gpt-oss-20b", "--state-block-size", "64"],
        "--state-block-size 64: only applies to models with recurrent-state layers",
    ),
    (
        ["plan", "gpt-oss-20b", "--state-block-size", "64"],
        "--state-block-size 64: only applies to models with recurrent-state layers",
    ),
    (  # found by a review: the window options were accepted and ignored without windows
        ["simulate", "DeepSeek-V3", "--window-retention", "all"],
        "--window-retention all: only applies to models with sliding-window or chunked-local "
        "layers; DeepSeek-V3 has none",
    ),
    (
        ["simulate", "Qwen3-Next-80B-A3B", "--window-chances", "2"],
        "--window-chances 2: only applies to models with sliding-window or chunked-local layers",
    ),
    (  # a zero in any unit is "no host tier", so these are the same size twice
        ["simulate", "--host-memory", "0,0GiB", "--strategy", "uniform"],
        "--host-memory 0,0GiB: a sweep runs each size once; a size is repeated",
    ),
    (  # found by a review: a trace's requests do not depend on the seed
        ["simulate", "--trace", "{tmp}/trace.jsonl", "--seed", "5"],
        "--seed 5: only applies to a synthetic workload (--trace synthetic:NAME); the requests "
        "of --trace",
    ),
    (  # compaction frees arena chunks; uniform and pools have none
        ["simulate", "gpt-oss-20b", "--compaction", "off", "--strategy", "uniform"],
        "--compaction off: only applies with --strategy arena (or all), which compacts chunks; "
        "--strategy uniform has none",
    ),
    (
        ["run", "--compaction", "off", "--strategy", "pools"],
        "--compaction off: only applies with --strategy arena, which compacts chunks; "
        "--strategy pools has none",
    ),
    (
        ["plan", "gpt-oss-20b", "--shared-state-chunks"],
        "--shared-state-chunks: only applies to models with recurrent-state layers; "
        "gpt-oss-20b has none",
    ),
    (
        ["plan", "Jamba-v0.1", "--shared-state-chunks", "--strategy", "pools"],
        "--shared-state-chunks: only applies with --strategy arena (or all), not --strategy pools",
    ),
    (
        ["plan", "--chunk-alignment", "100GiB"],
        "--chunk-alignment 100GiB: chunks of 100 GiB are larger than the whole --memory budget "
        "of 8 GiB; give at most that (default: 64 KiB)",
    ),
    (  # found by a review: a mistyped ratio count under --strategy all exited 0
        ["plan", "--strategy", "all", "--pool-ratios", "1,1,1"],
        "--pool-ratios: got 3 ratios [1.0, 1.0, 1.0] for 2 groups (group 0: state, group 1: "
        "full_attention); give one positive ratio per group",
    ),
    (
        ["simulate", "--strategy", "all", "--pool-ratios", "1,2,3"],
        "--pool-ratios: got 3 ratios [1.0, 2.0, 3.0] for 2 groups",
    ),
    (  # found by a review: 10^11 layers spun the planner until it ran out of memory
        ["plan", "{tmp}/layers/config.json"],
        "llama config: field 'num_hidden_layers' must be an integer in [1, 65536], got "
        "100000000000",
    ),
    (["simulate", "--token-budget", "0"], "--token-budget: must be a positive integer"),
    (["simulate", "--max-num-seqs", "-1"], "--max-num-seqs: must be a positive integer"),
    (["simulate", "--state-block-size", "0"], "--state-block-size: must be a positive"),
    (["simulate", "--tp", "0"], "--tp: must be a positive integer, got 0"),
    (["simulate", "--second-chance", "256"], "--second-chance: must be an integer in [0, 255]"),
    (["simulate", "--second-chance", "-1"], "--second-chance: must be an integer in [0, 255]"),
    (["simulate", "--window-chances", "300"], "--window-chances: must be an integer in [0, 255]"),
    (["simulate", "--kv-cache-dtype", "int4"], "unknown dtype 'int4'"),
    (["simulate", "--model", "no-such-model"], "'no-such-model' is neither a catalog name"),
    (["simulate", "--pool-ratios", "x"], "cannot parse --pool-ratios"),
    (["simulate", "--strategy", "pools", "--pool-ratios", "1,2,3"], "--pool-ratios: got 3"),
    (["simulate", "--trace", "synthetic:nope"], "unknown synthetic workload 'nope'"),
    (["simulate", "--trace", "{tmp}/missing.jsonl"], "missing.jsonl"),
    (["simulate", "--trace", "{tmp}/binary.bin"], "binary.bin"),
    (["simulate", "--trace", "{tmp}/garbage.jsonl.gz"], "garbage.jsonl.gz"),
    (["simulate", "--trace", "{tmp}/empty_dir"], "empty_dir"),
    (["simulate", "--trace", "{tmp}/empty.jsonl"], "empty.jsonl"),
    (["simulate", "--trace", "{tmp}/notjson.jsonl"], "notjson.jsonl"),
    (["simulate", "--report", "{tmp}/a_file.txt"], "--report: '"),
    (["simulate", "--prefill-memory", "1GiB"], "--prefill-memory 1GiB: only applies with --disag"),
    (["simulate", "--link-bandwidth", "1GB"], "--link-bandwidth 1GB: only applies with --disag"),
    (
        ["simulate", "--strategy", "arena", "--disk-memory", "1"],
        "--disk-memory: a disk tier of 1 B holds no block; the smallest block here is",
    ),
    (
        ["simulate", "--host-memory", "1kB", "--disk-memory", "1TiB"],
        "--host-memory: a host tier of 1000 B holds no block",
    ),
    (["simulate", "--report", "{tmp}/a_file.txt/sub"], "--report: cannot create directory"),
    (
        ["simulate", "--write-through", "host"],
        "--write-through host: needs a host tier in every run (--host-memory SIZE, not 0); got "
        "none",
    ),
    (
        ["simulate", "--write-through", "host", "--host-memory", "0,1GiB", "--strategy", "arena"],
        "got --host-memory 0,1GiB",
    ),
    (
        ["simulate", "--write-through", "disk", "--host-memory", "1GiB"],
        "--write-through disk: needs a disk tier in every run (--disk-memory SIZE",
    ),
    (
        ["simulate", "--write-through", "host", "--host-memory", "1GiB", "--disaggregate"],
        "--write-through host: not with --disaggregate",
    ),
    (
        ["run", "--write-through", "host", "--host-memory", "1MiB", "--disaggregate"],
        "--disaggregate: not with --host-memory, --write-through",
    ),
    (  # found by a review: accepted and ignored (its processes take none of them)
        ["run", "--disaggregate", "--waves", "1", "--token-budget", "32", "--compaction", "off"],
        "--disaggregate: not with --waves, --token-budget, --compaction (the prefill and decode "
        "processes run every request with the engine's default scheduler, on one thread each)",
    ),
    (
        ["run", "--write-through", "host"],
        "--write-through host: needs a host tier (--host-memory SIZE)",
    ),
    (
        ["run", "--write-through", "disk", "--host-memory", "1MiB"],
        "--write-through disk: needs a disk tier (--disk-cache DIR --disk-memory SIZE)",
    ),
]

#: Arguments argparse itself refuses (one error line, exit 2), and the phrase it must hold.
ARGPARSE_ERRORS: list[tuple[list[str], str]] = [
    (["plan", "--strategy", "bogus"], "invalid choice: 'bogus'"),
    (["simulate", "--accelerator", "tpu"], "invalid choice: 'tpu'"),
    (["simulate", "--strategy", "bogus"], "invalid choice: 'bogus'"),
    (["simulate", "--window-retention", "some"], "invalid choice: 'some'"),
    (["simulate", "--publish", "later"], "invalid choice: 'later'"),
    (["simulate", "--admission", "lazy"], "invalid choice: 'lazy'"),
    (["plan", "--state-split", "some"], "'some' is not an integer or 'auto'"),
    (["simulate", "--write-through", "gpu"], "invalid choice: 'gpu'"),
    (["run", "--write-through", "gpu"], "invalid choice: 'gpu'"),
    (["run", "--admission", "lazy"], "invalid choice: 'lazy'"),
    (["simulate", "--requests", "ten"], "invalid int value: 'ten' (give a whole number)"),
    (["simulate", "--second-chance", "two"], "invalid int value: 'two'"),
    (["models", "--tp", "two"], "invalid int value: 'two'"),
    (["plan", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["plan", "one", "two"], "unrecognized arguments: two"),
    (
        ["plan", "--memory", "-1GiB"],
        "--memory: expected one argument ('-1GiB' reads as an option; write --memory=-1GiB)",
    ),
    (["plan", "--memory"], "argument --memory: expected one argument (see hybridkv plan --help)"),
]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("bad_input")
    (tmp / "empty_dir").mkdir()
    (tmp / "binary.bin").write_bytes(bytes(range(256)) * 8)
    (tmp / "garbage.jsonl.gz").write_bytes(gzip.compress(bytes(range(256)) * 8))
    (tmp / "empty.jsonl").write_text("")
    (tmp / "notjson.jsonl").write_text("this is not json\n")
    (tmp / "trace.jsonl").write_text(
        '{"timestamp": 0, "input_length": 600, "output_length": 4, "hash_ids": [0, 1]}\n'
    )
    (tmp / "a_file.txt").write_text("not a directory\n")
    (tmp / "model_type_5.json").write_text('{"model_type": 5}')
    (tmp / "layers").mkdir()
    (tmp / "layers" / "config.json").write_text(
        '{"model_type": "llama", "num_hidden_layers": 100000000000, "hidden_size": 64, '
        '"num_attention_heads": 4}'
    )
    return tmp


def _run(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def _id(value: object) -> str:
    return " ".join(value) if isinstance(value, list) else "-"


@pytest.mark.parametrize(("argv", "phrase"), BAD_INPUT, ids=_id)
def test_bad_input_is_one_line_and_exit_2(
    argv: list[str], phrase: str, files: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = [a.replace("{tmp}", str(files)) for a in argv]
    t0 = time.perf_counter()
    code, out, err = _run(capsys, args)
    elapsed = time.perf_counter() - t0
    assert code == 2, (out, err)
    assert "Traceback" not in out + err
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"hybridkv {argv[0]}: error: "), lines[0]
    assert phrase in lines[0]
    # Checked before any simulation: a few seconds at most even on a loaded machine.
    assert elapsed < 20, f"{elapsed:.1f}s before the error"


@pytest.mark.parametrize(("argv", "phrase"), ARGPARSE_ERRORS, ids=_id)
def test_argparse_errors_are_one_line_and_exit_2(
    argv: list[str], phrase: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = _run(capsys, argv)
    assert code == 2
    assert "Traceback" not in out + err
    prog = f"hybridkv {argv[0]}"
    assert err.splitlines() == [f"{prog}: error: {err.split(': error: ', 1)[1].rstrip()}"], err
    assert phrase in err
    assert err.rstrip().endswith(f"(see {prog} --help)")


def test_an_unknown_command_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(capsys, ["bogus"])
    assert code == 2
    assert err.splitlines() == [
        "hybridkv: error: argument COMMAND: invalid choice: 'bogus' (choose from 'plan', "
        "'models', 'simulate', 'run') (see hybridkv --help)"
    ]


def test_every_option_has_help_and_its_default() -> None:
    import argparse

    from hybridkv.cli.common import HelpFormatter
    from hybridkv.cli.main import SUBCOMMANDS, build_parser

    for name in SUBCOMMANDS:
        parser = build_parser([name])
        subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        formatter = HelpFormatter(prog=name)
        for action in subparsers.choices[name]._actions:
            if isinstance(action, argparse._HelpAction | argparse._VersionAction):
                continue
            flag = action.option_strings[0] if action.option_strings else action.metavar
            assert action.help, f"{name} {flag}: no help"
            if action.nargs == 0:
                continue  # an on/off flag
            shown = formatter._get_help_string(action) or ""
            assert "default" in shown, f"{name} {flag}: the help does not say its default"


def test_simulate_warns_above_the_model_limit_unless_quiet(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = ["simulate", "LFM2-1.2B", "--requests", "2", "--strategy", "arena"]
    code, out, err = _run(capsys, [*args, "--max-model-len", "200000"])
    assert code == 0 and out
    assert err.splitlines()[0] == (
        "hybridkv simulate: warning: --max-model-len 200000 is above LFM2-1.2B's own limit of "
        "128000 positions (max_position_embeddings)"
    )
    code, out, err = _run(capsys, [*args, "--max-model-len", "200000", "--quiet"])
    assert (code, err) == (0, "")


def test_running_out_of_host_memory_is_one_line_and_exit_1(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run bigger than the host (a budget of exabytes simulated block by block) ends in one
    line, not a traceback through the allocator."""
    import hybridkv.cli.main as cli_main

    class Huge:
        @staticmethod
        def add_arguments(parser: object) -> None:
            pass

        @staticmethod
        def run(args: object) -> int:
            raise MemoryError

    monkeypatch.setattr(cli_main, "_load", lambda name: Huge)
    code, out, err = _run(capsys, ["plan"])
    assert (code, out) == (1, "")
    assert err == (
        "hybridkv plan: error: out of host memory; give smaller sizes or fewer requests\n"
    )
