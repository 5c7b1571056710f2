"""LLMEngine's API: streaming steps, stop reasons, statistics, budgets, errors, verification."""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from hybridkv.engine import (
    CacheConfig,
    LLMEngine,
    ModelSourceError,
    PromptError,
    llm_engine,
    reference_copy,
    verify_completions,
)
from hybridkv.engine.errors import BindingError, DeviceError, EngineError
from hybridkv.engine.models import load_model
from hybridkv.engine.verify import Mismatch, greedy_reference
from hybridkv.errors import PlanError, UnsupportedModelTypeError
from hybridkv.scheduler import FinishReason, SchedulerConfig, SchedulerError, SchedulerOutput
from hybridkv.specs import CacheKind

SMALL = CacheConfig(block_size=4, state_block_size=8, memory_bytes=1 << 20, max_model_len=64)


pytestmark = pytest.mark.usefixtures("one_thread")


@functools.cache
def _models(name: str) -> tuple[Any, Any]:
    model = load_model(name)
    return model, reference_copy(model)


def test_steps_stream_one_output_per_sampling_request() -> None:
    engine = LLMEngine(_models("lfm2")[0], cache=SMALL, scheduler=SchedulerConfig(token_budget=8))
    engine.add_request("a", list(range(1, 12)), max_tokens=2)
    engine.add_request("b", [5, 6], max_tokens=3)
    streamed: list[list[tuple[str, int, bool]]] = []
    while engine.has_unfinished():
        outs = engine.step()
        streamed.append([(o.request_id, len(o.new_token_ids), o.finished) for o in outs])
    # a's 11-token prompt: 8 (aligned chunk, the whole budget) then 3 with b's prefill
    assert streamed == [
        [],
        [("a", 1, False), ("b", 1, False)],
        [("a", 1, True), ("b", 1, False)],
        [("b", 1, True)],
    ]
    assert {rid: len(c.token_ids) for rid, c in engine.completions.items()} == {"a": 2, "b": 3}
    stats = engine.stats()
    assert (stats.steps, stats.generated_tokens, stats.prompt_tokens) == (4, 5, 13)
    assert stats.computed_tokens == 13 + 3 and stats.max_step_tokens == 8
    assert stats.tokens_per_second > 0 and 0 < stats.model_seconds <= stats.seconds


def test_eos_stops_a_request_and_generate_keeps_order() -> None:
    model, ref = _models("llama")
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]
    first = [greedy_reference(ref, p, 4).tokens for p in prompts]
    engine = LLMEngine(model, cache=SMALL, keep_logits=True)
    eos = first[0][1]  # a's second token
    done = engine.generate(prompts, max_tokens=4, eos_token_ids=[eos])
    assert [c.request_id for c in done] == ["req-0", "req-1"]
    assert done[0].token_ids == tuple(first[0][:2]) and done[0].finish_reason is FinishReason.STOP
    assert len(done[0].logits) == 2 and done[0].logits[0].shape == (256,)
    result = verify_completions(ref, done, [eos])
    assert result.ok and result.num_tokens == len(done[0].token_ids) + len(done[1].token_ids)
    assert result.max_logit_diff is not None and result.max_logit_diff < 1e-4
    # named prompts, and the ids continue after the generated ones
    more = engine.generate({"x": [1, 2, 3]}, max_tokens=1)
    assert [c.request_id for c in more] == ["x"]
    assert engine.generate([[7]], max_tokens=1)[0].request_id == "req-2"


def test_max_model_len_finishes_a_request() -> None:
    engine = LLMEngine(_models("llama")[0], cache=CacheConfig(block_size=4, max_model_len=8))
    (done,) = engine.generate([[1, 2, 3, 4, 5]], max_tokens=10)
    assert len(done.token_ids) == 3 and done.finish_reason is FinishReason.MAX_MODEL_LEN


def test_verify_reports_the_first_difference() -> None:
    model, ref = _models("llama")
    engine = LLMEngine(model, cache=SMALL)
    (done,) = engine.generate([[3, 1, 4]], max_tokens=3)
    want = greedy_reference(ref, [3, 1, 4], 3).tokens
    forged = type(done)(**{**done.__dict__, "token_ids": (want[0], want[1] + 1)})
    result = verify_completions(ref, [forged])
    assert not result.ok and result.max_logit_diff is None
    assert result.mismatches == (Mismatch("req-0", 1, want[1] + 1, want[1]),)


