"""The storage facade: backing buffers for a :class:`MemoryLayout`, views, tables, descriptors.

>>> from hybridkv.plan import ArenaPlan, GroupPlan, MemoryLayout, Strategy
>>> from hybridkv.specs import FullAttentionSpec
>>> spec = FullAttentionSpec(num_kv_heads=2, head_dim=4, dtype="fp16")
>>> group = GroupPlan(group_id=0, spec=spec, members=((0, 0), (1, 0)), block_size=4,
...                   kernel_block_size=4, page_bytes=spec.bytes_per_block(4))
>>> layout = MemoryLayout(strategy=Strategy.ARENA, groups=(group,),
...                       arena=ArenaPlan(chunk_bytes=4 * 256, num_chunks=2))
>>> storage = KVCacheStorage(layout)
>>> tuple(storage.kv_view(1).key.shape)     # [N, block_size, kv_heads, head_dim]
(8, 4, 2, 4)
>>> storage.descriptor(0, [1, 2, 3]).ranges  # blocks 1..3 are one contiguous range
(ByteRange(buffer_id=0, offset=256, length=768),)

Buffers: the arena strategy has one flat ``uint8`` buffer of ``arena.total_bytes``; ``uniform``
and ``pools`` have one per pool, buffer ``i`` of ``pools[i].total_bytes``.  Where each byte of
a member page sits is :mod:`hybridkv.storage.placement`'s business; views are built in
:mod:`hybridkv.storage.views`.  Nothing here mutates buffer contents except the caller writing
through the views or the transfer functions.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import torch

from hybridkv.errors import StorageError, as_integer
from hybridkv.plan import GroupPlan, MemoryLayout
from hybridkv.specs import CacheKind
from hybridkv.storage.block_table import BlockTable, kernel_ratio
from hybridkv.storage.errors import (
    BlockRangeError,
    LayoutUnsupportedError,
    MemoryBackendError,
    StorageAllocationError,
    ViewKindError,
)
from hybridkv.storage.ondemand import CpuMmapBackend, OnDemandArena, PageBackend
from hybridkv.storage.placement import (
    GroupPlacement,
    LayoutKind,
    MemberPlacement,
    PageOrder,
    StoragePlacement,
    place,
)
from hybridkv.storage.segments import HEADED_KINDS
from hybridkv.storage.transfer import (
    BlockLiveness,
    TransferDescriptor,
    build_descriptor,
    copy_blocks,
    gather,
    scatter,
)
from hybridkv.storage.views import kernel_block_view, segment_tensor
from hybridkv.units import format_bytes_exact

__all__ = ["MOVE_RUN_BYTES", "KVCacheStorage", "KVView", "allocate_bytes"]

#: Most bytes one run of :meth:`KVCacheStorage.move_blocks` copies (a larger block is a run
#: of its own): on CUDA a run passes through scratch on the device, and compaction runs when
#: memory is tight (gemma-3-27b moved 62 sliding-window blocks, ~400 MiB, in one step).
MOVE_RUN_BYTES = 32 << 20


def allocate_bytes(
    sizes: Sequence[int], device: torch.device, pin: bool, field: str, *, zeroed: bool = True
) -> list[torch.Tensor]:
    """Byte buffers of ``sizes`` on ``device`` (pinned host memory with ``pin``; zeroed
    unless ``zeroed`` is False).
    Raises :class:`StorageAllocationError` naming ``field`` (the budget that asked for
    them) and the bytes when the device or host cannot hold them, not torch's error."""
    problem = device_problem(torch.device(device))
    if problem:
        raise StorageAllocationError(
            f"{field}: cannot allocate {format_bytes_exact(sum(sizes))} on {device}: {problem}"
        )
    try:
        make = torch.zeros if zeroed else torch.empty
        return [make(n, dtype=torch.uint8, device=device, pin_memory=pin) for n in sizes]
    except (RuntimeError, AssertionError) as exc:  # torch.OutOfMemoryError is one; torch
        # asserts on a backend it was not built with
        total = sum(sizes)
        text = str(exc).strip()
        if "memory" in text.lower():
            reason = "not enough memory there"
        else:
            reason = text.splitlines()[0] if text else type(exc).__name__
        raise StorageAllocationError(
            f"{field}: cannot allocate {format_bytes_exact(total)} on {device} "
            f"({reason}); give a smaller size"
        ) from exc


class KVView(NamedTuple):
    """Key and value views of one attention layer (same block and token indexing)."""

    key: torch.Tensor
    value: torch.Tensor


