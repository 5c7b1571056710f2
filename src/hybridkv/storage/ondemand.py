"""On-demand physical memory for an arena: reserve the whole range, commit chunk by chunk.

:class:`OnDemandArena` reserves address space for ``num_chunks * chunk_bytes`` bytes up front
and backs a chunk with physical memory only while it is committed.  The memory is exposed as
one flat ``uint8`` torch tensor, so storage views and descriptors work unchanged.

Physical memory comes in *pages* of the backend's granularity (4 KiB on CPU, typically 2 MiB
for CUDA VMM).  A chunk's byte extents cover some pages fully (*exclusive* pages: no other
chunk touches them) and at most two pages partly per extent (*shared* pages, when
``chunk_bytes`` is not a page multiple).  Exclusive pages are mapped as one run per extent
when the chunk is committed and unmapped when it is released; a shared page is reference
counted over the committed chunks touching it and lives while any of them does, so releasing
one chunk never drops a neighbour's bytes.

Backends (a small protocol, :class:`PageBackend`):

* :class:`CpuMmapBackend`: anonymous ``mmap`` with ``MAP_NORESERVE``; Linux commits a page on
  first touch and ``madvise(MADV_DONTNEED)`` gives it back (it reads as zeros afterwards).
* :class:`hybridkv.storage.cuda_vmm.CudaVMMBackend`: the CUDA driver's virtual memory API.

Chunk ``0`` of an arena holds the null blocks (and the null host's blocks past them, see
:func:`hybridkv.plan.layout.null_host`); :meth:`KVCacheStorage.on_demand` commits it at once.
"""

from __future__ import annotations

import logging
import mmap
from collections.abc import Callable, Iterable
from typing import NamedTuple, Protocol

import torch

from hybridkv.errors import InvariantError, as_integer
from hybridkv.storage.errors import MemoryBackendError

__all__ = ["CpuMmapBackend", "OnDemandArena", "PageBackend", "PageRun", "chunk_page_runs"]

logger = logging.getLogger(__name__)

#: Linux's MAP_NORESERVE; the ``mmap`` module of Python < 3.13 does not export it.
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)


class PageRun(NamedTuple):
    """``pages`` pages from page ``first``; ``shared`` runs are one page other chunks touch."""

    first: int
    pages: int
    shared: bool


