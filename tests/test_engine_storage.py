"""The runner over hybridkv's real storage: planner layouts, every storage layout kind.

Layouts come from the planner (:func:`hybridkv.plan.make_plan`, all three strategies) with
8-token blocks and 2-token kernel blocks; storage buffers start as all-ones bytes (NaN in
float32) so reading memory nobody wrote poisons the logits.  Cross-layer layouts cannot give
kernel-granular views for kernel blocks smaller than the block; the runner then indexes the
manager-granular views itself.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from hybridkv.engine.models import load_model, reference_copy
from hybridkv.engine.probe import ModelProbe, probe_model, probe_model_spec
from hybridkv.engine.runner import ModelRunner
from hybridkv.engine.views import StorageViews
from hybridkv.plan import make_plan
from hybridkv.storage import KernelViewError, KVCacheStorage

from support.paged_generator import PagedGenerator
from support.reference import reference_chunked, reference_generate
from support.toy_cache import ToyCache

CASES = [
    ("arena", "cross_layer", "nhd"),
    ("pools", "per_layer", "hnd"),
    ("uniform", "cross_layer_head_major", "nhd"),
]
ARCHS = ["deepseek_v3", "gemma3_text", "lfm3", "qwen3_next"]


pytestmark = pytest.mark.usefixtures("one_thread")


@functools.cache
def _models(name: str) -> tuple[Any, Any, ModelProbe]:
    model = load_model(name)
    ref = reference_copy(model)
    return model, ref, probe_model(model)


def prompt(seed: int, length: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return [int(t) for t in torch.randint(0, 256, (length,), generator=gen)]


@pytest.mark.parametrize("name", ARCHS)
@pytest.mark.parametrize(("strategy", "kind", "order"), CASES)
def test_runner_is_exact_over_planned_storage(
    name: str, strategy: str, kind: str, order: str
) -> None:
    model, ref, probe = _models(name)
    plan = make_plan(
        probe_model_spec(probe),
        memory_bytes=2 << 20,
        max_model_len=64,
        strategy=strategy,
        block_size=8,
        kernel_block_size=2,
        state_block_size=8,
        chunk_alignment=4096,
    )
    layout = plan.layout
    storage = KVCacheStorage(layout, kind=kind, page_order=order)
    for buffer in storage.buffers:
        buffer.fill_(255)
    views = StorageViews(storage)
    runner = ModelRunner(model, layout, views, probe=probe)
    gen = PagedGenerator(runner, ToyCache(layout, views, poison_freed=True))
    prompts = {"a": prompt(1, 19), "b": prompt(2, 6), "c": prompt(3, 11)}
    gen.add("a", prompts["a"], 6, chunk_size=8)
    gen.add("b", prompts["b"], 6)
    gen.add("c", prompts["c"], 6)
    results = gen.run()
    for rid, p in prompts.items():
        want = reference_generate(ref, p, 6)
        assert results[rid].tokens == want.tokens
        if rid == "a":
            want = reference_chunked(ref, p, 8, 6)
        diff = max(
            float((x - y).abs().max())
            for x, y in zip(results[rid].logits, want.logits, strict=True)
        )
        assert diff < 1e-4


def test_cross_layer_storage_has_no_flat_kernel_views() -> None:
    # The case the runner's manager-view indexing exists for.
    _, _, probe = _models("gemma3_text")
    layout = make_plan(
        probe_model_spec(probe),
        memory_bytes=2 << 20,
        max_model_len=64,
        strategy="pools",
        block_size=8,
        kernel_block_size=2,
    ).layout
    storage = KVCacheStorage(layout, kind="cross_layer")
    with pytest.raises(KernelViewError):
        storage.kernel_kv_view(0)
    key, _ = StorageViews(storage).attention_kv(0, 0)
    assert tuple(key.shape[1:]) == (8, 2, 16)  # manager-granular fallback