class KVCacheStorage:
    """Backing memory for ``layout`` with layout ``kind`` on ``device``.

    ``buffers`` (optional) supplies the flat ``uint8`` buffers (e.g. shared memory); they must
    be at least as long as the layout needs.  Otherwise zero-filled buffers are allocated
    (``pin_memory`` pins CPU buffers, when CUDA is present).  Raises
    :class:`LayoutUnsupportedError` when ``kind`` cannot place ``layout`` and
    :class:`StorageError` for unfit buffers.
    """

    def __init__(
        self,
        layout: MemoryLayout,
        *,
        kind: LayoutKind | str = LayoutKind.CROSS_LAYER,
        page_order: PageOrder | str = PageOrder.NHD,
        device: torch.device | str = "cpu",
        buffers: Sequence[torch.Tensor] | None = None,
        pin_memory: bool = False,
    ) -> None:
        self.placement: StoragePlacement = place(layout, kind, page_order)
        self.layout = layout
        sizes = self.placement.buffer_bytes
        if buffers is None:
            self.device = _device(device)
            pin = pin_memory and self.device.type == "cpu" and torch.cuda.is_available()
            buffers = allocate_bytes(sizes, self.device, pin, "memory_bytes")
        else:
            buffers = _listed_buffers(buffers)
            _check_buffers(buffers, sizes)
            self.device = buffers[0].device
        self.buffers: tuple[torch.Tensor, ...] = tuple(buffers)
        self.memory: OnDemandArena | None = None
        #: Per group, what its descriptors' bytes are (``TransferDescriptor.stream``).
        self._streams: dict[int, tuple[Any, ...]] = {}

    @classmethod
    def on_demand(
        cls,
        layout: MemoryLayout,
        *,
        kind: LayoutKind | str = LayoutKind.CROSS_LAYER,
        page_order: PageOrder | str = PageOrder.NHD,
        device: torch.device | str = "cpu",
        backend: PageBackend | None = None,
        populate: bool = False,
    ) -> KVCacheStorage:
        """An arena storage whose chunks hold physical memory only while committed.

        The returned storage's :attr:`memory` commits and releases chunks (chunk 0, the null
        blocks and the null host's blocks, and the tail past the last chunk, lent to the tail
        host, start committed and stay so).  CPU uses
        :class:`CpuMmapBackend`, CUDA :class:`hybridkv.storage.cuda_vmm.CudaVMMBackend` (needs
        ``cuda-bindings``).  Raises
        :class:`LayoutUnsupportedError` for a layout without an arena.
        """
        arena = layout.arena
        if arena is None:
            raise LayoutUnsupportedError(
                f"layout.strategy: on-demand memory needs the arena strategy, got "
                f"{layout.strategy.value!r}"
            )
        placement = place(layout, kind, page_order)
        dev = _device(device)
        given = backend is not None  # a backend made here is closed here if the arena fails
        if backend is None and dev.type not in ("cpu", "cuda"):
            raise StorageError(
                f"device: on-demand memory has a backend for cpu and cuda, got {str(device)!r} "
                "(pass backend= for another device)"
            )
        if backend is None:
            if dev.type == "cuda":
                from hybridkv.storage.cuda_vmm import CudaVMMBackend

                index = dev.index if dev.index is not None else torch.cuda.current_device()
                backend = CudaVMMBackend(arena.total_bytes, device=index)
            else:
                backend = CpuMmapBackend(arena.total_bytes, populate=populate)
        try:
            memory = OnDemandArena(
                chunk_bytes=arena.chunk_bytes,
                num_chunks=arena.num_chunks,
                backend=backend,
                chunk_extents=placement.chunk_extents,
                initial_chunks=(0, arena.num_chunks) if arena.tail_bytes else (0,),
                tail_bytes=arena.tail_bytes,
            )
        except BaseException:
            if not given:
                backend.close()
            raise
        storage = cls(layout, kind=kind, page_order=page_order, buffers=[memory.tensor])
        storage.memory = memory
        return storage

    def close(self) -> None:
        """Let go of the buffers and, for an :meth:`on_demand` storage, give its memory back
        (:meth:`OnDemandArena.close`).  Views taken from the storage must be dropped first:
        on the CPU the close then raises :class:`MemoryBackendError` and changes nothing; a
        CUDA backend's views become invalid.  Closing twice does nothing."""
        memory = self.memory
        self.buffers = ()
        if memory is None:
            return
        try:
            memory.close()
        except MemoryBackendError:
            self.buffers = (memory.tensor,)
            raise
        self.memory = None

    # ------------------------------------------------------------------ lookups

    @property
    def kind(self) -> LayoutKind:
        return self.placement.kind

    @property
    def members(self) -> tuple[tuple[int, int], ...]:
        """Every stored ``(layer, slot)``, in group then member order."""
        return tuple((m.layer, m.slot) for g in self.placement.groups for m in g.members)

    def group(self, group_id: int) -> GroupPlan:
        return self.layout.groups[self._group(group_id).group_id]

    def group_of(self, layer: int, slot: int = 0) -> GroupPlan:
        """The group storing ``(layer, slot)``; raises :class:`UnknownLayerError`."""
        placed, _ = self.placement.member(layer, slot)
        return self.layout.groups[placed.group_id]

    def num_blocks(self, group_id: int) -> int:
        """Block ids of group ``group_id`` (null block included): views' first axis."""
        return self._group(group_id).num_blocks

    # ------------------------------------------------------------------ manager-block views

    def segment_view(self, layer: int, slot: int = 0, *, name: str) -> torch.Tensor:
        """``[num_blocks, *shape]`` zero-copy view of segment ``name`` of ``(layer, slot)``.

        Raises :class:`UnknownLayerError` / :class:`ViewKindError` naming the valid choices.
        """
        group, member = self.placement.member(layer, slot)
        seg = member.segment(name)
        return segment_tensor(self.buffers[seg.buffer_id], seg, group.num_blocks)

    def kv_view(self, layer: int, slot: int = 0, *, order: PageOrder | str = "nhd") -> KVView:
        """K and V of an attention layer: NHD ``[N, block_size, H, D]`` or HND
        ``[N, H, block_size, D]`` (``D`` = ``head_dim`` for K, ``v_dim`` for V)."""
        self._expect(layer, slot, HEADED_KINDS, "kv_view")
        key = self.segment_view(layer, slot, name="k")
        value = self.segment_view(layer, slot, name="v")
        if _order(order) is PageOrder.HND:
            key, value = key.permute(0, 2, 1, 3), value.permute(0, 2, 1, 3)
        return KVView(key, value)

    def mla_view(self, layer: int, slot: int = 0) -> torch.Tensor:
        """MLA latent ``[N, block_size, kv_lora_rank + qk_rope_head_dim]``."""
        self._expect(layer, slot, frozenset({CacheKind.MLA}), "mla_view")
        return self.segment_view(layer, slot, name="latent")

    def state_views(self, layer: int, slot: int = 0) -> dict[str, torch.Tensor]:
        """Each state tensor ``name -> [N, *shape]`` in its own dtype (one slot per block)."""
        _, member = self._expect(layer, slot, frozenset({CacheKind.STATE}), "state_views")
        return {
            s.segment.name: self.segment_view(layer, slot, name=s.segment.name)
            for s in member.segments
        }

    def block_view(self, layer: int, slot: int = 0, *, name: str, block_id: int) -> torch.Tensor:
        """Segment ``name`` of one block, ``[*shape]``; raises :class:`BlockRangeError`."""
        group, _ = self.placement.member(layer, slot)
        _check_block(group, block_id)
        return self.segment_view(layer, slot, name=name)[block_id]

    # ------------------------------------------------------------------ kernel-block views

    def kernel_kv_view(
        self,
        layer: int,
        slot: int = 0,
        *,
        order: PageOrder | str = "nhd",
        kernel_block_size: int | None = None,
    ) -> KVView:
        """K and V indexed by kernel block id: NHD ``[N * ratio, kbs, H, D]`` or HND
        ``[N * ratio, H, kbs, D]``.

        Raises :class:`KernelBlockSizeError` when ``kernel_block_size`` does not divide the
        block size and :class:`KernelViewError` when the layout cannot express the view (see
        :mod:`hybridkv.storage.views`).
        """
        ratio = kernel_ratio(self.group_of(layer, slot), kernel_block_size)
        kv = self.kv_view(layer, slot, order=order)
        token_axis = 2 if _order(order) is PageOrder.HND else 1
        return KVView(
            kernel_block_view(kv.key, token_axis, ratio),
            kernel_block_view(kv.value, token_axis, ratio),
        )

    def kernel_mla_view(
        self, layer: int, slot: int = 0, *, kernel_block_size: int | None = None
    ) -> torch.Tensor:
        """MLA latent indexed by kernel block id: ``[N * ratio, kbs, latent_dim]``."""
        ratio = kernel_ratio(self.group_of(layer, slot), kernel_block_size)
        return kernel_block_view(self.mla_view(layer, slot), 1, ratio)

    def block_table(self, group_id: int, *, kernel_block_size: int | None = None) -> BlockTable:
        """An empty :class:`BlockTable` for ``group_id``, ids bounded by its block count."""
        placed = self._group(group_id)
        return BlockTable.for_group(
            self.layout.groups[group_id],
            num_blocks=placed.num_blocks,
            kernel_block_size=kernel_block_size,
        )

    # ------------------------------------------------------------------ transfer

    def descriptor(
        self,
        group_id: int,
        block_ids: Sequence[int],
        *,
        liveness: BlockLiveness | None = None,
    ) -> TransferDescriptor:
        """Coalesced byte ranges holding ``block_ids`` of ``group_id`` (see
        :mod:`hybridkv.storage.transfer`); ``liveness`` refuses freed blocks."""
        group = self._group(group_id)
        stream = self._streams.get(group_id)
        if stream is None:
            stream = self._streams[group_id] = (
                self.placement.kind.value,
                self.placement.page_order.value,
                tuple(
                    (
                        m.layer,
                        m.slot,
                        *(
                            (s.segment.name, s.segment.dtype.value, s.segment.shape)
                            for s in m.segments
                        ),
                    )
                    for m in group.members
                ),
            )
        return build_descriptor(group, block_ids, liveness=liveness, stream=stream)

    def move_blocks(self, moves: Iterable[tuple[int, int, int]]) -> int:
        """Copy block ``src`` of group ``g`` to block ``dst`` for each ``(g, src, dst)``, as
        if one after the other (a compaction's moves, :class:`~hybridkv.cache.types.BlockMove`);
        return the bytes copied.  Consecutive moves of one group go as one run: on CUDA one
        gather of their sources and one scatter to their destinations (batched kernels, not
        a copy per byte range), on the CPU one copy per coalesced range; a run ends where a
        move names a block an earlier move of the run named (no copy reads what the run
        wrote, or overlaps itself) and before it passes :data:`MOVE_RUN_BYTES`.  Raises
        :class:`~hybridkv.storage.errors.BlockRangeError` for a block id out of range (and
        :class:`StorageError` for an unknown group) before copying anything."""
        try:
            listed = [tuple(m) for m in moves]
        except TypeError:
            raise StorageError(
                f"moves: need an iterable of (group, src, dst) triples, got {type(moves).__name__}"
            ) from None
        if any(len(m) != 3 for m in listed):
            bad = next(m for m in listed if len(m) != 3)
            raise StorageError(f"moves: {bad!r} is not a (group, src, dst) triple")
        runs: list[tuple[int, list[int], list[int]]] = []
        touched: set[int] = set()
        size = 0
        for g, src, dst in listed:
            block = self.group(g).block_bytes  # a bad group id: StorageError, nothing copied
            if (
                not runs
                or g != runs[-1][0]
                or src in touched
                or dst in touched
                or size + block > MOVE_RUN_BYTES
            ):
                runs.append((g, [], []))
                touched.clear()
                size = 0
            runs[-1][1].append(src)
            runs[-1][2].append(dst)
            touched.add(src)
            touched.add(dst)
            size += block
        plans = [(self.descriptor(g, s), self.descriptor(g, d)) for g, s, d in runs]
        copied = 0
        buffers = self.buffers
        for src_desc, dst_desc in plans:
            if self.device.type == "cpu":  # no launches to save: copy range to range
                copied += copy_blocks(src_desc, buffers, dst_desc, buffers)
            else:
                packed = gather(src_desc, buffers)
                scatter(dst_desc, buffers, packed)
                copied += packed.numel()
        return copied

    def check_invariants(self) -> None:
        """Placement invariants plus buffer sizes (raises :class:`InvariantError`)."""
        self.placement.check_invariants()
        _check_buffers(self.buffers, self.placement.buffer_bytes)
        if self.memory is not None:
            self.memory.check_invariants()

    # ------------------------------------------------------------------ internals

    def _group(self, group_id: int) -> GroupPlacement:
        groups = self.placement.groups
        index = as_integer(group_id)
        if index is None:
            raise StorageError(f"group_id: expected an integer, got {group_id!r}")
        if not 0 <= index < len(groups):
            raise StorageError(
                f"group_id: {group_id} is not a group of this plan; valid: 0..{len(groups) - 1}"
            )
        return groups[index]

    def _expect(
        self, layer: int, slot: int, kinds: frozenset[CacheKind], what: str
    ) -> tuple[GroupPlacement, MemberPlacement]:
        group, member = self.placement.member(layer, slot)
        kind = self.layout.groups[group.group_id].spec.kind
        if kind not in kinds:
            valid = ", ".join(sorted(k.value for k in kinds))
            raise ViewKindError(
                f"{what}: layer {layer} slot {slot} is a {kind.value!r} cache; {what} serves "
                f"{valid} (use segment_view for any kind)"
            )
        return group, member


