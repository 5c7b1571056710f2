"""StreamingLLM attention sinks in the engine: sliding-window layers also read the first
tokens, whose blocks are never recycled; exact against transformers run with that mask."""

from __future__ import annotations

import functools
import subprocess
import sys
from typing import Any

import pytest
import torch

from hybridkv.engine import BindingError, CacheConfig, LLMEngine, verify_completions
from hybridkv.engine.errors import EngineError
from hybridkv.engine.models import load_model
from hybridkv.engine.speculative import NgramProposer, SpeculativeConfig
from hybridkv.engine.verify import sink_masks
from hybridkv.errors import PlanError
from hybridkv.specs import CacheKind

SLIDING = ["gpt_oss", "gemma3_text", "gemma2"]


pytestmark = pytest.mark.usefixtures("one_thread")


@functools.cache
def _reference(name: str) -> Any:
    return load_model(name)


def _prompts(seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [[int(t) for t in torch.randint(0, 200, (n,), generator=gen)] for n in (30, 7, 45)]


@pytest.mark.parametrize("name", SLIDING)
@pytest.mark.parametrize("sinks", [4, 6])
def test_sinks_are_exact_and_change_the_output(name: str, sinks: int) -> None:
    engine = LLMEngine(
        name, cache=CacheConfig(block_size=4, attention_sinks=sinks), keep_logits=True
    )
    sliding = [g for g in engine.layout.groups if g.spec.kind is CacheKind.SLIDING]
    assert sliding and all(g.spec.sink_tokens == sinks for g in sliding)  # type: ignore[attr-defined]
    done = engine.generate(_prompts(), max_tokens=20)
    result = verify_completions(_reference(name), done, sink_tokens=sinks)
    assert result.ok, result.mismatches
    # The sinks matter: the model without them generates something else.
    assert not verify_completions(_reference(name), done).ok
    stats = engine.stats()
    assert sum(stats.window_blocks_released) > 0  # the window still recycles blocks
    engine.manager.check_invariants()


def test_sink_blocks_stay_in_the_table_while_the_window_moves() -> None:
    engine = LLMEngine("gpt_oss", cache=CacheConfig(block_size=4, attention_sinks=6))
    [gid] = [g.group_id for g in engine.layout.groups if g.spec.kind is CacheKind.SLIDING]
    engine.add_request("r", _prompts()[2], max_tokens=8)  # 45 tokens, window 8
    engine.step()  # the prompt
    engine.step()  # the first decode step's allocation releases what the window left
    table = engine.manager.get_block_ids("r")[gid]
    # Sinks: tokens 0..5 -> blocks 0 and 1 kept; the window of the next query (token 45) needs
    # tokens 38..45 -> blocks 9..11; blocks 2..8 were released (null).
    assert all(table[:2]) and not any(table[2:9]) and all(table[9:12])
    done = engine.generate({"again": _prompts()[2] + [1, 2, 3, 4]}, max_tokens=4)
    assert done[0].num_cached_tokens == 44  # sinks + window of the shared prefix hit
    engine.manager.check_invariants()


def test_sinks_with_speculative_decoding() -> None:
    cache = CacheConfig(block_size=4, attention_sinks=4)
    prompts = [p * 2 for p in _prompts(3)]
    plain = LLMEngine("gpt_oss", cache=cache).generate(prompts, max_tokens=16)
    engine = LLMEngine("gpt_oss", cache=cache, speculative=SpeculativeConfig(NgramProposer(), 3))
    done = engine.generate(prompts, max_tokens=16)
    assert [c.token_ids for c in done] == [c.token_ids for c in plain]
    assert engine.stats().draft_tokens > 0


def test_sinks_need_sliding_layers() -> None:
    with pytest.raises(BindingError, match="attention_sinks: 4 sink tokens need sliding-window"):
        LLMEngine("llama", cache=CacheConfig(attention_sinks=4))
    with pytest.raises(PlanError, match=r"CacheConfig\.attention_sinks: must be an integer >= 0"):
        CacheConfig(attention_sinks=-1)
    with pytest.raises(EngineError, match="no sliding_attention layers"):
        sink_masks(load_model("llama").config, 8, 4)


def test_sink_masks() -> None:
    masks = sink_masks(_reference("gpt_oss").config, 12, 2)  # window 8
    allowed = masks["sliding_attention"][0, 0] == 0
    assert allowed[11].nonzero().flatten().tolist() == [0, 1, 4, 5, 6, 7, 8, 9, 10, 11]
    assert allowed[5].nonzero().flatten().tolist() == [0, 1, 2, 3, 4, 5]
    full = masks["full_attention"][0, 0] == 0
    assert full[11].all() and not full[3, 4:].any()


def test_cli_run_with_sinks_and_speculation() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "hybridkv",
            "run",
            "--model",
            "gpt_oss",
            "--attention-sinks",
            "4",
            "--speculate",
            "3",
            "--num-requests",
            "3",
            "--verify",
            "--quiet",
        ],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    assert "identical to transformers run with 4 sink tokens in its sliding masks" in out.stdout
    assert "speculative decoding:" in out.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "hybridkv", "run", "--model", "llama", "--attention-sinks", "4"],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2
    # refused from the config, before the model loads: the error is all stderr holds
    assert bad.stderr.strip().splitlines() == [
        "hybridkv run: error: --attention-sinks 4: sink tokens need sliding-window layers; "
        "llama has no sliding_window"
    ]