def test_num_blocks_budget() -> None:
    model = _models("lfm3")[0]
    for strategy in ("pools", "uniform", "arena"):
        cache = CacheConfig(strategy=strategy, block_size=4, num_blocks=9, max_model_len=32)
        layout = LLMEngine(model, cache=cache).layout
        if layout.arena is None:
            # pools: one pool of 10 blocks (null included) per group; uniform: one shared pool
            sizes = [p.num_blocks for p in layout.pools]
            assert sizes == ([10] * 3 if strategy == "pools" else [30])
        else:
            usable = [
                (layout.arena.num_chunks - 1) * layout.blocks_per_chunk(g.group_id)
                for g in layout.groups
            ]
            assert all(n >= 9 for n in usable)


def test_bad_configuration_and_requests() -> None:
    with pytest.raises(PlanError, match=r"give memory_bytes .* or num_blocks"):
        CacheConfig(memory_bytes=1 << 20, num_blocks=4)
    with pytest.raises(PlanError, match=r"CacheConfig\.num_blocks: must be a positive integer"):
        CacheConfig(num_blocks=0)
    engine = LLMEngine(_models("llama")[0], cache=SMALL)
    with pytest.raises(PromptError, match="'e': the prompt is empty"):
        engine.add_request("e", [], max_tokens=1)
    with pytest.raises(PromptError, match="token id 256 is outside the vocabulary"):
        engine.add_request("v", [1, 256], max_tokens=1)
    with pytest.raises(PromptError, match="64 tokens; prompts must be shorter"):
        engine.add_request("long", [1] * 64, max_tokens=1)
    with pytest.raises(PromptError, match="max_tokens must be an integer >= 1, got 0"):
        engine.add_request("z", [1], max_tokens=0)
    # found by review: a bool prompt was queued and then broke every later step
    refused: list[tuple[Any, dict[str, Any], str]] = [
        ([True, False], {}, "token id True (bool) is not a Python int"),
        (torch.tensor([1, 2]), {}, "token id tensor(1) (Tensor) is not a Python int"),
        (5, {}, "the prompt must be a sequence of token ids, got int 5"),
        ([1], {"max_tokens": 2.5}, "max_tokens must be an integer >= 1, got 2.5"),
        ([1], {"max_tokens": "3"}, "max_tokens must be an integer >= 1, got '3'"),
        ([1], {"eos_token_ids": 5}, "eos_token_ids must be a sequence of token ids, got int 5"),
        ([1], {"eos_token_ids": [-5]}, "eos_token_ids: -5 is not a token id of the vocabulary"),
    ]
    for prompt, extra, phrase in refused:
        with pytest.raises(PromptError, match=re.escape(phrase)):
            engine.add_request("bad", prompt, **{"max_tokens": 1, **extra})
    engine.add_request("a", [1], max_tokens=1)
    with pytest.raises(SchedulerError, match="already queued"):
        engine.add_request("a", [2], max_tokens=1)
    assert engine.stats().prompt_tokens == 1
    assert engine.generate([], max_tokens=1) == [] and "a" in engine.completions


def test_engine_arguments_of_the_wrong_type_are_typed_errors() -> None:
    """Found by review: a raw TypeError, AttributeError or ValueError before."""
    with pytest.raises(ModelSourceError, match="model: expected a tiny model's name"):
        LLMEngine(None)  # type: ignore[arg-type]
    with pytest.raises(PlanError, match=r"cache: expected a CacheConfig \(or None\), got dict"):
        LLMEngine("llama", cache={"num_blocks": 4})  # type: ignore[arg-type]
    with pytest.raises(SchedulerError, match="scheduler: expected a SchedulerConfig"):
        LLMEngine("llama", scheduler={})  # type: ignore[arg-type]
    with pytest.raises(EngineError, match=r"seed: must be an integer in \[0, 2\^63\), got 10"):
        LLMEngine("llama", seed=10**30)
    with pytest.raises(PlanError, match=r"CacheConfig\.disk_cache_dir: got an empty path"):
        CacheConfig(disk_cache_dir="", disk_memory_bytes=1 << 20)
    with pytest.raises(BindingError, match="attention_sinks: 64 sink tokens cover every posi"):
        LLMEngine("gemma2", cache=CacheConfig(attention_sinks=64, max_model_len=64))
    # found by review: the CLI refused a max_model_len past the model's positions, the
    # library planned it (before the weights load, and for a loaded model alike)
    too_long = "max_model_len: 513 is above llama's own limit of 512 positions"
    with pytest.raises(BindingError, match=too_long):
        LLMEngine("llama", cache=CacheConfig(max_model_len=513))
    with pytest.raises(BindingError, match=r"max_model_len: 513 is above .* 512 positions"):
        LLMEngine(load_model("llama"), cache=CacheConfig(max_model_len=513))
    assert LLMEngine("llama", cache=CacheConfig(max_model_len=512)).max_model_len == 512


