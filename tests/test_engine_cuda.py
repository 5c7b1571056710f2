"""The engine with its cache on CUDA (gpu marker: skipped without a CUDA device): prefixes
that come back from the pinned host tier and from the disk tier give the tokens transformers
gives on the same device, for every tiered architecture, state models included."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch

import test_engine_disk
import test_engine_write_through
from hybridkv.engine import CacheConfig, LLMEngine, verify_completions
from hybridkv.engine.models import load_model
from hybridkv.scheduler import SchedulerConfig
from hybridkv.storage import KVCacheStorage, LayoutKind, gather, scatter
from test_engine_scheduler import TIERED_COMPACTION, serve_three_at_a_time
from test_engine_tiers import MODELS, STATE, conversations
from test_storage_factories import mixed_groups, pools_layout

pytestmark = pytest.mark.gpu
DEVICE = "cuda"

TURNS = conversations(1, n_conv=5, turns=4, first=32, step=10)


@functools.cache
def _reference(name: str) -> Any:
    return load_model(name).to("cuda")


def _engine(name: str, host: int | None, disk: Path | None = None) -> LLMEngine:
    # As in test_engine_disk: each conversation is evicted by the four others between turns.
    return test_engine_disk._engine(name, disk, host, device="cuda")


def _serve(engine: LLMEngine) -> list[Any]:
    done = []
    for i, prompt in enumerate(TURNS):
        done += engine.generate({f"r{i}": prompt}, max_tokens=4)
    return done


def _exact(name: str, done: list[Any]) -> None:
    result = verify_completions(_reference(name), done)
    assert result.ok, result.mismatches


@pytest.mark.parametrize("name", MODELS)
def test_host_tier_on_cuda_is_pinned_and_exact(name: str) -> None:
    engine = _engine(name, 64 << 20)
    assert engine.storage.device.type == "cuda"
    done = _serve(engine)
    _exact(name, done)
    stats = engine.stats()
    # The same hits as on the CPU: the bookkeeping does not depend on the device.
    want = {"lfm2": 592}.get(name, 600 if name in STATE else 620)
    assert stats.prefix_hit_tokens == stats.host_hit_tokens == want
    store = engine._tier_store
    assert store is not None and store.loaded > 0 and store._slots is not None
    assert store._slots.buffer.is_pinned()
    engine.check_invariants()


@pytest.mark.parametrize("name", MODELS)
def test_disk_tier_on_cuda_is_exact_and_reused_by_a_later_engine(name: str, tmp_path: Path) -> None:
    engine = _engine(name, None, tmp_path)
    _exact(name, _serve(engine))
    want = {"lfm2": 592}.get(name, 600 if name in STATE else 620)
    assert engine.stats().disk_hit_tokens == want
    engine.close()
    again = _engine(name, 1 << 20, tmp_path)
    _exact(name, _serve(again))
    st = again.stats()
    assert st.disk_hit_tokens > 0 and st.prefix_hit_tokens > want
    again.check_invariants()
    again.close()


@pytest.mark.parametrize("name", ["llama", "qwen3_next"])
@pytest.mark.parametrize("through", ["host", "disk"])
def test_write_through_on_cuda_is_exact(name: str, through: str, tmp_path: Path) -> None:
    """A step's write-through stores queue after its pass on the stream; the hits (from host
    memory, or from disk with no host tier) are write-back's and the tokens transformers'."""
    engine = test_engine_write_through._engine(
        name,
        host=64 << 20 if through == "host" else None,
        disk=tmp_path if through == "disk" else None,
        through=through,
        device="cuda",
    )
    _exact(name, _serve(engine))
    stats = engine.stats()
    want = 600 if name in STATE else 620
    assert stats.prefix_hit_tokens == want
    assert (stats.host_hit_tokens if through == "host" else stats.disk_hit_tokens) == want
    assert engine.manager.tier_stats()[through]["cold_blocks"] > 0  # copies never evicted
    engine.check_invariants()
    engine.close()


def test_cuda_and_cpu_engines_agree_on_every_token() -> None:
    """The same requests through a CPU and a CUDA engine: identical tokens (float32)."""
    prompts = {f"r{i}": p for i, p in enumerate(TURNS[:6])}
    cpu = LLMEngine("qwen3_next", cache=CacheConfig(block_size=4, state_block_size=8))
    gpu = LLMEngine(
        "qwen3_next", cache=CacheConfig(block_size=4, state_block_size=8), device="cuda"
    )
    a = {c.request_id: c.token_ids for c in cpu.generate(prompts, max_tokens=6)}
    b = {c.request_id: c.token_ids for c in gpu.generate(prompts, max_tokens=6)}
    assert a == b
    assert torch.cuda.is_available()


@pytest.mark.parametrize("kind", [LayoutKind.PER_LAYER, LayoutKind.CROSS_LAYER])
def test_batched_cuda_gather_and_scatter_equal_the_cpu_copies(kind: LayoutKind) -> None:
    """Several ranges on CUDA are packed by one batched kernel and unpacked by a multi-tensor
    copy: the same bytes, in the same order, as the CPU's copy per range, into pinned host
    memory and back (asynchronously), and device to device."""
    layout = pools_layout(mixed_groups(), num_blocks=8)  # every kind of group, ids 1..7
    cpu = KVCacheStorage(layout, kind=kind)
    gpu = KVCacheStorage(layout, kind=kind, device="cuda")
    gen = torch.Generator().manual_seed(3)
    for a, b in zip(cpu.buffers, gpu.buffers, strict=True):
        a.copy_(torch.randint(0, 256, a.shape, generator=gen, dtype=torch.uint8))
        b.copy_(a)
    for gid, g in enumerate(layout.groups):
        ids = [1, 5, 2]
        desc = cpu.descriptor(gid, ids)
        assert desc == gpu.descriptor(gid, ids)
        want = gather(desc, cpu.buffers)
        pinned = torch.empty(desc.total_bytes, dtype=torch.uint8, pin_memory=True)
        gather(desc, gpu.buffers, pinned, non_blocking=True)
        torch.cuda.current_stream().synchronize()
        assert torch.equal(pinned, want), g
        assert torch.equal(gather(desc, gpu.buffers).cpu(), want)
        # back into the other half of the group's blocks, asynchronously from pinned memory
        other = [7, 3, 4]
        back_cpu = cpu.descriptor(gid, other)
        scatter(back_cpu, cpu.buffers, want)
        scatter(gpu.descriptor(gid, other), gpu.buffers, pinned, non_blocking=True)
        torch.cuda.current_stream().synchronize()
        for a, b in zip(cpu.buffers, gpu.buffers, strict=True):
            assert torch.equal(a, b.cpu())


def test_compaction_beside_a_host_tier_on_cuda_is_exact() -> None:
    # test_engine_scheduler's tiered compaction workload with the cache on CUDA: the moves
    # run in the tier stream as gathers and scatters on the step's stream, after the host
    # stores that read the blocks they overwrite (storage poisoned with NaN first).
    engine = LLMEngine(
        "gemma3_text",
        cache=TIERED_COMPACTION,
        scheduler=SchedulerConfig(token_budget=16),
        keep_logits=True,
        device=DEVICE,
    )
    for buffer in engine.storage.buffers:
        buffer.fill_(0xFF)
    _exact("gemma3_text", serve_three_at_a_time(engine))
    stats = engine.stats()
    assert (stats.moved_blocks, stats.host_hit_tokens, stats.preemptions) == (8, 216, 4)
    engine.check_invariants()
