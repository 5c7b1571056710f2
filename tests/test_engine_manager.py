"""The whole stack: planner layout, real storage, the real cache manager and the runner.

Requests are admitted through :class:`hybridkv.cache.KVCacheManager` (prefix hits found by
hashing, state checkpoints and restores as the manager orders them) over an arena
:class:`hybridkv.storage.KVCacheStorage` whose buffers start as NaN, and must reproduce
transformers' greedy tokens and logits.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from hybridkv.cache import KVCacheManager
from hybridkv.engine.batch import StepBatch
from hybridkv.engine.errors import BatchError
from hybridkv.engine.models import TINY_MODELS, load_model, reference_copy
from hybridkv.engine.probe import ModelProbe, probe_model, probe_model_spec
from hybridkv.engine.runner import ModelRunner
from hybridkv.engine.views import StorageViews
from hybridkv.plan import make_plan
from hybridkv.specs import CacheKind
from hybridkv.storage import KVCacheStorage

from support.manager_cache import ManagerCache
from support.paged_generator import PagedGenerator
from support.reference import reference_chunked, reference_generate

ATOL = 1e-4


pytestmark = pytest.mark.usefixtures("one_thread")


@functools.cache
def _models(name: str) -> tuple[Any, Any, ModelProbe]:
    model = load_model(name)
    ref = reference_copy(model)
    return model, ref, probe_model(model)


def prompt(seed: int, length: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return [int(t) for t in torch.randint(0, 256, (length,), generator=gen)]


def stack(name: str) -> tuple[PagedGenerator, ManagerCache, KVCacheManager]:
    model, _, probe = _models(name)
    layout = make_plan(
        probe_model_spec(probe),
        memory_bytes=1 << 20,
        max_model_len=64,
        strategy="arena",
        block_size=4,
        kernel_block_size=2,
        state_block_size=8,
        chunk_alignment=4096,
    ).layout
    storage = KVCacheStorage(layout)
    for buffer in storage.buffers:
        buffer.fill_(255)
    manager = KVCacheManager(layout)
    cache = ManagerCache(manager)
    return (
        PagedGenerator(ModelRunner(model, layout, StorageViews(storage), probe=probe), cache),
        cache,
        manager,
    )


def close(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    diff = max(float((a - b).abs().max()) for a, b in zip(got, want, strict=True))
    assert diff < ATOL
    return diff


@pytest.mark.parametrize("name", sorted(n for n in TINY_MODELS if n != "jamba"))
def test_prefix_hit_from_the_manager_is_exact(name: str) -> None:
    # Jamba: transformers' Mamba1 cannot resume a prefill from a state (no hits to check).
    gen, cache, manager = stack(name)
    ref = _models(name)[1]
    shared = prompt(20, 16)
    pa, pb = shared + prompt(21, 3), shared + prompt(22, 5)
    gen.add("a", pa, 6, chunk_size=8)
    first = gen.run()["a"]
    gen.add("b", pb, 6, chunk_size=8)
    assert cache.hits == {"a": 0, "b": 16}  # a finished; its blocks and checkpoint are cached
    gen.step()
    step_b = gen.batches[-1].requests[0]
    assert (step_b.num_computed, step_b.token_ids) == (16, tuple(pb[16:]))
    for gid, io in step_b.states.items():
        # restore the checkpoint at 16 tokens into the running slot, then run from it
        assert io.read_slot == io.write_slot
        assert len(io.copies_before) == 1 and io.copies_before[0].dst == io.write_slot
        assert manager.layout.groups[gid].spec.kind is CacheKind.STATE
    second = gen.run()["b"]
    assert first.tokens == reference_generate(ref, pa, 6).tokens
    assert second.tokens == reference_generate(ref, pb, 6).tokens
    close(first.logits, reference_chunked(ref, pa, 8, 6).logits)
    close(second.logits, reference_chunked(ref, pb, 8, 6).logits)
    manager.check_invariants()


@pytest.mark.parametrize("name", ["gemma3_text", "lfm3", "qwen3_next", "deepseek_v3"])
def test_concurrent_requests_through_the_manager(name: str) -> None:
    gen, _, manager = stack(name)
    ref = _models(name)[1]
    prompts = {"a": prompt(30, 13), "b": prompt(31, 4), "c": prompt(32, 9)}
    for rid, p in prompts.items():
        gen.add(rid, p, 7)
    results = gen.run()
    for rid, p in prompts.items():
        want = reference_generate(ref, p, 7)
        assert results[rid].tokens == want.tokens
        close(results[rid].logits, want.logits)
    manager.check_invariants()
    assert manager.usage == 0.0


def test_manager_cache_refuses_explicit_prefixes() -> None:
    gen, cache, _ = stack("llama")
    with pytest.raises(BatchError, match="finds prefix hits itself"):
        cache.add("x", [1, 2, 3], prefix_of="y", prefix_len=4)
    assert gen.done


def test_zeroed_slots_come_from_the_manager() -> None:
    gen, cache, _ = stack("lfm2")
    cache.add("a", prompt(40, 5))
    step = cache.schedule("a", prompt(40, 5))
    (io,) = step.states.values()
    assert io.read_slot is None and io.zero_before == (io.write_slot,)
    assert io.copies_before == () and io.copies_after == ()
    out = gen.runner.execute(StepBatch(requests=(step,)))
    assert out.logits["a"].isfinite().all()