def test_model_sources(tmp_path: Path) -> None:
    with pytest.raises(ModelSourceError, match="is neither a tiny model"):
        LLMEngine(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "bert"}', encoding="utf-8")
    with pytest.raises(UnsupportedModelTypeError, match="'bert' is not supported"):
        LLMEngine(tmp_path)
    (tmp_path / "config.json").write_text(
        '{"model_type": "llama", "num_hidden_layers": 1, "hidden_size": 8, '
        '"num_attention_heads": 2}',
        encoding="utf-8",
    )
    with pytest.raises(ModelSourceError, match=r"cannot load '.*' \(OSError: "):
        LLMEngine(tmp_path)  # a config but no weights
    (tmp_path / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ModelSourceError, match=r"cannot load '.*' \(SafetensorError: "):
        LLMEngine(tmp_path)


def test_a_checkpoint_missing_weights_is_refused(tmp_path: Path) -> None:
    """transformers would initialize what a checkpoint lacks at random (a different model on
    every load, so a verification would blame the engine): refused, naming the weights."""
    from safetensors.torch import load_file, save_file

    load_model("llama").save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    gone = sorted(k for k in weights if k.startswith("model.layers.1.mlp."))
    assert len(gone) == 3
    save_file({k: v for k, v in weights.items() if k not in gone}, tmp_path / "model.safetensors")
    with pytest.raises(ModelSourceError) as err:
        load_model(tmp_path)
    assert str(err.value) == (
        f"model: checkpoint '{tmp_path}' lacks 3 weight(s) its config needs ({', '.join(gone)})"
    )
    # weights of another shape: transformers' own error points at a report it logged
    save_file({k: torch.cat([v, v]) for k, v in weights.items()}, tmp_path / "model.safetensors")
    with pytest.raises(ModelSourceError, match="holds weights whose shapes differ from what its"):
        load_model(tmp_path)


def _no_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"loaded {args} before the error")

    monkeypatch.setattr(llm_engine, "load_model", fail)


def test_bad_devices_and_budgets_fail_before_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    _no_loading(monkeypatch)
    with pytest.raises(DeviceError, match="cannot parse 'tpu'; valid: cpu, cuda or cuda:N"):
        LLMEngine("llama", device="tpu")
    if not torch.cuda.is_available():
        with pytest.raises(DeviceError, match="asked for CUDA, but this torch"):
            LLMEngine("llama", device="cuda")
    # the plan is made from the config first: a budget too small fails with no weights loaded
    with pytest.raises(PlanError, match=r"memory_bytes: 4 KiB \(4096 B\) holds no request"):
        LLMEngine("lfm3", cache=CacheConfig(memory_bytes=4096))
    with pytest.raises(PlanError, match="kernel_block_size: 5 does not divide block_size 16"):
        LLMEngine("llama", cache=CacheConfig(kernel_block_size=5))


@pytest.mark.parametrize("name", ["lfm3", "qwen3_next", "deepseek_v3", "gpt_oss"])
def test_plan_from_the_config_is_the_engines_plan(name: str) -> None:
    from hybridkv.models import spec_from_config

    config = llm_engine.model_config(name)
    data = {**config.to_dict(), "dtype": "float32"}
    spec = spec_from_config(data, kv_cache_dtype="float32")
    model = _models(name)[0]
    for cache in (
        CacheConfig(block_size=4, state_block_size=8, max_model_len=64),
        CacheConfig(strategy="pools", num_blocks=9, max_model_len=32),
        CacheConfig(strategy="uniform", memory_bytes=8 << 20),
    ):
        max_len = cache.max_model_len or llm_engine.default_max_model_len(config)
        before = llm_engine.plan_cache(spec, max_len, cache)
        engine = LLMEngine(model, cache=cache)
        assert (before.layout, before.memory_bytes) == (
            engine.plan.layout,
            engine.plan.memory_bytes,
        )
        assert engine.vocab_size == llm_engine.config_vocab_size(config)
        assert engine.max_model_len == max_len


