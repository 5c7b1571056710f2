"""On-demand memory: RSS follows commits on CPU; the VMM call sequence (fake driver); GPU."""

from __future__ import annotations

import mmap
import os
import re
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from hybridkv.errors import StorageError
from hybridkv.storage import (
    KVCacheStorage,
    LayoutKind,
    LayoutUnsupportedError,
    MemoryBackendError,
    OnDemandArena,
)
from hybridkv.storage.cuda_vmm import CudaVMMBackend
from hybridkv.storage.ondemand import PageRun, chunk_page_runs
from test_storage_factories import SPECS, arena_layout, build, equal_slots, group, mixed_groups

MiB = 1 << 20
CHUNK = 32 * MiB
#: RSS tolerance: allocator and interpreter noise stays far below one 32 MiB chunk.
TOLERANCE = 6 * MiB


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_resident_memory_follows_touch_and_release() -> None:
    arena = OnDemandArena.on_cpu(chunk_bytes=CHUNK, num_chunks=4)
    mem = arena.tensor
    assert mem.numel() == 4 * CHUNK and arena.committed_bytes == 0
    base = _rss()
    assert arena.commit(1) and arena.commit(2)
    assert abs(_rss() - base) < TOLERANCE  # committing reserves nothing until first touch
    mem[CHUNK : 2 * CHUNK].fill_(7)
    one = _rss()
    assert abs(one - base - CHUNK) < TOLERANCE
    mem[2 * CHUNK : 3 * CHUNK].fill_(9)
    two = _rss()
    assert abs(two - one - CHUNK) < TOLERANCE
    assert arena.committed_bytes == 2 * CHUNK
    assert arena.release(1)
    assert abs(two - _rss() - CHUNK) < TOLERANCE  # chunk 1's pages went back
    assert not arena.is_committed(1) and arena.is_committed(2)
    assert arena.committed_bytes == CHUNK
    assert int(mem[2 * CHUNK : 3 * CHUNK].min()) == 9  # the neighbour kept its data
    assert int(mem[CHUNK : 2 * CHUNK].max()) == 0  # released pages read as zeros
    arena.release(2)
    arena.check_invariants()
    del mem


def test_populate_commits_without_touching() -> None:
    arena = OnDemandArena.on_cpu(chunk_bytes=CHUNK, num_chunks=2, populate=True)
    base = _rss()
    arena.commit(1)
    assert abs(_rss() - base - CHUNK) < TOLERANCE
    arena.release(1)
    assert abs(_rss() - base) < TOLERANCE


def test_unaligned_chunks_keep_shared_pages_for_neighbours() -> None:
    page = mmap.PAGESIZE
    chunk = page + page // 2  # chunks share pages
    arena = OnDemandArena.on_cpu(chunk_bytes=chunk, num_chunks=4, initial_chunks=(0, 1))
    mem = arena.tensor
    mem[:chunk].fill_(1)
    mem[chunk : 2 * chunk].fill_(2)
    arena.release(1)  # its pages shared with chunk 0 must survive
    assert int(mem[:chunk].min()) == 1
    arena.check_invariants()
    assert arena.commit(1) is True and arena.commit(1) is False
    assert arena.release(3) is False
    with pytest.raises(MemoryBackendError, match=r"chunk: 4 is out of range; valid .* \[0, 4\)"):
        arena.commit(4)


def test_chunk_page_runs() -> None:
    k = 4096
    assert chunk_page_runs([(6 * 1024, 12 * 1024)], k) == [
        PageRun(1, 1, True),
        PageRun(2, 2, False),
        PageRun(4, 1, True),
    ]
    assert chunk_page_runs([(0, 2 * k)], k) == [PageRun(0, 2, False)]
    assert chunk_page_runs([(100, 200), (400, 100)], k) == [PageRun(0, 1, True)]


# --------------------------------------------------------------------------- fake VMM driver