def chunk_page_runs(extents: Iterable[tuple[int, int]], page_bytes: int) -> list[PageRun]:
    """The page runs a chunk with byte ``extents`` needs, exclusive runs and shared pages.

    Example: 4 KiB pages, extent ``(6144, 12288)`` (bytes 6 KiB .. 18 KiB) -> shared page 1,
    exclusive pages 2..3, shared page 4.
    """
    runs: list[PageRun] = []
    shared: set[int] = set()

    def share(page: int) -> None:
        if page not in shared:  # two extents of one chunk may touch the same page
            shared.add(page)
            runs.append(PageRun(page, 1, True))

    for offset, length in extents:
        if length <= 0:
            continue
        end = offset + length
        first_full = -(-offset // page_bytes)
        end_full = end // page_bytes
        if first_full >= end_full:  # no full page: one or two partial pages
            for page in range(offset // page_bytes, -(-end // page_bytes)):
                share(page)
            continue
        if offset % page_bytes:
            share(offset // page_bytes)
        runs.append(PageRun(first_full, end_full - first_full, False))
        if end % page_bytes:
            share(end_full)
    return runs


class PageBackend(Protocol):
    """Reserved memory whose pages can be mapped and unmapped; ``tensor`` views all of it."""

    page_bytes: int

    @property
    def tensor(self) -> torch.Tensor: ...

    def map(self, first: int, count: int) -> None:
        """Back pages ``[first, first + count)`` with physical memory."""

    def unmap(self, first: int, count: int) -> None:
        """Give pages ``[first, first + count)`` back; exactly a run given to :meth:`map`."""

    def close(self) -> None: ...


class CpuMmapBackend:
    """Anonymous private ``MAP_NORESERVE`` mapping; pages commit on first touch.

    ``map`` is bookkeeping only unless ``populate`` is set, in which case it touches one byte
    per page (rewriting the byte it read, so data is unchanged) to commit the pages now.
    ``unmap`` calls ``madvise(MADV_DONTNEED)``: the pages are freed and read as zeros.
    """

    def __init__(self, total_bytes: int, *, populate: bool = False) -> None:
        self.page_bytes = mmap.PAGESIZE
        self.size = -(-total_bytes // self.page_bytes) * self.page_bytes
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE
        try:
            self._mm: mmap.mmap | None = mmap.mmap(-1, self.size, flags=flags)
        except OSError as exc:
            raise MemoryBackendError(
                f"total_bytes: cannot reserve {self.size} bytes of address space: {exc}"
            ) from None
        self._tensor = self._view_tensor()
        self.populate = populate

    def _view_tensor(self) -> torch.Tensor:
        """A tensor over the mapping through a ``memoryview`` of it: every tensor viewing the
        memory keeps that export alive, so the mapping cannot be closed under them
        (``torch.frombuffer`` of the mapping itself holds no export)."""
        assert self._mm is not None
        return torch.frombuffer(memoryview(self._mm), dtype=torch.uint8)

    @property
    def tensor(self) -> torch.Tensor:
        return self._tensor

    def map(self, first: int, count: int) -> None:
        if self.populate:
            start = first * self.page_bytes
            touched = self._tensor[start : start + count * self.page_bytes : self.page_bytes]
            touched.copy_(touched.clone())

    def unmap(self, first: int, count: int) -> None:
        if self._mm is None:
            raise MemoryBackendError("unmap: the mapping is closed")
        self._mm.madvise(mmap.MADV_DONTNEED, first * self.page_bytes, count * self.page_bytes)

    def close(self) -> None:
        """Unmap the range; raises :class:`MemoryBackendError`, changing nothing, while
        tensors other than :attr:`tensor` view it (drop them first)."""
        if self._mm is None:
            return
        del self._tensor
        try:
            self._mm.close()
        except BufferError:
            self._tensor = self._view_tensor()
            raise MemoryBackendError(
                "close: tensors still view this memory; drop them before closing"
            ) from None
        self._mm = None


class OnDemandArena:
    """An arena whose chunks hold physical memory only while committed.

    ``chunk_extents(c)`` gives the ``(offset, length)`` byte ranges chunk ``c`` owns (by
    default the contiguous ``[c * chunk_bytes, (c + 1) * chunk_bytes)``); ``backend`` defaults
    to :class:`CpuMmapBackend` on CPU.  Chunks in ``initial_chunks`` are committed at once.
    ``tail_bytes`` (an arena's bytes past its last whole chunk) make one more, shorter chunk,
    number ``num_chunks``.

    Invariants: every exclusive run of a committed chunk is mapped, of an uncommitted chunk
    unmapped; a shared page is mapped iff its count (committed chunks touching it) is positive.
    :meth:`check_invariants` verifies the counts and the chunk range; mapping follows from
    :meth:`commit` and :meth:`release` being the only callers of the backend.  A backend error
    during :meth:`release` (a driver failure, not bad input) is raised as is.
    """

    def __init__(
        self,
        *,
        chunk_bytes: int,
        num_chunks: int,
        backend: PageBackend | None = None,
        chunk_extents: Callable[[int], list[tuple[int, int]]] | None = None,
        initial_chunks: Iterable[int] = (),
        tail_bytes: int = 0,
    ) -> None:
        if not all(type(x) is int for x in (chunk_bytes, num_chunks, tail_bytes)):
            raise MemoryBackendError(
                "chunk_bytes, num_chunks, tail_bytes: must be integers, got "
                f"{chunk_bytes!r}, {num_chunks!r}, {tail_bytes!r}"
            )
        if chunk_bytes <= 0 or num_chunks <= 0:
            raise MemoryBackendError(
                f"chunk_bytes, num_chunks: must be positive, got {chunk_bytes}, {num_chunks}"
            )
        if not 0 <= tail_bytes < chunk_bytes:
            raise MemoryBackendError(
                f"tail_bytes: must be in [0, chunk_bytes {chunk_bytes}), got {tail_bytes}"
            )
        whole = num_chunks
        self.chunk_bytes = chunk_bytes
        self.num_chunks = num_chunks + (tail_bytes > 0)
        self.total_bytes = chunk_bytes * num_chunks + tail_bytes
        own = backend is None  # a backend made here is closed here if the start fails
        self.backend: PageBackend = backend or CpuMmapBackend(self.total_bytes)
        self._extents = chunk_extents or (
            lambda c: [(c * chunk_bytes, tail_bytes if c == whole else chunk_bytes)]
        )
        self._runs: dict[int, list[PageRun]] = {}
        self._committed: set[int] = set()
        self._shared: dict[int, int] = {}
        try:
            for chunk in initial_chunks:
                self.commit(chunk)
        except BaseException:
            for chunk in sorted(self._committed):
                self.release(chunk)
            if own:
                self.backend.close()
            raise

    @classmethod
    def on_cpu(
        cls,
        *,
        chunk_bytes: int,
        num_chunks: int,
        populate: bool = False,
        chunk_extents: Callable[[int], list[tuple[int, int]]] | None = None,
        initial_chunks: Iterable[int] = (),
    ) -> OnDemandArena:
        """A CPU arena over :class:`CpuMmapBackend` (``populate`` commits pages eagerly)."""
        return cls(
            chunk_bytes=chunk_bytes,
            num_chunks=num_chunks,
            backend=CpuMmapBackend(chunk_bytes * num_chunks, populate=populate),
            chunk_extents=chunk_extents,
            initial_chunks=initial_chunks,
        )

    @property
    def tensor(self) -> torch.Tensor:
        """Flat ``uint8`` view of the whole reserved range (``total_bytes`` long)."""
        return self.backend.tensor[: self.total_bytes]

    @property
    def committed_chunks(self) -> frozenset[int]:
        return frozenset(self._committed)

    @property
    def committed_bytes(self) -> int:
        """Bytes of the committed chunks (``chunk_bytes`` each, the tail shorter)."""
        return sum(n for c in self._committed for _, n in self._extents(c))

    @property
    def mapped_pages(self) -> int:
        """Pages the backend holds now (exclusive runs plus live shared pages)."""
        exclusive = sum(
            r.pages for c in self._committed for r in self._page_runs(c) if not r.shared
        )
        return exclusive + sum(1 for n in self._shared.values() if n > 0)

    def is_committed(self, chunk: int) -> bool:
        chunk = self._check_chunk(chunk)
        return chunk in self._committed

    def commit(self, chunk: int) -> bool:
        """Back ``chunk`` with physical memory; return False if it already was.

        All or nothing: if the backend fails midway, the pages mapped by this call are unmapped
        again and :class:`MemoryBackendError` is raised.
        """
        chunk = self._check_chunk(chunk)
        if chunk in self._committed:
            return False
        done: list[PageRun] = []
        try:
            for run in self._page_runs(chunk):
                if not run.shared or self._shared.get(run.first, 0) == 0:
                    self.backend.map(run.first, run.pages)
                    done.append(run)
        except Exception as exc:
            for run in reversed(done):
                self.backend.unmap(run.first, run.pages)
            raise MemoryBackendError(f"commit: chunk {chunk} could not be mapped: {exc}") from exc
        for run in self._page_runs(chunk):
            if run.shared:
                self._shared[run.first] = self._shared.get(run.first, 0) + 1
        self._committed.add(chunk)
        logger.debug("committed chunk %d", chunk)
        return True

    def release(self, chunk: int) -> bool:
        """Give ``chunk``'s physical memory back (its bytes are lost); False if not committed."""
        chunk = self._check_chunk(chunk)
        if chunk not in self._committed:
            return False
        for run in self._page_runs(chunk):
            if run.shared:
                left = self._shared[run.first] - 1
                if left == 0:
                    self.backend.unmap(run.first, 1)
                    del self._shared[run.first]
                else:
                    self._shared[run.first] = left
            else:
                self.backend.unmap(run.first, run.pages)
        self._committed.discard(chunk)
        logger.debug("released chunk %d", chunk)
        return True

    def close(self) -> None:
        """Give the reservation back, every committed chunk's memory with it.  The backend
        closes first: when it refuses (:class:`MemoryBackendError`: the CPU backend while
        tensors still view its memory) every chunk stays committed, bytes unchanged."""
        self.backend.close()
        self._committed.clear()
        self._shared.clear()

    def check_invariants(self) -> None:
        counts: dict[int, int] = {}
        for chunk in self._committed:
            for run in self._page_runs(chunk):
                if run.shared:
                    counts[run.first] = counts.get(run.first, 0) + 1
        if counts != self._shared:
            raise InvariantError(f"shared page counts {self._shared} != expected {counts}")
        if any(not 0 <= c < self.num_chunks for c in self._committed):
            raise InvariantError(f"committed chunks out of range: {sorted(self._committed)}")

    def _page_runs(self, chunk: int) -> list[PageRun]:
        runs = self._runs.get(chunk)
        if runs is None:
            extents = self._extents(chunk)
            for off, n in extents:
                if off < 0 or n < 0 or off + n > self.total_bytes:
                    raise MemoryBackendError(
                        f"chunk_extents: chunk {chunk} has ({off}, {n}), outside the "
                        f"reservation [0, {self.total_bytes})"
                    )
            runs = chunk_page_runs(extents, self.backend.page_bytes)
            self._runs[chunk] = runs
        return runs

    def _check_chunk(self, chunk: int) -> int:
        index = as_integer(chunk)
        if index is None or not 0 <= index < self.num_chunks:
            raise MemoryBackendError(
                f"chunk: {chunk!r} is out of range; valid chunks are [0, {self.num_chunks})"
            )
        return index