def test_prompt_problem_without_a_model() -> None:
    limits = {"vocab_size": 10, "max_model_len": 4}
    assert llm_engine.prompt_problem([1, 2, 3], **limits) is None
    assert llm_engine.prompt_problem([], **limits) == "the prompt is empty"
    assert llm_engine.prompt_problem([1, 10], **limits) == (
        "token id 10 is outside the vocabulary [0, 10)"
    )
    assert llm_engine.prompt_problem([1, 2, 3, 4], **limits) == (
        "the prompt has 4 tokens; prompts must be shorter than max_model_len 4"
    )


class _StuckScheduler:
    """A scheduler with a waiting request it never schedules."""

    def __init__(self) -> None:
        self.running: list[Any] = []
        self.waiting = [object()]

    def schedule(self, drafts: Any = None) -> SchedulerOutput:
        return SchedulerOutput(step=1, scheduled=())

    def has_unfinished(self) -> bool:
        return True


def test_a_step_that_schedules_nothing_is_an_error() -> None:
    engine = LLMEngine(_models("llama")[0], cache=SMALL)
    engine.scheduler = _StuckScheduler()  # type: ignore[assignment]
    with pytest.raises(EngineError, match="1 waiting requests but nothing could be scheduled"):
        engine.step()


@pytest.mark.parametrize("name", ["llama", "llama4_text"])
def test_same_step_prefix_hits_are_exact(name: str) -> None:
    """Requests admitted in the step that computes their shared prefix hit it (blocks are
    published at allocation) and still match transformers: llama runs the step as one packed
    pass (every layer writes before it reads); llama4_text reads the cache length, so its
    requests run in passes, and the readers' pass runs after the writer's."""
    model, ref = _models(name)
    shared = [(7 * i + 3) % 200 + 1 for i in range(24)]
    prompts = {"w": [*shared, 9, 8, 7], "r1": [*shared, 5, 4], "r2": [*shared, 1, 2, 3, 4, 5]}
    hits = {}
    for publish in ("scheduled", "computed"):
        cache = CacheConfig(block_size=4, num_blocks=64, max_model_len=64, publish=publish)
        sched = SchedulerConfig(token_budget=256)
        engine = LLMEngine(model, cache=cache, scheduler=sched, keep_logits=True)
        done = engine.generate(prompts, max_tokens=3)
        assert engine.stats().steps == 3  # all three admitted in the first step
        result = verify_completions(ref, done)
        # logits too: a read of the zeroed, not yet written blocks keeps these tiny models'
        # argmax but moves logits by ~1 (measured with the passes run in reverse order)
        assert result.ok and result.max_logit_diff is not None and result.max_logit_diff < 1e-4
        hits[publish] = {c.request_id: c.num_cached_tokens for c in done}
    assert hits == {
        "scheduled": {"w": 0, "r1": 24, "r2": 24},
        "computed": dict.fromkeys(prompts, 0),
    }


def test_chunk_zero_blocks_lent_to_attention_stay_exact_next_to_state_null_slots() -> None:
    """Chunk 0 of an arena lends its blocks past the null region to the attention group,
    although the state group's null slot spans them: nothing reads or writes state slot 0,
    so those blocks carry real KV and the tokens still match transformers."""
    model, ref = _models("granitemoehybrid")
    cache = CacheConfig(block_size=4, num_blocks=48, max_model_len=96)
    engine = LLMEngine(model, cache=cache, scheduler=SchedulerConfig(token_budget=32))
    layout = engine.manager.layout
    host = layout.null_host
    state = next(g for g in layout.groups if g.spec.kind == "state")
    assert host is not None
    # state slot 0 spans bytes [0, state block), over the host's first lent blocks
    assert state.block_bytes > host.first * layout.groups[host.group_id].block_bytes
    used: set[int] = set()
    allocate = engine.manager.allocate_slots

    def spy(*args: Any, **kwargs: Any) -> Any:
        res = allocate(*args, **kwargs)
        if res is not None:
            used.update(b for b in res.new_block_ids[host.group_id] if b < host.end)
        return res

    engine.manager.allocate_slots = spy  # type: ignore[method-assign]
    prompts = {f"p{i}": [(7 * i + 3 * j) % 150 + 1 for j in range(30 + 5 * i)] for i in range(4)}
    done = engine.generate(prompts, max_tokens=4)
    assert used and min(used) == host.first
    assert verify_completions(ref, done).ok


