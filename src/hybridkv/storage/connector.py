"""What an instance tells a peer about its cache: tensor and data references.  No torch.

A transfer connector moving a request between instances (prefill to decode, or to a store)
needs two things from each side, and nothing about the model:

* :class:`TensorRef` per backing buffer: where it is (``address``, the buffer's data
  pointer), its size and device.  Byte offsets below are relative to a buffer.
* :class:`SegmentRef` per stored array: for layer ``layer`` (cache ``slot``), segment
  ``name`` (``k``, ``v``, ``latent``, or a state tensor such as ``conv`` / ``ssm``), the
  affine map from a block and an element index to a byte offset (``offset``,
  ``block_stride``, ``strides``) in buffer ``buffer_id``, its element type (``dtype``,
  ``itemsize``) and logical ``shape`` per block, the group it belongs to (``group_id``,
  ``num_blocks`` block ids, ``block_size`` tokens per block; 0 for a state slot),
  and which slice of a tensor-parallel split it holds: along ``shard_axis`` (the KV-head
  axis of attention, axis 0 of a state tensor) the global indices ``[shard_first,
  shard_first + shape[shard_axis])`` of ``shard_total``.

:class:`Registration` bundles them for one instance (``instance`` names it; ``tp_rank`` of
``tp_size``).  It is plain data (ints, strings, tuples), so it crosses a process boundary
as is, and :mod:`hybridkv.storage.transfer_plan` turns two registrations and a request's
block tables into copy runs.  The layouts of the two sides may differ in every way the
placement allows: cross-layer or per-layer or head-major, NHD or HND pages, block sizes,
grouping, and tensor-parallel split.

Tensor-parallel split (:func:`tp_shard`): with ``H`` KV heads over ``T`` ranks, rank ``r``
holds heads ``[r*H/T, (r+1)*H/T)`` when ``T`` divides ``H``; when ``H < T`` (GQA
replication) it holds the one head ``r*H // T``, which ``T/H`` ranks share.  State tensors
split the same way along their axis 0 (hybridkv's sharded-cache convention: contiguous row
ranges; a model whose recurrent state is sharded by interleaved channel groups needs its
own map).  MLA latents are not split: every rank holds all of them.

A rank's state shape does not tell the state's size before the split: Nemotron-H-8B's conv
state is 10240 rows at tp 1 but 2560 per rank at tp 16, since its 8 B/C groups are
replicated, not split (2560 * 16 is not 10240).  ``state_rows`` (tensor name -> rows before
the split) tells :func:`register` the real size: a state whose rank rows times ``tp_size``
differ from it is not a contiguous split, and is refused.  Without it the convention's size
(rank rows times ``tp_size``) is registered, and
:func:`~hybridkv.storage.transfer_plan.plan_transfer` refuses a peer whose size differs
(``shard_total``), so no plan moves part of a state and leaves the rest unwritten.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hybridkv.errors import StorageError, as_integer, brief_repr
from hybridkv.specs import CacheKind
from hybridkv.storage.placement import StoragePlacement
from hybridkv.storage.segments import HEADED_KINDS

__all__ = ["Registration", "SegmentRef", "TensorRef", "register", "register_storage", "tp_shard"]


@dataclass(frozen=True, kw_only=True)
class TensorRef:
    """One backing buffer: ``buffer_id``, its data pointer, size in bytes and device."""

    buffer_id: int
    address: int
    nbytes: int
    device: str


@dataclass(frozen=True, kw_only=True)
class SegmentRef:
    """One stored array of one layer (see the module doc)."""

    layer: int
    slot: int
    name: str
    kind: str
    group_id: int
    block_size: int
    itemsize: int
    #: The element type's name (``DType`` value, e.g. ``bfloat16``): arrays of one item
    #: size but another type (bf16 / fp16, the two fp8 kinds) are not interchangeable.
    dtype: str
    #: Blocks of the group's table (ids ``0 .. num_blocks - 1``; 0 is the null block).
    num_blocks: int
    shape: tuple[int, ...]
    buffer_id: int
    offset: int
    block_stride: int
    strides: tuple[int, ...]
    token_axis: int | None
    shard_axis: int | None
    shard_first: int
    shard_total: int

    @property
    def key(self) -> tuple[int, int, str]:
        """What names the same array on another instance: ``(layer, slot, name)``."""
        return (self.layer, self.slot, self.name)


@dataclass(frozen=True, kw_only=True)
class Registration:
    """An instance's cache, for a connector: its buffers and every stored array."""

    instance: str
    tp_rank: int
    tp_size: int
    tensors: tuple[TensorRef, ...]
    segments: tuple[SegmentRef, ...]

    def segment(self, key: tuple[int, int, str]) -> SegmentRef | None:
        """The array called ``key`` (``(layer, slot, name)``), or None."""
        for s in self.segments:
            if s.key == key:
                return s
        return None