def _order(order: PageOrder | str) -> PageOrder:
    try:
        return PageOrder(order)
    except ValueError:
        valid = ", ".join(o.value for o in PageOrder)
        raise ViewKindError(f"order: unknown view order {order!r}; valid: {valid}") from None


def _check_block(group: GroupPlacement, block_id: int) -> None:
    if as_integer(block_id) is None:
        raise BlockRangeError(f"block_id: expected an integer, got {block_id!r}")
    if not 0 <= block_id < group.num_blocks:
        raise BlockRangeError(
            f"block_id: {block_id} is out of range for group {group.group_id}; valid ids are "
            f"[0, {group.num_blocks})"
        )


def device_problem(dev: torch.device) -> str:
    """Why this torch cannot allocate on ``dev`` ("" when it can, as far as it tells): a
    backend it was built without or sees no device of, or a device index past the count."""
    kind = dev.type
    if kind in ("cpu", "meta"):
        return ""
    built = f"torch {torch.__version__}"
    if kind == "cuda":
        if not torch.cuda.is_available():
            why = "was built without CUDA" if torch.version.cuda is None else "sees no CUDA device"
            return f"{built} {why}; valid here: cpu"
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            return f"{count} CUDA device(s) visible; valid: cuda:0 .. cuda:{count - 1}"
        return ""
    if kind == "mps":
        mps = getattr(torch.backends, "mps", None)
        if mps is None or not mps.is_available():
            return f"{built} has no usable MPS (Apple GPU) backend here; valid here: cpu"
        return ""
    backend = getattr(torch, kind, None)
    available = getattr(backend, "is_available", None)
    if callable(available) and not available():
        return f"{built} has no usable {kind} backend here; valid here: cpu"
    return ""