class FakeDriver:
    """Records VMM calls; optionally fails one named call."""

    def __init__(self, granularity: int = 4096, fail: str | None = None) -> None:
        self.CUresult = SimpleNamespace(CUDA_SUCCESS=0, CUDA_ERROR_OUT_OF_MEMORY=2)
        self.CUmemAllocationType = SimpleNamespace(CU_MEM_ALLOCATION_TYPE_PINNED=1)
        self.CUmemLocationType = SimpleNamespace(CU_MEM_LOCATION_TYPE_DEVICE=1)
        self.CUmemAccess_flags = SimpleNamespace(CU_MEM_ACCESS_FLAGS_PROT_READWRITE=3)
        self.CUmemAllocationGranularity_flags = SimpleNamespace(CU_MEM_ALLOC_GRANULARITY_MINIMUM=0)
        self.CUdeviceptr = int
        self.granularity = granularity
        self.fail = fail
        self.calls: list[tuple[Any, ...]] = []
        self.mapped: dict[int, int] = {}
        self.handles: set[int] = set()
        self._next = 100

    def CUmemAllocationProp(self) -> Any:
        return SimpleNamespace(type=None, location=SimpleNamespace(type=None, id=None))

    def CUmemAccessDesc(self) -> Any:
        return SimpleNamespace(flags=None, location=SimpleNamespace(type=None, id=None))

    def _result(self, name: str, *values: Any) -> tuple[Any, ...]:
        if self.fail == name:
            self.fail = None
            return (2,)
        return (0, *values)

    def cuInit(self, flags: int) -> tuple[Any, ...]:
        return self._result("cuInit")

    def cuCtxGetCurrent(self) -> tuple[Any, ...]:
        return self._result("cuCtxGetCurrent", 1)

    def cuMemGetAllocationGranularity(self, prop: Any, option: int) -> tuple[Any, ...]:
        return self._result("gran", self.granularity)

    def cuMemAddressReserve(self, size: int, align: int, addr: int, flags: int) -> tuple[Any, ...]:
        self.calls.append(("reserve", size))
        return self._result("cuMemAddressReserve", 1 << 30)

    def cuMemCreate(self, size: int, prop: Any, flags: int) -> tuple[Any, ...]:
        self._next += 1
        out = self._result("cuMemCreate", self._next)
        if out[0] == 0:
            self.handles.add(self._next)
        return out

    def cuMemMap(
        self, ptr: int, size: int, offset: int, handle: int, flags: int
    ) -> tuple[Any, ...]:
        out = self._result("cuMemMap")
        if out[0] == 0:
            self.mapped[ptr - (1 << 30)] = size
            self.calls.append(("map", ptr - (1 << 30), size))
        return out

    def cuMemSetAccess(self, ptr: int, size: int, desc: list[Any], count: int) -> tuple[Any, ...]:
        assert desc[0].flags == 3 and count == 1
        return self._result("cuMemSetAccess")

    def cuMemUnmap(self, ptr: int, size: int) -> tuple[Any, ...]:
        assert self.mapped.pop(ptr - (1 << 30)) == size
        self.calls.append(("unmap", ptr - (1 << 30), size))
        return (0,)

    def cuMemRelease(self, handle: int) -> tuple[Any, ...]:
        self.handles.remove(handle)
        return (0,)

    def cuMemAddressFree(self, ptr: int, size: int) -> tuple[Any, ...]:
        self.calls.append(("free", size))
        return (0,)


def test_vmm_backend_maps_runs_and_refcounts_shared_pages() -> None:
    drv = FakeDriver()
    k = 4096
    backend = CudaVMMBackend(4 * 6 * 1024, driver=drv)
    arena = OnDemandArena(chunk_bytes=6 * 1024, num_chunks=4, backend=backend)
    assert drv.calls == [("reserve", 24 * 1024)]
    arena.commit(1)  # bytes [6K, 12K): shared page 1, exclusive page 2
    assert drv.mapped == {k: k, 2 * k: k}
    arena.commit(0)  # bytes [0, 6K): exclusive page 0, page 1 already mapped
    assert drv.mapped == {0: k, k: k, 2 * k: k}
    arena.release(1)  # page 1 stays for chunk 0
    assert drv.mapped == {0: k, k: k}
    arena.release(0)
    assert drv.mapped == {} and drv.handles == set()
    assert backend.mapped_bytes == 0
    assert arena.commit(np.int64(2)) and arena.is_committed(2)  # a numpy id is an id
    with pytest.raises(MemoryBackendError, match=r"chunk: True is out of range"):
        arena.commit(True)
    arena.close()
    assert drv.calls[-1] == ("free", 24 * 1024) and drv.handles == set()