@pytest.mark.parametrize("name", ["granitemoehybrid", "gemma3_text"])
def test_blocks_lent_past_the_last_chunk_stay_exact(name: str) -> None:
    """A budget one byte short of another chunk: the bytes past the last whole chunk are lent
    to a tail host group for good; its first allocations take those blocks (they were queued
    last), which carry real KV, and the tokens still match transformers."""
    model, ref = _models(name)
    probe = LLMEngine(model, cache=CacheConfig(block_size=4, num_blocks=24, max_model_len=96))
    arena = probe.manager.layout.arena
    assert arena is not None
    budget = arena.num_chunks * arena.chunk_bytes + arena.chunk_bytes - 1
    cache = CacheConfig(block_size=4, memory_bytes=budget, max_model_len=96)
    engine = LLMEngine(model, cache=cache, scheduler=SchedulerConfig(token_budget=32))
    layout = engine.manager.layout
    host = layout.tail_host
    assert layout.arena is not None and host is not None
    assert layout.total_bytes == host.end * layout.groups[host.group_id].block_bytes
    used: set[int] = set()
    allocate = engine.manager.allocate_slots

    def spy(*args: Any, **kwargs: Any) -> Any:
        res = allocate(*args, **kwargs)
        if res is not None:
            used.update(b for b in res.new_block_ids[host.group_id] if b >= host.first)
        return res

    engine.manager.allocate_slots = spy  # type: ignore[method-assign]
    prompts = {f"p{i}": [(7 * i + 3 * j) % 150 + 1 for j in range(30 + 5 * i)] for i in range(4)}
    done = engine.generate(prompts, max_tokens=4)
    assert used and used <= set(range(host.first, host.end))
    assert verify_completions(ref, done).ok
    engine.manager.check_invariants()


def test_jamba_prompts_are_computed_whole_and_exact() -> None:
    """transformers' Mamba1 (Jamba) runs a multi-token pass from a zero state, so the engine
    schedules every prompt whole, from token 0, with no prefix hit, and decodes from the state."""
    model, ref = _models("jamba")
    cache = CacheConfig(block_size=4, num_blocks=64, max_model_len=96)
    engine = LLMEngine(model, cache=cache, scheduler=SchedulerConfig(token_budget=64))
    assert engine.scheduler.config.whole_prefill
    shared = [(7 * i + 3) % 200 + 1 for i in range(24)]
    prompts = {f"p{i}": [*shared, *range(1 + i, 5 + 2 * i)] for i in range(4)}
    done = engine.generate(prompts, max_tokens=5)
    assert [c.num_cached_tokens for c in done] == [0, 0, 0, 0]
    assert verify_completions(ref, done).ok
    with pytest.raises(SchedulerError, match=r"whole_prefill computes a prompt in one step"):
        engine.generate({"long": list(range(1, 70))}, max_tokens=1)


@pytest.mark.parametrize("name", ["qwen3_next", "granitemoehybrid"])
def test_split_state_groups_stay_exact_with_prefix_hits(name: str) -> None:
    """An arena whose state group is cut into groups of layers (``state_split``): each
    group's slots hold only its layers' state, and tokens still match transformers, prefix
    hits on the checkpoints included."""
    model, ref = _models(name)
    shared = [(5 * i + 1) % 200 + 1 for i in range(40)]
    prompts = {"a": [*shared, 9, 8, 7], "b": [*shared, 5, 4], "c": [*shared, 1, 2, 3]}
    cache = CacheConfig(
        block_size=4, state_block_size=8, num_blocks=64, max_model_len=96, state_split=2
    )
    engine = LLMEngine(model, cache=cache, scheduler=SchedulerConfig(token_budget=16))
    groups = engine.plan.layout.groups
    state = [g for g in groups if g.spec.kind is CacheKind.STATE]
    assert len(state) == 2 and {len(g.members) for g in state} <= {1, 2, 3, 4, 5, 6}
    done = [engine.generate({rid: p}, max_tokens=4)[0] for rid, p in prompts.items()]
    assert verify_completions(ref, done).ok
    assert [c.num_cached_tokens for c in done] == [0, 40, 40]