def tp_shard(total: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """``(first, count)`` of the ``total`` indices rank ``tp_rank`` of ``tp_size`` holds
    (see the module doc).  Raises :class:`StorageError` for a split that does not divide."""
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise StorageError(f"tp_rank: {tp_rank} is not a rank of tp_size {tp_size}")
    if total >= tp_size:
        if total % tp_size:
            raise StorageError(
                f"tp_size: {total} heads (or rows) do not split evenly over {tp_size} ranks"
            )
        per = total // tp_size
        return tp_rank * per, per
    if tp_size % total:
        raise StorageError(
            f"tp_size: {tp_size} ranks do not replicate {total} heads evenly (GQA replication "
            "needs tp_size a multiple of the heads)"
        )
    return tp_rank * total // tp_size, 1


def register(
    placement: StoragePlacement,
    *,
    instance: str = "",
    tensors: tuple[TensorRef, ...] = (),
    tp_rank: int = 0,
    tp_size: int = 1,
    kv_heads: int | None = None,
    state_rows: Mapping[str, int] | None = None,
) -> Registration:
    """The registration of a cache placed as ``placement`` (its buffers in ``tensors``) as
    rank ``tp_rank`` of ``tp_size``.  ``kv_heads``: the model's KV heads before the split
    (default: this rank's heads times ``tp_size``, i.e. no replication).  State tensors are
    split along axis 0 when ``tp_size > 1``; ``state_rows[name]``: the axis-0 size of state
    tensor ``name`` before the split (default: this rank's rows times ``tp_size``; see the
    module doc).  Raises :class:`StorageError` for a split the shapes do not allow, among
    them a state whose rank rows times ``tp_size`` are not its ``state_rows``."""
    rows_before = _state_rows(state_rows)
    layout = placement.layout
    segs: list[SegmentRef] = []
    for gp in placement.groups:
        plan = layout.groups[gp.group_id]
        kind = plan.spec.kind
        for member in gp.members:
            for sp in member.segments:
                seg = sp.segment
                shape = seg.shape
                token_axis: int | None = None if kind is CacheKind.STATE else 0
                shard_axis: int | None = None
                first, total = 0, 0
                if kind in HEADED_KINDS:
                    shard_axis = 1
                    local = shape[1]
                    heads = kv_heads if kv_heads is not None else local * tp_size
                    first, count = tp_shard(heads, tp_size, tp_rank)
                    if count != local:
                        raise StorageError(
                            f"kv_heads: layer {member.layer} holds {local} KV heads, rank "
                            f"{tp_rank} of {tp_size} over {heads} heads would hold {count}"
                        )
                    total = heads
                elif kind is CacheKind.STATE and tp_size > 1:
                    shard_axis = 0
                    total = shape[0] * tp_size
                    known = rows_before.get(seg.name)
                    if known is not None and known != total:
                        raise StorageError(
                            f"state_rows: {seg.name!r} has {known} rows before the split, "
                            f"layer {member.layer} holds {shape[0]} on each of {tp_size} ranks "
                            f"({total} in all): not a contiguous split of axis 0 (groups "
                            "replicated over the ranks?); only a split whose rank rows times "
                            "tp_size are the rows before it can be registered"
                        )
                    first, _ = tp_shard(total, tp_size, tp_rank)
                segs.append(
                    SegmentRef(
                        layer=member.layer,
                        slot=member.slot,
                        name=seg.name,
                        kind=kind.value,
                        group_id=gp.group_id,
                        block_size=plan.block_size if token_axis is not None else 0,
                        itemsize=seg.dtype.itemsize,
                        dtype=seg.dtype.value,
                        num_blocks=gp.num_blocks,
                        shape=shape,
                        buffer_id=sp.buffer_id,
                        offset=sp.offset,
                        block_stride=sp.block_stride,
                        strides=sp.strides,
                        token_axis=token_axis,
                        shard_axis=shard_axis,
                        shard_first=first,
                        shard_total=total,
                    )
                )
    return Registration(
        instance=instance,
        tp_rank=tp_rank,
        tp_size=tp_size,
        tensors=tensors,
        segments=tuple(segs),
    )


def _state_rows(state_rows: object) -> dict[str, int]:
    """``state_rows`` checked: a mapping of state tensor names to positive row counts."""
    if state_rows is None:
        return {}
    if not isinstance(state_rows, Mapping):
        raise StorageError(
            f"state_rows: need a mapping of state tensor name -> rows before the split, got "
            f"{brief_repr(state_rows)}"
        )
    out: dict[str, int] = {}
    for name, rows in state_rows.items():
        count = as_integer(rows)
        if not isinstance(name, str) or count is None or count < 1:
            raise StorageError(
                f"state_rows: {name!r}: {brief_repr(rows)}; need a tensor name and a row count >= 1"
            )
        out[name] = count
    return out


def register_storage(storage: Any, **kwargs: Any) -> Registration:
    """:func:`register` of a :class:`~hybridkv.storage.KVCacheStorage` (its placement), with
    a :class:`TensorRef` for each of its buffers (data pointer, bytes, device); ``kwargs``
    as :func:`register` takes them."""
    tensors = tuple(
        TensorRef(
            buffer_id=i,
            address=int(buf.data_ptr()),
            nbytes=int(buf.numel()),
            device=str(buf.device),
        )
        for i, buf in enumerate(storage.buffers)
    )
    return register(storage.placement, tensors=tensors, **kwargs)