def test_vmm_failed_commit_leaves_nothing_mapped() -> None:
    drv = FakeDriver()
    backend = CudaVMMBackend(4 * 8192, driver=drv)
    arena = OnDemandArena(chunk_bytes=8192, num_chunks=4, backend=backend)
    drv.fail = "cuMemSetAccess"
    with pytest.raises(MemoryBackendError, match="cuMemSetAccess: CUDA driver error 2"):
        arena.commit(1)
    assert drv.mapped == {} and drv.handles == set() and not arena.is_committed(1)
    arena.check_invariants()
    with pytest.raises(MemoryBackendError, match="commit chunk 0"):
        _ = backend.tensor


def test_on_demand_storage_views_live_in_committed_chunks() -> None:
    # page-multiple chunks: releasing chunk 1 then frees every page it holds
    layout = arena_layout(equal_slots(mixed_groups()), num_chunks=3, per=4096)
    storage = KVCacheStorage.on_demand(layout)
    assert storage.memory is not None and storage.memory.committed_chunks == {0}
    storage.memory.commit(1)
    per = layout.blocks_per_chunk(0)
    storage.kv_view(0).key[per].fill_(3.0)
    assert storage.descriptor(0, [per]).total_bytes == layout.groups[0].used_block_bytes
    storage.memory.release(1)
    assert int(storage.kv_view(0).key[per].abs().max()) == 0
    storage.check_invariants()
    per_layer = KVCacheStorage.on_demand(layout, kind=LayoutKind.PER_LAYER)
    assert per_layer.memory is not None
    assert per_layer.memory.mapped_pages >= 1
    with pytest.raises(LayoutUnsupportedError, match="needs the arena strategy"):
        KVCacheStorage.on_demand(build("pools", mixed_groups()))


@pytest.mark.gpu
def test_cuda_vmm_commit_release_round_trip() -> None:
    pytest.importorskip("cuda.bindings.driver")
    g = group(0, SPECS["full"], (0, 1), block_size=16)
    layout = arena_layout((g,), num_chunks=4, per=4096)  # 64 MiB chunks for 16 KiB blocks
    storage = KVCacheStorage.on_demand(layout, device="cuda")
    memory = storage.memory
    assert memory is not None and storage.device.type == "cuda"
    memory.commit(2)
    per = layout.blocks_per_chunk(0)
    key = storage.kv_view(1).key
    key[2 * per : 3 * per].fill_(1.5)
    torch.cuda.synchronize()
    assert float(key[2 * per].float().mean()) == 1.5
    host = storage.descriptor(0, [2 * per])
    assert host.total_bytes == g.used_block_bytes
    memory.release(2)
    memory.commit(2)
    memory.check_invariants()
    del key
    memory.release(2)


def test_the_tail_past_the_last_chunk_is_committed_at_once_and_holds_its_host_blocks() -> None:
    base = arena_layout(equal_slots(mixed_groups()), num_chunks=3, per=4096)
    assert base.arena is not None
    chunk = base.arena.chunk_bytes
    host_group = min(base.groups, key=lambda g: g.block_bytes)
    tail = 5 * host_group.block_bytes  # five of its blocks past chunk 2
    layout = replace(base, arena=replace(base.arena, tail_bytes=tail))
    host = layout.tail_host
    assert host is not None and host.end - host.first == 5
    for kind in (LayoutKind.CROSS_LAYER, LayoutKind.PER_LAYER):
        storage = KVCacheStorage.on_demand(layout, kind=kind)
        memory = storage.memory
        assert memory is not None and memory.committed_chunks == {0, 3}
        assert memory.num_chunks == 4 and memory.total_bytes == 3 * chunk + tail
        assert memory.committed_bytes == chunk + tail
        placement = storage.placement
        extents = placement.chunk_extents(3)
        assert sum(n for _, n in extents) == tail
        gp = placement.groups[host.group_id]
        for b in range(host.first, host.end):
            for off, length in gp.block_extents(b):
                assert any(s <= off and off + length <= s + n for s, n in extents), (kind, b)
        storage.check_invariants()
        with pytest.raises(MemoryBackendError, match=r"chunk: 4 is out of range"):
            memory.commit(4)
    with pytest.raises(MemoryBackendError, match=r"tail_bytes: must be in \[0, chunk_bytes"):
        OnDemandArena(chunk_bytes=4096, num_chunks=2, tail_bytes=4096)