def _device(device: torch.device | str) -> torch.device:
    """``device`` as a :class:`torch.device`; :class:`StorageError` for a name torch cannot
    parse, a CPU index other than 0 (torch takes any and ignores it), or a device this torch
    cannot use (:func:`device_problem`: CUDA on a CPU-only build, a GPU index past the
    count)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise StorageError(
            f"device: cannot parse {str(device)!r}; valid: cpu, cuda or cuda:N"
        ) from None
    if dev.type == "cpu" and dev.index:
        raise StorageError(f"device: {str(device)!r}: the CPU is one device (cpu or cpu:0)")
    problem = device_problem(dev)
    if problem:
        raise StorageError(f"device: {str(device)!r} is not available: {problem}")
    return dev


def _listed_buffers(buffers: object) -> list[torch.Tensor]:
    """``buffers`` as a list of tensors; :class:`StorageError` for anything else."""
    try:
        out: list[torch.Tensor] = list(buffers)  # type: ignore[call-overload]
    except TypeError:
        raise StorageError(
            f"buffers: need a sequence of flat uint8 tensors, got {type(buffers).__name__}"
        ) from None
    for i, buf in enumerate(out):
        if not isinstance(buf, torch.Tensor):
            raise StorageError(f"buffers[{i}]: need a flat uint8 tensor, got {type(buf).__name__}")
    return out


def _check_buffers(buffers: Sequence[torch.Tensor], sizes: tuple[int, ...]) -> None:
    if len(buffers) != len(sizes):
        raise StorageError(f"buffers: the layout needs {len(sizes)} buffers, got {len(buffers)}")
    devices = {b.device for b in buffers}
    if len(devices) != 1:
        raise StorageError(f"buffers: all buffers must share one device, got {devices}")
    for i, (buf, size) in enumerate(zip(buffers, sizes, strict=True)):
        if buf.dtype != torch.uint8 or buf.dim() != 1 or not buf.is_contiguous():
            raise StorageError(
                f"buffers[{i}]: need a flat contiguous uint8 tensor, got dtype {buf.dtype}, "
                f"shape {tuple(buf.shape)}"
            )
        if buf.numel() < size:
            raise StorageError(f"buffers[{i}]: {buf.numel()} bytes, the layout needs {size}")
