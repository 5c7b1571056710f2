"""The paged runner reproduces transformers exactly on every tiny architecture.

Each scenario runs greedy decoding through :class:`ModelRunner` over NaN-filled cache views
(a read of never-written memory would poison the logits), with the toy allocator poisoning
every block it frees, and compares with transformers' own ``generate(do_sample=False)``:
generated tokens identical, logits within ``ATOL``.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from hybridkv.engine.generate import Generation
from hybridkv.engine.layouts import fixed_layout
from hybridkv.engine.models import TINY_MODELS, load_model, reference_copy
from hybridkv.engine.probe import ModelProbe, probe_model, probe_model_spec
from hybridkv.engine.runner import ModelRunner
from hybridkv.engine.views import DenseKVViews
from hybridkv.plan import MemoryLayout
from hybridkv.specs import CacheKind, ModelSpec, StateSpec, StateTensor

from support.paged_generator import PagedGenerator
from support.reference import reference_chunked, reference_generate
from support.toy_cache import ToyCache

ATOL = 1e-4
ARCHS = sorted(TINY_MODELS)
#: Architectures whose state resumes a multi-token pass: all but Jamba, whose transformers
#: Mamba1 scan restarts from zero (the engine computes its prompts whole, see
#: test_engine_llm.py::test_jamba_prompts_are_computed_whole_and_exact).
RESUMABLE = [n for n in ARCHS if n != "jamba"]
WINDOWED = [n for n in ARCHS if n in ("gemma2", "gemma3_text", "gpt_oss", "lfm3", "llama4_text")]
STATEFUL = ["granitemoehybrid", "lfm2", "lfm3", "nemotron_h", "qwen3_next"]


pytestmark = pytest.mark.usefixtures("one_thread")


@functools.cache
def _models(name: str) -> tuple[Any, Any, ModelProbe]:
    model = load_model(name)
    ref = reference_copy(model)  # before the runner switches `model` to paged attention
    return model, ref, probe_model(model)


def prompt(seed: int, length: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return [int(t) for t in torch.randint(0, 256, (length,), generator=gen)]


@functools.cache
def _reference(
    name: str, tokens: tuple[int, ...], max_new: int, chunk: int | None = None
) -> Generation:
    ref = _models(name)[1]
    if chunk is None:
        return reference_generate(ref, tokens, max_new)
    return reference_chunked(ref, tokens, chunk, max_new)


def setup(
    name: str, spec: ModelSpec | None = None, **layout_kw: Any
) -> tuple[ModelRunner, ToyCache, MemoryLayout]:
    model, _, probe = _models(name)
    layout = fixed_layout(spec or probe_model_spec(probe), num_blocks=48, **layout_kw)
    views = DenseKVViews(layout, fill=float("nan"))
    runner = ModelRunner(model, layout, views, probe=probe)
    return runner, ToyCache(layout, views, poison_freed=True), layout


def check(
    name: str, got: Generation, prompt_tokens: list[int], max_new: int, chunk: int | None = None
) -> float:
    """Tokens equal to transformers' ``generate``; logits within ``ATOL`` of transformers run
    the same way (whole-prompt ``generate``, or its own cache fed ``chunk`` prompt tokens per
    pass when the paged run prefilled in chunks).  Returns the max logit difference."""
    tokens = tuple(prompt_tokens)
    assert got.tokens == _reference(name, tokens, max_new).tokens
    want = _reference(name, tokens, max_new, chunk)
    assert got.tokens == want.tokens
    diff = max(float((a - b).abs().max()) for a, b in zip(got.logits, want.logits, strict=True))
    assert diff < ATOL
    return diff


@pytest.mark.parametrize("name", ARCHS)
def test_mixed_length_batch(name: str) -> None:
    runner, cache, _ = setup(name)
    prompts = {"a": prompt(1, 5), "b": prompt(2, 11), "c": prompt(3, 17)}
    gen = PagedGenerator(runner, cache)
    for rid, p in prompts.items():
        gen.add(rid, p, 6)
    first = gen.step()
    # One packed pass for attention-only models; one pass per prompt length otherwise.
    assert first.num_passes == (1 if runner.packed else 3)
    results = gen.run()
    for rid, p in prompts.items():
        check(name, results[rid], p, 6)
    cache.check_invariants()
    assert all(cache.num_free(g.group_id) == 47 for g in runner.layout.groups)


@pytest.mark.parametrize("name", RESUMABLE)
def test_chunked_prefill(name: str) -> None:
    runner, cache, _ = setup(name)
    pa, pb = prompt(4, 21), prompt(5, 9)
    gen = PagedGenerator(runner, cache)
    gen.add("a", pa, 6, chunk_size=4)
    gen.add("b", pb, 6, chunk_size=3)
    results = gen.run()
    # The first request needs ceil(21 / 4) = 6 prefill steps, then 5 decode steps.
    assert len(gen.steps) == 11
    check(name, results["a"], pa, 6, chunk=4)
    check(name, results["b"], pb, 6, chunk=3)


@pytest.mark.parametrize("name", WINDOWED)
def test_window_blocks_replaced_by_null_block(name: str) -> None:
    prompts = {"a": prompt(6, 19), "b": prompt(7, 7)}
    runs = {}
    for recycle in (True, False):
        runner, _, layout = setup(name)
        cache = ToyCache(layout, runner.views, poison_freed=True, recycle=recycle)
        gen = PagedGenerator(runner, cache)
        for rid, p in prompts.items():
            gen.add(rid, p, 8, chunk_size=4)
        nulled_mid_sequence = False
        while not gen.done:
            gen.step()
            for g in layout.groups:
                if g.spec.kind in (CacheKind.SLIDING, CacheKind.CHUNKED) and "a" in gen.active:
                    table = cache.block_table("a", g.group_id)
                    nulled_mid_sequence |= table[0] == 0 and table[-1] != 0
        assert nulled_mid_sequence == recycle
        assert (cache.released > 0) == recycle
        runs[recycle] = gen.results
    for rid, p in prompts.items():
        check(name, runs[True][rid], p, 8, chunk=4)
        # Recycled and poisoned blocks change nothing, bit for bit.
        for a, b in zip(runs[True][rid].logits, runs[False][rid].logits, strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("name", RESUMABLE)
def test_kernel_block_smaller_than_manager_block(name: str) -> None:
    runner, cache, layout = setup(name, block_size=8, kernel_block_size=2)
    for g in layout.groups:
        if g.spec.kind is CacheKind.STATE:
            continue
        assert g.kernel_blocks_per_block == 4
        member = g.members[0]
        view = (
            runner.views.mla_latent(*member)
            if g.spec.kind is CacheKind.MLA
            else runner.views.attention_kv(*member)[0]
        )
        assert tuple(view.shape[:2]) == (48 * 4, 2)
    pa, pb = prompt(8, 19), prompt(9, 6)
    gen = PagedGenerator(runner, cache)
    gen.add("a", pa, 6, chunk_size=8)
    gen.add("b", pb, 6)
    results = gen.run()
    check(name, results["a"], pa, 6, chunk=8)
    check(name, results["b"], pb, 6)


@pytest.mark.parametrize("name", RESUMABLE)
def test_prefix_reused_from_another_request(name: str) -> None:
    runner, cache, layout = setup(name)
    pa = prompt(10, 16)
    pb = pa + prompt(11, 5)
    gen = PagedGenerator(runner, cache)
    gen.add("a", pa, 8)
    gen.step()  # a's prefill: 16 tokens, ends on a block boundary -> state checkpoint at 16
    gen.add("b", pb, 6, prefix_of="a", prefix_len=16)
    for g in layout.groups:
        if g.spec.kind is CacheKind.STATE:
            continue
        shared = cache.block_table("a", g.group_id)[:4]
        got = cache.block_table("b", g.group_id)
        if g.spec.kind is CacheKind.SLIDING:
            # window 8 at 16 tokens reads tokens 9..15: blocks 2 and 3; 0 and 1 were released
            assert shared[:2] == (0, 0) and got == (0, 0, *shared[2:])
        elif g.spec.kind is CacheKind.CHUNKED:
            assert got == (0, 0, 0, 0)  # the next chunk starts at 16: nothing to share
        else:
            assert got == shared  # copy-free: the same block ids
    gen.step()
    step_b = next(r for r in gen.batches[-1].requests if r.request_id == "b")
    assert step_b.num_computed == 16 and step_b.token_ids == tuple(pb[16:])
    for gid, io in step_b.states.items():
        # b restores a's checkpoint at 16 tokens and continues in its own running slot
        assert io.read_slot == cache.checkpoint_slot("a", gid, 16) != io.write_slot
    results = gen.run()
    check(name, results["a"], pa, 8)
    check(name, results["b"], pb, 6, chunk=16)  # b's prompt ran as 16 cached + 5 new tokens
    cache.check_invariants()


@pytest.mark.parametrize("name", ["lfm2", "qwen3_next", "granitemoehybrid"])
def test_conv_state_stored_without_the_oldest_column(name: str) -> None:
    _, _, probe = _models(name)
    spec = probe_model_spec(probe)

    def trim(cache: Any) -> Any:
        if not isinstance(cache, StateSpec):
            return cache
        tensors = tuple(
            StateTensor(name=t.name, shape=(*t.shape[:-1], t.shape[-1] - 1), dtype=t.dtype)
            if t.name == "conv"
            else t
            for t in cache.tensors
        )
        return StateSpec(mixer=cache.mixer, tensors=tensors)

    trimmed = ModelSpec(
        name=spec.name,
        model_type=spec.model_type,
        layers=tuple(
            type(layer)(
                index=layer.index,
                layer_type=layer.layer_type,
                caches=tuple(trim(c) for c in layer.caches),
            )
            for layer in spec.layers
        ),
    )
    runner, cache, _ = setup(name, trimmed)
    p = prompt(12, 13)
    gen = PagedGenerator(runner, cache)
    gen.add("a", p, 6, chunk_size=5)
    check(name, gen.run()["a"], p, 6, chunk=5)