def test_closing_memory_that_tensors_still_view_is_refused_and_changes_nothing() -> None:
    # torch.frombuffer of the mapping held no export: close() unmapped memory under live
    # views, and the next read crashed the process.
    layout = arena_layout(mixed_groups())
    storage = KVCacheStorage.on_demand(layout, kind=LayoutKind.CROSS_LAYER)
    memory = storage.memory
    assert memory is not None
    memory.commit(1)
    view = storage.buffers[0][memory.chunk_bytes : memory.chunk_bytes + 8]
    view.fill_(3)
    with pytest.raises(MemoryBackendError, match="tensors still view this memory"):
        storage.close()
    assert storage.memory is memory and 1 in memory.committed_chunks
    assert int(view.sum()) == 24 and int(storage.buffers[0][memory.chunk_bytes]) == 3
    memory.check_invariants()
    del view
    storage.close()
    assert storage.memory is None and storage.buffers == ()
    storage.close()  # twice: nothing


def test_storage_refuses_a_device_it_cannot_use() -> None:
    layout = arena_layout(mixed_groups())
    for device, message in (
        ("nope", "device: cannot parse 'nope'; valid: cpu, cuda or cuda:N"),
        ("cpu:3", "device: 'cpu:3': the CPU is one device (cpu or cpu:0)"),
    ):
        with pytest.raises(StorageError, match=re.escape(message)):
            KVCacheStorage(layout, device=device)
        with pytest.raises(StorageError, match=re.escape(message)):
            KVCacheStorage.on_demand(layout, device=device)


def test_arena_refuses_extents_outside_its_reservation_and_odd_numbers() -> None:
    arena = OnDemandArena.on_cpu(
        chunk_bytes=4096, num_chunks=2, chunk_extents=lambda c: [(c * 4096, 8192)]
    )
    arena.commit(0)
    with pytest.raises(MemoryBackendError, match=r"chunk 1 has \(4096, 8192\), outside the res"):
        arena.commit(1)
    assert arena.committed_chunks == {0}
    with pytest.raises(MemoryBackendError, match="chunk: True is out of range"):
        arena.commit(True)
    with pytest.raises(MemoryBackendError, match=r"must be integers, got 4096\.5, 2, 0"):
        OnDemandArena(chunk_bytes=4096.5, num_chunks=2)  # type: ignore[arg-type]
    arena.close()


def test_vmm_close_goes_on_past_a_failing_unmap() -> None:
    drv = FakeDriver()
    backend = CudaVMMBackend(4 * 8192, driver=drv)
    arena = OnDemandArena(chunk_bytes=8192, num_chunks=4, backend=backend)
    arena.commit(0)
    arena.commit(2)
    real = drv.cuMemUnmap
    failed: list[int] = []

    def unmap_once(ptr: int, size: int) -> tuple[Any, ...]:
        if not failed:
            failed.append(ptr)
            return (2,)
        return real(ptr, size)

    drv.cuMemUnmap = unmap_once  # type: ignore[method-assign]
    with pytest.raises(MemoryBackendError, match="cuMemUnmap: CUDA driver error 2"):
        arena.close()
    # the other run was unmapped and the reservation freed all the same
    assert len(drv.mapped) == 1 and drv.calls[-1] == ("free", 4 * 8192)


def test_a_failed_start_leaves_nothing_committed() -> None:
    drv = FakeDriver()
    backend = CudaVMMBackend(4 * 8192, driver=drv)
    drv.fail = None
    calls = {"n": 0}
    real = drv.cuMemSetAccess

    def second_fails(ptr: int, size: int, desc: list[Any], count: int) -> tuple[Any, ...]:
        calls["n"] += 1
        return (2,) if calls["n"] == 2 else real(ptr, size, desc, count)

    drv.cuMemSetAccess = second_fails  # type: ignore[method-assign]
    with pytest.raises(MemoryBackendError, match="commit: chunk 1 could not be mapped"):
        OnDemandArena(chunk_bytes=8192, num_chunks=4, backend=backend, initial_chunks=(0, 1))
    assert drv.mapped == {} and drv.handles == set()  # chunk 0 given back too
