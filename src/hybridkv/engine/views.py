"""The seam between the runner and cache storage: per-layer paged tensor views.

The runner reads and writes cache memory only through :class:`PagedKVViews`.  The real backing
memory lives in :mod:`hybridkv.storage`; :class:`DenseKVViews` is a small, independent
implementation (one dense tensor per layer) for tests and for running without it.

Shapes (kernel granularity: a group with ``block_size`` 16 and ``kernel_block_size`` 8 has two
kernel blocks per manager block; manager block ``b`` holds kernel blocks ``2b`` and ``2b + 1``)::

    attention_kv(layer, slot) -> (k, v)  k: [NK, kernel_block_size, kv_heads, head_dim]
                                         v: [NK, kernel_block_size, kv_heads, v_head_dim]
    mla_latent(layer, slot)   -> latent  [NK, kernel_block_size, kv_lora_rank + rope_dim]
    state(layer, slot, name)  -> state   [num_slots, *StateTensor.shape]

``NK`` is the number of kernel blocks.  The runner also accepts manager-granular attention and
MLA views (``[num_block_ids, block_size, ...]``, what a cross-layer storage layout can offer)
and indexes them as ``[num_block_ids, ratio, kernel_block_size, ...]``.

Views may be strided (not contiguous): the runner indexes them with ``view[block_ids, offsets]``
and never reshapes them.  ``num_kernel_blocks = num_block_ids * ratio`` and ``num_slots =
num_block_ids`` of the group; id ``0`` is the null block.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Protocol, cast

import torch

from hybridkv.engine.errors import EngineError
from hybridkv.plan import GroupPlan, MemoryLayout
from hybridkv.specs import AttentionSpec, CacheKind, DType, MLASpec, StateSpec
from hybridkv.storage import KernelViewError, KVCacheStorage

__all__ = [
    "DenseKVViews",
    "PagedKVViews",
    "StorageViews",
    "group_block_ids",
    "kernel_index",
    "torch_dtype",
]


class PagedKVViews(Protocol):
    """Zero-copy tensor views of a layer's cache.  Writes into a view must reach the cache."""

    def attention_kv(self, layer: int, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of an attention member, NHD per kernel block (see the module docstring)."""
        ...

    def mla_latent(self, layer: int, slot: int) -> torch.Tensor:
        """The latent of an MLA member: ``[num_kernel_blocks, kernel_block_size, latent_dim]``."""
        ...

    def state(self, layer: int, slot: int, name: str) -> torch.Tensor:
        """One named state tensor of a state member: ``[num_slots, *shape]``."""
        ...


def torch_dtype(dtype: DType) -> torch.dtype:
    """The torch dtype of a hybridkv :class:`~hybridkv.specs.DType`."""
    out = getattr(torch, dtype.value)
    if not isinstance(out, torch.dtype):  # pragma: no cover - DType values are torch names
        raise EngineError(f"dtype: torch has no dtype {dtype.value!r}")
    return out


def group_block_ids(layout: MemoryLayout, group_id: int) -> int:
    """Size of group ``group_id``'s block-id space (the null block ``0`` included; arena:
    one stride over the whole region, ids no chunk lends included)."""
    if layout.arena is not None:
        return layout.num_block_ids(group_id)
    return layout.pool_of(group_id).num_blocks


def kernel_index(
    view: torch.Tensor,
    *,
    num_block_ids: int,
    block_size: int,
    kernel_block_size: int,
    blocks: torch.Tensor,
    offsets: torch.Tensor,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """``(tensor, index)`` such that ``tensor[index]`` are the slots ``(blocks, offsets)``.

    ``blocks`` are kernel block ids, ``offsets`` offsets inside a kernel block.  A
    kernel-granular view ``[num_block_ids * ratio, kernel_block_size, ...]`` is indexed as is;
    a manager-granular one ``[num_block_ids, block_size, ...]`` through a
    ``[num_block_ids, ratio, kernel_block_size, ...]`` view of it (no copy).  Raises
    :class:`EngineError` for any other shape.
    """
    ratio = block_size // kernel_block_size
    if view.shape[0] == num_block_ids * ratio and view.shape[1] == kernel_block_size:
        return view, (blocks, offsets)
    if view.shape[0] == num_block_ids and view.shape[1] == block_size:
        split = view.view(view.shape[0], ratio, kernel_block_size, *view.shape[2:])
        return split, (blocks // ratio, blocks % ratio, offsets)
    raise EngineError(
        f"views: a view of shape {tuple(view.shape)} fits neither kernel blocks "
        f"[{num_block_ids * ratio}, {kernel_block_size}, ...] nor manager blocks "
        f"[{num_block_ids}, {block_size}, ...]"
    )


class _Alloc(NamedTuple):
    num_ids: int
    device: torch.device
    fill: float


class DenseKVViews:
    """Dense per-member tensors shaped as :class:`PagedKVViews` promises.

    Every ``(layer, slot)`` member of every group of ``layout`` gets its own tensors, sized by
    the group's number of block ids (:func:`group_block_ids`).  ``fill`` initialises the memory;
    tests use NaN so that reading a slot nobody wrote poisons the output.  Raises
    :class:`EngineError` when asked for a member or view kind the layout does not have.
    """

    def __init__(
        self, layout: MemoryLayout, *, device: str | torch.device = "cpu", fill: float = 0.0
    ) -> None:
        self.layout = layout
        self._kv: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._latent: dict[tuple[int, int], torch.Tensor] = {}
        self._state: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        for group in layout.groups:
            for member in group.members:
                self._allocate(group, member, torch.device(device), fill)

    def _allocate(
        self, group: GroupPlan, member: tuple[int, int], device: torch.device, fill: float
    ) -> None:
        allocate = _DENSE.get(group.spec.kind)
        if allocate is None:
            raise EngineError(
                f"DenseKVViews: group {group.group_id} has spec kind {group.spec.kind.value!r}, "
                "which stores no tensors this view type knows"
            )
        num_ids = group_block_ids(self.layout, group.group_id)
        allocate(self, group, member, _Alloc(num_ids, device, fill))

    def _dense_kv(self, group: GroupPlan, member: tuple[int, int], a: _Alloc) -> None:
        spec = cast(AttentionSpec, group.spec)
        dt = torch_dtype(spec.dtype)
        shape = (a.num_ids * group.kernel_blocks_per_block, group.kernel_block_size)
        k = torch.full(
            (*shape, spec.num_kv_heads, spec.head_dim), a.fill, dtype=dt, device=a.device
        )
        v = torch.full((*shape, spec.num_kv_heads, spec.v_dim), a.fill, dtype=dt, device=a.device)
        self._kv[member] = (k, v)

    def _dense_latent(self, group: GroupPlan, member: tuple[int, int], a: _Alloc) -> None:
        spec = cast(MLASpec, group.spec)
        shape = (
            a.num_ids * group.kernel_blocks_per_block,
            group.kernel_block_size,
            spec.latent_dim,
        )
        self._latent[member] = torch.full(
            shape, a.fill, dtype=torch_dtype(spec.dtype), device=a.device
        )

    def _dense_state(self, group: GroupPlan, member: tuple[int, int], a: _Alloc) -> None:
        spec = cast(StateSpec, group.spec)
        self._state[member] = {
            t.name: torch.full(
                (a.num_ids, *t.shape), a.fill, dtype=torch_dtype(t.dtype), device=a.device
            )
            for t in spec.tensors
        }

    def attention_kv(self, layer: int, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        found = self._kv.get((layer, slot))
        if found is None:
            raise EngineError(
                f"attention_kv: (layer {layer}, slot {slot}) is not an attention member; "
                f"attention members: {sorted(self._kv)}"
            )
        return found

    def mla_latent(self, layer: int, slot: int) -> torch.Tensor:
        found = self._latent.get((layer, slot))
        if found is None:
            raise EngineError(
                f"mla_latent: (layer {layer}, slot {slot}) is not an MLA member; "
                f"MLA members: {sorted(self._latent)}"
            )
        return found

    def state(self, layer: int, slot: int, name: str) -> torch.Tensor:
        tensors = self._state.get((layer, slot))
        if tensors is None:
            raise EngineError(
                f"state: (layer {layer}, slot {slot}) is not a state member; "
                f"state members: {sorted(self._state)}"
            )
        found = tensors.get(name)
        if found is None:
            raise EngineError(
                f"state: layer {layer} slot {slot} has no tensor {name!r}; has {sorted(tensors)}"
            )
        return found


class StorageViews:
    """:class:`PagedKVViews` over a :class:`~hybridkv.storage.KVCacheStorage`.

    Attention and MLA views are kernel-granular where the storage layout can express them
    (``kernel_kv_view`` / ``kernel_mla_view``) and manager-granular otherwise (cross-layer
    layouts with ``kernel_block_size < block_size`` raise ``KernelViewError`` there; the runner
    indexes manager views at kernel granularity itself).  Views are built once per member and
    cached; they share memory with the storage buffers.  Storage errors (unknown layer, wrong
    kind) propagate as the storage's own :class:`~hybridkv.errors.StorageError` subclasses.
    """

    def __init__(self, storage: KVCacheStorage) -> None:
        self.storage = storage
        self._kv: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._latent: dict[tuple[int, int], torch.Tensor] = {}
        self._state: dict[tuple[int, int], dict[str, torch.Tensor]] = {}

    def attention_kv(self, layer: int, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        found = self._kv.get((layer, slot))
        if found is None:
            try:
                kv = self.storage.kernel_kv_view(layer, slot)
            except KernelViewError:
                kv = self.storage.kv_view(layer, slot)
            found = self._kv[(layer, slot)] = (kv.key, kv.value)
        return found

    def mla_latent(self, layer: int, slot: int) -> torch.Tensor:
        found = self._latent.get((layer, slot))
        if found is None:
            try:
                found = self.storage.kernel_mla_view(layer, slot)
            except KernelViewError:
                found = self.storage.mla_view(layer, slot)
            self._latent[(layer, slot)] = found
        return found

    def state(self, layer: int, slot: int, name: str) -> torch.Tensor:
        tensors = self._state.get((layer, slot))
        if tensors is None:
            tensors = self._state[(layer, slot)] = self.storage.state_views(layer, slot)
        found = tensors.get(name)
        if found is None:
            raise EngineError(
                f"state: layer {layer} slot {slot} stores no tensor {name!r}; has {sorted(tensors)}"
            )
        return found


_Allocator = Callable[[DenseKVViews, GroupPlan, tuple[int, int], _Alloc], None]

#: spec kind -> how :class:`DenseKVViews` allocates a member of that kind.
_DENSE: dict[CacheKind, _Allocator] = {
    CacheKind.FULL: DenseKVViews._dense_kv,
    CacheKind.SLIDING: DenseKVViews._dense_kv,
    CacheKind.CHUNKED: DenseKVViews._dense_kv,
    CacheKind.MLA: DenseKVViews._dense_latent,
    CacheKind.STATE: DenseKVViews._dense_state,
}
