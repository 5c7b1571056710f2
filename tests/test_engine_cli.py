"""``hybridkv run``: outputs, statistics, ``--verify``, prompt files, the model list, and
one-line errors for bad input, every one found before the model is loaded."""

from __future__ import annotations

import argparse
import gzip
import json
import logging
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from hybridkv.cli import run_cmd, run_prompts
from hybridkv.cli.main import build_parser, main
from hybridkv.engine import llm_engine
from hybridkv.engine import models as engine_models
from hybridkv.units import parse_bytes

SMALL = ["--num-requests", "4", "--max-tokens", "4", "--quiet"]


@pytest.fixture(autouse=True, scope="module")
def _threads() -> Iterator[None]:
    before = torch.get_num_threads()  # `run` sets 1 thread for tiny models
    yield
    torch.set_num_threads(before)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["run", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_defaults_verify_against_transformers(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, *SMALL, "--verify")
    assert code == 0, out + err
    lines = out.splitlines()
    assert lines[0].startswith("model lfm3 (lfm3): arena layout, 64 MiB budget")
    assert [line.split(":")[0] for line in lines[1:4]] == [
        "  group 0 state",
        "  group 1 sliding_window",
        "  group 2 full_attention",
    ]
    # two waves of two: the second wave takes the 32-token shared prefix from the cache
    outputs = [line for line in lines if line.startswith("r")]
    assert [o.split(" (")[0] for o in outputs] == ["r0", "r1", "r2", "r3"]
    assert [o.split(", ")[1] for o in outputs] == ["0 cached"] * 2 + ["32 cached"] * 2
    assert all(len(o.split("): ")[1].split()) == 4 for o in outputs)
    assert "prefix cache: 64 of 162 admitted prompt tokens served from the cache (39.5%)" in out
    # r1 is admitted in the step computing r0's first chunk (which stops at 16, one alignment
    # unit before the last aligned boundary): its full-attention group alone hits those 16
    # tokens at once (published at allocation); the state checkpoint only exists once computed
    assert "0:state 39.5%, 1:sliding_window 39.5%, 2:full_attention 49.4%" in out
    assert "peak blocks per group: 0:state " in out and "preemptions: 0" in out
    assert "window blocks released: 1:sliding_window " in out
    assert lines[-1].startswith("verify: all 4 requests (16 tokens) identical to transformers'")
    assert err == ""


def test_greedy_admission_verifies_too(capsys: pytest.CaptureFixture[str]) -> None:
    # The engine takes the scheduler's admission policy from --admission: greedy (vLLM's
    # rule) gives the same tokens; the flag reaches the SchedulerConfig.
    code, out, err = run(capsys, *SMALL, "--admission", "greedy", "--verify")
    assert code == 0, out + err
    assert out.splitlines()[-1].startswith("verify: all 4 requests (16 tokens) identical")
    from hybridkv.cli.main import build_parser
    from hybridkv.cli.run_config import configs

    for extra, policy in ((["--admission", "greedy"], "greedy"), ([], "reserve")):
        argv = ["run", *SMALL, *extra]
        assert configs(build_parser(argv).parse_args(argv))[1].admission == policy


def test_verify_mismatch_exits_1(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    real = engine_models.load_model

    def other_weights(source: Any, **kw: Any) -> Any:
        return real(source, seed=kw.get("seed", 0) + 1)

    # only the reference is loaded through the module attribute: the engine keeps seed 0
    monkeypatch.setattr(engine_models, "load_model", other_weights)
    code, out, _ = run(capsys, *SMALL, "--num-requests", "2", "--verify")
    assert code == 1
    assert "verify: 2 of 2 requests DIFFER from transformers' generate" in out
    assert "  r0: first difference at output token 0: engine " in out


def test_one_request_runs_in_one_wave(capsys: pytest.CaptureFixture[str]) -> None:
    """``--waves`` defaults to 2, and to 1 for a single request (not an error)."""
    code, out, _ = run(capsys, *SMALL, "--num-requests", "1", "--verify")
    assert code == 0
    assert "verify: all 1 requests (4 tokens) identical to transformers' generate" in out


def test_prompt_file_of_token_ids(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("1 2 3 4 5 6 7 8\n\n9 10 11\n", encoding="utf-8")
    code, out, _ = run(
        capsys,
        "--model",
        "llama",
        "--prompts",
        str(prompts),
        "--num-requests",
        "3",
        "--max-tokens",
        "3",
        "--waves",
        "1",
        "--quiet",
        "--verify",
    )
    assert code == 0, out
    outputs = [line for line in out.splitlines() if line.startswith("r")]
    # blank lines are skipped; the lines are cycled to three requests
    assert [o.split(", ")[0] for o in outputs] == [
        "r0 (8 prompt tokens",
        "r1 (3 prompt tokens",
        "r2 (8 prompt tokens",
    ]
    assert outputs[0].split("): ")[1] == outputs[2].split("): ")[1]
    assert "verify: all 3 requests (9 tokens) identical" in out


def _tiny_checkpoint(path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    model = engine_models.load_model("llama")
    model.save_pretrained(path)
    vocab = {f"w{i}": i for i in range(256)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="w0").save_pretrained(path)


def test_checkpoint_with_tokenizer_reads_text(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    ckpt = tmp_path / "ckpt"
    _tiny_checkpoint(ckpt)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("w5 w7 w9 w11 w13\nw2 w4\n", encoding="utf-8")
    argv = ["--model", str(ckpt), "--prompts", str(prompts), "--max-tokens", "3", "--quiet"]
    code, out, _ = run(capsys, *argv, "--verify")
    assert code == 0, out
    outputs = [line for line in out.splitlines() if line.startswith("r")]
    assert [o.split(", ")[0] for o in outputs] == ["r0 (5 prompt tokens", "r1 (2 prompt tokens"]
    text = outputs[0].split("): ")[1]
    words = json.loads(text.replace("'", '"')).split()
    assert len(words) == 3 and all(w.startswith("w") for w in words)
    assert "verify: all 2 requests (6 tokens) identical" in out


def _bad_inputs(tmp: Path) -> None:
    """The files the bad-input rows name (``{tmp}`` in their arguments)."""
    (tmp / "empty.txt").write_text("\n   \n", encoding="utf-8")
    (tmp / "words.txt").write_text("1 2 three\n", encoding="utf-8")
    (tmp / "digits.txt").write_text("1 2\n3 \u00b2 4\n", encoding="utf-8")  # isdigit, not int
    (tmp / "bigid.txt").write_text("1 " + "9" * 5000 + "\n", encoding="utf-8")
    (tmp / "vocab.txt").write_text("1 2 999\n", encoding="utf-8")
    (tmp / "long.txt").write_text("1 " * 600 + "\n", encoding="utf-8")
    (tmp / "binary.bin").write_bytes(bytes(range(256)))
    (tmp / "latin1.txt").write_bytes("caf\u00e9 1 2\n".encode("latin-1"))
    (tmp / "binary.gz").write_bytes(gzip.compress(bytes(range(256))))
    (tmp / "broken.gz").write_bytes(gzip.compress(b"1 2 3\n")[:12])
    (tmp / "no-config").mkdir()
    (tmp / "bert").mkdir()
    (tmp / "bert" / "config.json").write_text('{"model_type": "bert"}', encoding="utf-8")
    (tmp / "no-weights").mkdir()
    (tmp / "no-weights" / "config.json").write_text(
        '{"model_type": "llama", "num_hidden_layers": 1, "hidden_size": 8, '
        '"num_attention_heads": 2}',
        encoding="utf-8",
    )


_NO_CUDA = not torch.cuda.is_available()
_CUDA_COUNT = 0 if _NO_CUDA else torch.cuda.device_count()
_NO_CUDA_MESSAGE = "--device: 'cuda' asked for CUDA, but this torch ("
_TINY = "llama, gemma2, gemma3_text, gpt_oss, qwen3_next, granitemoehybrid, nemotron_h,"
_EXPECTED = "give a text file, one prompt per line (plain or gzip-compressed)"

#: (row id, arguments, a key phrase of the one error line).  Every error must come before the
#: model is loaded (the test makes loading fail loudly).
BAD_INPUTS: list[tuple[str, tuple[str, ...], str]] = [
    ("device-tpu", ("--device", "tpu"), "--device: cannot parse 'tpu'; valid: cpu, cuda or cuda:N"),
    ("device-meta", ("--device", "meta"), "--device: 'meta' is a meta device"),
    ("device-cpu-5", ("--device", "cpu:5"), "--device: 'cpu:5': the CPU is one device (cpu or"),
    ("device-cuda", ("--device", "cuda"), _NO_CUDA_MESSAGE),
    (
        "device-cuda-99",
        ("--device", "cuda:99"),
        "asked for CUDA, but this torch ("
        if _NO_CUDA
        else f"names CUDA device 99, but this machine has {_CUDA_COUNT} (cuda:0..",
    ),
    (
        "prompts-binary",
        ("--prompts", "{tmp}/binary.bin"),
        "binary.bin' is not UTF-8 text (a NUL byte at byte 0: binary, or UTF-16); " + _EXPECTED,
    ),
    (
        "prompts-latin1",
        ("--prompts", "{tmp}/latin1.txt"),
        "latin1.txt' is not UTF-8 text (byte 3); " + _EXPECTED,
    ),
    (
        "prompts-gzip-binary",
        ("--prompts", "{tmp}/binary.gz"),
        "binary.gz' (gzip, decompressed) is not UTF-8 text (a NUL byte at byte 0",
    ),
    ("prompts-gzip-broken", ("--prompts", "{tmp}/broken.gz"), "broken.gz' is a broken gzip file"),
    ("prompts-directory", ("--prompts", "{tmp}"), "' is a directory; " + _EXPECTED),
    (
        "prompts-missing",
        ("--prompts", "{tmp}/missing.txt"),
        "missing.txt' does not exist; " + _EXPECTED,
    ),
    ("prompts-empty", ("--prompts", "{tmp}/empty.txt"), "empty.txt' holds no prompt; " + _EXPECTED),
    ("prompts-words", ("--prompts", "{tmp}/words.txt"), "words.txt:1: 'three' is not a token id"),
    ("prompts-digit-sign", ("--prompts", "{tmp}/digits.txt"), "digits.txt:2: '\u00b2' is not a"),
    ("prompts-long-id", ("--prompts", "{tmp}/bigid.txt"), "bigid.txt:1: '" + "9" * 37 + "...' is"),
    (
        "prompts-vocab",
        ("--prompts", "{tmp}/vocab.txt", "--model", "llama"),
        "vocab.txt:1: token id 999 is outside the vocabulary [0, 256)",
    ),
    (
        "prompt-longer-than-model",
        ("--prompts", "{tmp}/long.txt"),
        "long.txt:1: the prompt has 600 tokens, too long for max_model_len 512 (the model's "
        "limit, at most 2048)",
    ),
    (
        "prompt-longer-than-max-model-len",
        ("--max-model-len", "16"),
        "--shared-prefix 32: the generated prompts have up to 45 tokens (the shared prefix + "
        "their own), too long for --max-model-len 16",
    ),
    (
        "num-requests-0",
        ("--num-requests", "0"),
        "--num-requests: must be a positive integer, got 0",
    ),
    (
        "max-tokens-negative",
        ("--max-tokens", "-1"),
        "--max-tokens: must be a positive integer, got -1",
    ),
    ("waves-0", ("--waves", "0"), "--waves: must be a positive integer, got 0"),
    (
        "waves-over-requests",
        ("--waves", "9", "--num-requests", "8"),
        "--waves 9: more waves than the 8 requests; give at most 8",
    ),
    ("shared-prefix-negative", ("--shared-prefix", "-1"), "--shared-prefix: must be >= 0, got -1"),
    ("block-size-0", ("--block-size", "0"), "--block-size: must be a positive integer, got 0"),
    (
        "kernel-block-size",
        ("--kernel-block-size", "5"),
        "--kernel-block-size: 5 does not divide block_size 16",
    ),
    ("memory-unit", ("--memory", "12XB"), "--memory: cannot parse '12XB' as a size"),
    (
        "speculate-negative",
        ("--speculate", "-1"),
        "--speculate: must be an integer in [0, 16] (0: off), got -1",
    ),
    ("speculate-17", ("--speculate", "17"), "--speculate: must be an integer in [0, 16]"),
    (  # torch's seeds are 64-bit signed: found by a review as an overflow traceback
        "seed-too-large",
        ("--seed", str(1 << 63)),
        f"--seed: must be an integer in [0, {(1 << 63) - 1}], got {1 << 63}",
    ),
    ("seed-negative", ("--seed", "-1"), "--seed: must be an integer in [0, "),
    (  # found by a review: named SlidingWindowSpec.sink_tokens, after loading the model
        "sinks-too-many",
        ("--attention-sinks", "99999999999"),
        "--attention-sinks: must be an integer in [0, 16777216], got 99999999999",
    ),
    (  # a typo of 10^11 requests silently filled the host's memory before any output
        "num-requests-too-many",
        ("--num-requests", "99999999999"),
        "--num-requests: must be at most 1000000 (requests one run generates), got 99999999999",
    ),
    (
        "threads-too-many",
        ("--threads", "99999999"),
        "--threads: must be at most 1024 (torch's CPU threads), got 99999999",
    ),
    (
        "prefill-tp-alone",
        ("--prefill-tp", "2"),
        "--prefill-tp 2: only applies with --disaggregate",
    ),
    ("decode-tp-alone", ("--decode-tp", "2"), "--decode-tp 2: only applies with --disaggregate"),
    (
        "max-model-len-over-the-model",
        ("--model", "llama", "--max-model-len", "4096"),
        "--max-model-len 4096: above llama's own limit of 512 positions (max_position_embeddings)",
    ),
    (
        "sinks-without-windows",
        ("--model", "llama", "--attention-sinks", "2"),
        "--attention-sinks 2: sink tokens need sliding-window layers; llama has no sliding_window",
    ),
    (
        "shared-prefix-over-the-model",
        ("--shared-prefix", "5000"),
        "(the model's limit, at most 2048); lower --shared-prefix to at most 498",
    ),
    ("memory-0", ("--memory", "0"), "--memory: size must be positive"),
    ("memory-too-small", ("--memory", "4KiB"), "--memory: 4 KiB (4096 B) holds no request"),
    (
        "num-blocks-too-few",
        ("--num-blocks", "1"),
        "--num-blocks: 1 blocks of every group hold no request of max_model_len 512 with the "
        "arena strategy; give at least 15",
    ),
    (
        "num-blocks-too-few-pools",  # the split is the count's, not ratios the user gave
        ("--model", "qwen3_next", "--strategy", "pools", "--num-blocks", "1"),
        "--num-blocks: 1 blocks of every group hold no request of max_model_len 512 with the "
        "pools strategy (each group's pool gets 2 blocks, one its null block): group 0 (state) "
        "gets 1 usable blocks of 18 KiB and needs 2; group 1 (full_attention) gets 1 usable "
        "blocks of 4 KiB and needs 32; give at least 32",
    ),
    (  # found by review: it listed and exited 0, ignoring even invalid options
        "list-models-with-others",
        ("--list-models", "--max-tokens", "0"),
        "--list-models: lists the models and exits; not with --max-tokens",
    ),
    (  # found by review: every token a sink, nothing ever left the window
        "sinks-cover-every-position",
        ("--model", "gemma2", "--attention-sinks", "600"),
        "--attention-sinks 600: 600 sink tokens cover every position of max_model_len 512",
    ),
    (  # found by review: with ratios of the count's own, one pool short
        "num-blocks-too-few-pools-one-group",
        ("--model", "qwen3_next", "--strategy", "pools", "--num-blocks", "3"),
        "--num-blocks: 3 blocks of every group hold no request of max_model_len 512 with the "
        "pools strategy (each group's pool gets 4 blocks, one its null block): group 1 "
        "(full_attention) gets 3 usable blocks of 4 KiB and needs 32; give at least 32",
    ),
    (  # found by review: a traceback from the tensor allocation
        "num-blocks-huge",
        ("--num-blocks", "1" + "0" * 29),
        "--num-blocks: 100000000000000000000000000000 blocks of every group need",
    ),
    (  # found by review: the prompts were generated (or overflowed) before the check
        "shared-prefix-huge",
        ("--shared-prefix", "1" + "0" * 29),
        "lower --shared-prefix to at most 498",
    ),
    (
        "shared-prefix-with-prompts",
        ("--prompts", "{tmp}/empty.txt", "--shared-prefix", "5"),
        "--shared-prefix 5: only applies to the generated prompts, not with --prompts",
    ),
    (
        "model-unknown",
        ("--model", "no-such-model"),
        f"--model: 'no-such-model' is neither a built-in tiny model ({_TINY}",
    ),
    ("model-empty", ("--model", ""), "--model: got an empty name; give a checkpoint directory"),
    ("prompts-empty", ("--prompts", ""), "--prompts: got an empty name; give a text file"),
    ("model-no-config", ("--model", "{tmp}/no-config"), "no-config' has no config.json; give a"),
    ("model-file", ("--model", "{tmp}/empty.txt"), "empty.txt' is a file; give a checkpoint"),
    ("model-unsupported", ("--model", "{tmp}/bert"), "config.model_type: 'bert' is not supported"),
    (
        "model-no-weights",
        ("--model", "{tmp}/no-weights"),
        "no-weights' has a config.json but no weights (none of *.safetensors, *.bin)",
    ),
]


@pytest.mark.parametrize(
    ("argv", "phrase"), [r[1:] for r in BAD_INPUTS], ids=[r[0] for r in BAD_INPUTS]
)
def test_bad_input_is_one_line_and_exit_2(
    argv: tuple[str, ...],
    phrase: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    if argv == ("--device", "cuda") and not _NO_CUDA:
        pytest.skip("this torch has a CUDA device")
    _bad_inputs(tmp_path)

    def no_loading(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"the model was loaded before the error: {args}")

    monkeypatch.setattr(llm_engine, "load_model", no_loading)
    code, out, err = run(capsys, *(a.format(tmp=tmp_path) for a in argv), "--quiet")
    assert "Traceback" not in out + err
    assert code == 2, (out, err)
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("hybridkv run: error: "), err
    assert phrase in lines[0]
    assert out == ""


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (("--memory", "1000TiB"), "--memory: cannot allocate 1000 TiB (1099511627776000 B)"),
        (
            ("--host-memory", "1000TiB"),
            "--host-memory: cannot allocate 1000 TiB (1099511627776000 B)",
        ),
        (
            ("--num-blocks", "100000000000"),
            "--num-blocks 100000000000: cannot allocate 1816 TiB (1996800000090112 B)",
        ),
    ],
)
def test_a_budget_past_the_host_is_one_line_and_exit_2(
    argv: tuple[str, str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """More than any address space: torch's allocation error (after the model loaded: the
    buffers are sized from it) becomes the flag's one line (found by review: a traceback
    and exit 1)."""
    code, out, err = run(capsys, *argv, "--num-requests", "1", "--quiet")
    assert code == 2 and out == "" and "Traceback" not in err
    fix = "give fewer blocks" if argv[0] == "--num-blocks" else "give a smaller size"
    assert err.splitlines() == [
        f"hybridkv run: error: {said} on cpu (not enough memory there); {fix}"
    ]


def test_argparse_errors_are_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["run", "--strategy", "bogus"])
    out, err = capsys.readouterr()
    assert info.value.code == 2 and out == "" and "Traceback" not in err
    assert err.splitlines() == [
        "hybridkv run: error: argument --strategy: invalid choice: 'bogus' (choose from "
        "'arena', 'uniform', 'pools') (see hybridkv run --help)"
    ]


def test_a_cuda_index_past_the_devices_names_the_count(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # as on a machine with two GPUs: the check needs no device, only the count
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    code, _, err = run(capsys, "--device", "cuda:2", "--quiet")
    assert code == 2
    assert err == (
        "hybridkv run: error: --device: 'cuda:2' names CUDA device 2, but this machine has 2 "
        "(cuda:0..cuda:1)\n"
    )


_NO_ENGINE = """
import sys
sys.modules["torch"] = None  # as on a core install: importing it raises ImportError
sys.modules["transformers"] = None
from hybridkv.cli.main import main
code = main(sys.argv[1:])
assert sys.modules["torch"] is None and sys.modules["transformers"] is None
sys.exit(code)
"""


def _without_engine(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _NO_ENGINE, *argv],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_run_without_the_engine_extra() -> None:
    proc = _without_engine("run", "--quiet")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == (
        "hybridkv run: error: needs the engine extra (torch, transformers): pip install "
        "'hybridkv[engine]' (in a checkout: pip install -c constraints.txt -e '.[engine]'; "
        "cannot import torch, transformers)\n"
    )
    # help and the model list need neither
    help_proc = _without_engine("run", "--help")
    assert help_proc.returncode == 0, help_proc.stderr
    assert "--list-models" in help_proc.stdout and "lfm3 (short_conv + sliding(8) + full)" in (
        " ".join(help_proc.stdout.split())
    )
    listed = _without_engine("run", "--list-models")
    assert listed.returncode == 0, listed.stderr
    assert "short_conv" in listed.stdout


def test_every_option_shows_its_default() -> None:
    parser = build_parser(["run"])
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    run_parser = sub.choices["run"]
    formatter = run_parser._get_formatter()
    shown = {
        a.option_strings[0]: formatter._get_help_string(a) or ""
        for a in run_parser._actions
        if a.dest != "help"
    }
    assert len(shown) == 32
    assert [flag for flag, text in shown.items() if "default" not in text] == []
    for flag in ("--memory", "--block-size", "--state-block-size", "--max-model-len"):
        assert flag in shown  # the names plan and simulate use
    assert "--kv-cache-dtype" not in shown  # the engine caches in the model's dtype
    # the defaults run states without importing torch are the engine's
    assert run_prompts.MAX_MODEL_LEN_CAP == llm_engine.DEFAULT_MAX_MODEL_LEN
    assert parse_bytes(run_cmd.DEFAULT_MEMORY) == llm_engine.DEFAULT_MEMORY_BYTES


def test_gzip_prompts_are_read(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    prompts = tmp_path / "p.txt.gz"
    prompts.write_bytes(gzip.compress(b"5 7 9 11\n2 4\n"))
    code, out, _ = run(capsys, "--model", "llama", "--prompts", str(prompts), "--max-tokens", "2")
    assert code == 0
    lines = [line for line in out.splitlines() if line.startswith("r")]
    assert [line.split(", ")[0] for line in lines] == ["r0 (4 prompt tokens", "r1 (2 prompt tokens"]


def test_list_models_names_every_tiny_model(capsys: pytest.CaptureFixture[str]) -> None:
    from hybridkv.models.tiny import TINY_MODELS

    code, out, _ = run(capsys, "--list-models")
    assert code == 0
    lines = out.splitlines()
    assert lines[1].split() == [
        "name",
        "architecture",
        "layers",
        "cache",
        "what",
        "it",
        "exercises",
    ]
    real = lines.index("models with real weights (an optional extra; converted once on first use):")
    assert [line.split()[0] for line in lines[2:real]] == list(TINY_MODELS)
    assert lines[real + 1].split() == ["name", "architecture", "weights", "what", "it", "is"]
    assert lines[real + 2].split()[:2] == ["gemma-3-270m", "gemma3_text"]
    assert (
        "  lfm3              lfm3              2 short_conv + 2 sliding(8) + 2 full  short conv + "
        "sliding (window 8) + full attention"
    ) in lines
    assert "  nemotron_h        nemotron_h        2 mamba2 + 1 full + 1 uncached " in out
    assert lines[-1].startswith("default: lfm3; or give a checkpoint directory")


def test_quiet_silences_transformers_notes_and_restores_its_verbosity(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from transformers.utils import logging as hf_logging

    class Notes(logging.Handler):
        def __init__(self) -> None:
            super().__init__()
            self.messages: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.messages.append(record.getMessage())

    notes = Notes()
    root = hf_logging.get_logger("transformers")
    root.addHandler(notes)
    before = hf_logging.get_verbosity()
    # qwen3_next's mixers note their fallback from fused kernels through transformers' logger,
    # once per process: forget which notes were given, so they would come again
    logging.Logger.warning_once.cache_clear()  # type: ignore[attr-defined]
    try:
        assert main(["run", "--model", "qwen3_next", *SMALL]) == 0
        assert notes.messages == []
        assert hf_logging.get_verbosity() == before
        logging.Logger.warning_once.cache_clear()  # type: ignore[attr-defined]
        assert main(["run", "--model", "qwen3_next", *SMALL[:-1]]) == 0  # not quiet: noted
        assert any("falling back" in m for m in notes.messages)
    finally:
        root.removeHandler(notes)
    capsys.readouterr()


def test_compaction_beside_a_host_tier_is_reported(capsys: pytest.CaptureFixture[str]) -> None:
    """``run`` compacts with a host tier too (its moves go through the tier stream), says
    how many blocks it moved, and the tokens stay transformers' own; off, it preempts more."""
    argv = ["--model", "gemma3_text", "--memory", "104KiB", "--block-size", "4"]
    argv += ["--max-model-len", "64", "--host-memory", "1MiB", "--verify"]
    code, out, err = run(capsys, *argv)
    assert code == 0, out + err
    assert "preemptions: 4 (compaction moved 4 blocks instead of preempting)" in out
    assert out.splitlines()[-1].startswith("verify: all 8 requests (128 tokens) identical")
    code, out, err = run(capsys, *argv, "--compaction", "off")
    assert code == 0 and "\npreemptions: 7\n" in out, out + err


def test_per_group_hit_rates_say_what_they_count(capsys: pytest.CaptureFixture[str]) -> None:
    """The per-group line names its own denominator (every lookup) and says n/a where no
    lookup ran, not 0.0% of 0 (found by review)."""
    assert main(["run", "--model", "jamba", "--quiet", "--max-tokens", "2"]) == 0
    out = capsys.readouterr().out
    assert (
        "  hit rate per group: n/a (no prefix lookups: this model's recurrent state (Mamba1) "
        "cannot resume a prefill, so every prompt is computed whole)"
    ) in out
    assert main(["run", "--model", "llama", "--quiet", "--max-tokens", "2"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if "per group" in x)
    assert "tokens looked up, a request's every lookup counted" in line
    assert "0:full_attention" in line and "n/a" not in line


def test_a_prompt_file_with_a_byte_order_mark_reads_as_without(tmp_path: Path) -> None:
    """Windows editors start UTF-8 files with a byte-order mark; it was read as part of the
    first token id and the file refused (found by review)."""
    plain, marked = tmp_path / "plain.txt", tmp_path / "marked.txt"
    plain.write_bytes(b"1 2 3\r\n4 5 6\r\n")
    marked.write_bytes(b"\xef\xbb\xbf" + plain.read_bytes())
    assert run_prompts.prompt_lines(str(marked)) == run_prompts.prompt_lines(str(plain))
    assert run_prompts.prompt_lines(str(plain)) == ["1 2 3", "4 5 6"]


def test_run_host_memory_zero_means_no_host_tier(capsys: pytest.CaptureFixture[str]) -> None:
    """As in ``simulate``: ``--host-memory 0`` (any unit) is no host tier, not an error
    (found by review)."""
    outs = []
    for extra in ([], ["--host-memory", "0"], ["--host-memory", "0GiB"]):
        assert main(["run", "--quiet", "--max-tokens", "2", *extra]) == 0
        out = capsys.readouterr().out
        outs.append(re.sub(r"in \d+\.\d+ s \([\d.]+ tokens/s\)", "", out))
    assert outs[1:] == [outs[0]] * 2
    assert main(["run", "--host-memory", "0", "--write-through", "host"]) == 2
    assert "--write-through host: needs a host tier" in capsys.readouterr().err
