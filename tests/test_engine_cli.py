"""``hybridkv run``: outputs, statistics, ``--verify``, prompt files and one-line errors."""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from hybridkv.cli.main import main
from hybridkv.engine import models as engine_models

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
    assert "0:state 39.5%, 1:sliding_window 39.5%, 2:full_attention 39.5%" in out
    assert "peak blocks per group: 0:state " in out and "preemptions: 0" in out
    assert "window blocks released: 1:sliding_window " in out
    assert lines[-1].startswith("verify: all 4 requests (16 tokens) identical to transformers'")
    assert err == ""


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


def test_bad_input_is_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("\n   \n", encoding="utf-8")
    words = tmp_path / "words.txt"
    words.write_text("1 2 three\n", encoding="utf-8")
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("1 2 999\n", encoding="utf-8")
    no_config = tmp_path / "no-config"
    no_config.mkdir()
    bert = tmp_path / "bert"
    bert.mkdir()
    (bert / "config.json").write_text(json.dumps({"model_type": "bert"}), encoding="utf-8")
    binary = tmp_path / "binary.bin"
    binary.write_bytes(bytes(range(256)))
    broken_gz = tmp_path / "broken.gz"
    broken_gz.write_bytes(gzip.compress(b"1 2 3\n")[:12])
    cases = {
        ("--device", "tpu"): "device: cannot parse 'tpu'; valid: cpu, cuda or cuda:N",
        ("--device", "meta"): "device: 'meta' is a meta device",
        ("--prompts", str(binary)): f"--prompts: {str(binary)!r} is not UTF-8 text (byte 128)",
        ("--prompts", str(broken_gz)): "is a broken gzip file",
        ("--prompts", str(tmp_path)): f"--prompts: {str(tmp_path)!r} is a directory",
        ("--num-requests", "0"): "--num-requests: must be a positive integer, got 0",
        ("--block-size", "0"): "--block-size: must be a positive integer, got 0",
        ("--memory", "0"): "--memory: size must be positive",
        ("--prompts", str(empty)): "holds no prompt (one prompt per line)",
        ("--prompts", str(words)): f"{words}:1: 'three' is not a token id",
        ("--prompts", str(vocab), "--model", "llama"): "token id 999 is outside the vocabulary",
        ("--prompts", str(tmp_path / "missing.txt")): "cannot read",
        ("--model", str(no_config)): "nor a directory holding config.json",
        ("--model", "no-such-model"): "is neither a built-in tiny model (llama, gemma2,",
        ("--model", str(bert)): "'bert' is not supported",
        ("--max-model-len", "16"): "36 tokens; prompts must be shorter than max_model_len 16",
        ("--max-tokens", "0"): "--max-tokens: must be a positive integer, got 0",
        ("--memory", "lots"): "cannot parse 'lots' as a size",
        ("--memory", "4KiB"): "holds no request",
    }
    if not torch.cuda.is_available():
        cases[("--device", "cuda")] = "asked for CUDA, but this torch"
        cases[("--device", "cuda:1")] = "asked for CUDA, but this torch"
    else:
        n = torch.cuda.device_count()
        cases[("--device", f"cuda:{n}")] = f"names CUDA device {n}, but this machine has {n}"
    for argv, message in cases.items():
        code, out, err = run(capsys, *argv, "--quiet")
        assert "Traceback" not in out + err
        assert code == 2, (argv, out, err)
        assert err.count("\n") == 1 and err.startswith("hybridkv run: error: "), err
        assert message in err, (argv, err)


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
    listed = [line.split()[0] for line in out.splitlines()[1:-1]]
    assert listed == list(TINY_MODELS)
    assert "lfm3              short conv + sliding (window 8) + full attention" in out
