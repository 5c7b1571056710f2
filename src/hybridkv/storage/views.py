"""Zero-copy torch views of segments, at manager-block and kernel-block granularity.

A :class:`~hybridkv.storage.placement.SegmentPlacement` is an affine byte map; a view is that
map handed to :func:`torch.Tensor.as_strided` on the flat ``uint8`` buffer, with a trailing
axis of ``itemsize`` bytes that :meth:`torch.Tensor.view` turns into one element of the
segment's dtype.  Every view shares the buffer's storage: writing through it writes the
buffer, with no copy.

Shapes (``N`` = block ids of the group, block 0 the null block):

* attention ``k``: NHD ``[N, block_size, H, head_dim]``; HND ``[N, H, block_size, head_dim]``
  (a permutation of the NHD view; contiguous for HND pages); ``v`` likewise with ``v_dim``;
* MLA ``latent``: ``[N, block_size, kv_lora_rank + rope_dim]``;
* state tensor ``name``: ``[N, *shape]`` in the tensor's own dtype (one slot per block).

Example: a page ``[K | V]`` of fp16 ``[2, 1, 4]`` each in a 64-byte block region gives
``k`` with shape ``[N, 2, 1, 4]`` and element strides ``(32, 4, 4, 1)``.

Kernel-block views split each manager block into ``ratio = block_size // kernel_block_size``
kernel blocks, kernel block ``k = b * ratio + j`` holding tokens
``[j * kbs, (j + 1) * kbs)`` of manager block ``b``.  A flat ``[N * ratio, kbs, ...]`` view
exists only when the segment's token axis is uniformly strided across block boundaries, i.e.
``block_stride == block_size * token_stride``: consecutive blocks' tokens of this layer and
this K/V part are adjacent.  That holds for ``ratio == 1`` and for the ``per_layer`` layout
with split slabs and NHD pages; the cross-layer layouts interleave other layers between
blocks and raise :class:`KernelViewError` (use the manager view
``view.unflatten(1, (ratio, kbs))`` there).
"""

from __future__ import annotations

import torch

from hybridkv.specs import DType
from hybridkv.storage.errors import KernelViewError, LayoutUnsupportedError
from hybridkv.storage.placement import SegmentPlacement

__all__ = ["kernel_block_view", "segment_tensor", "torch_dtype"]


def torch_dtype(dtype: DType) -> torch.dtype:
    """The torch dtype of a cache :class:`DType` (its value is the torch attribute name)."""
    out = getattr(torch, dtype.value)
    assert isinstance(out, torch.dtype)
    return out


def segment_tensor(buffer: torch.Tensor, seg: SegmentPlacement, num_blocks: int) -> torch.Tensor:
    """A ``[num_blocks, *seg.segment.shape]`` view of ``buffer`` (flat ``uint8``).

    Raises :class:`LayoutUnsupportedError` when an offset or stride is not a multiple of the
    element size (the planner must round ``page_bytes`` so pages stay aligned).
    """
    size = seg.segment.dtype.itemsize
    if not seg.aligned:
        raise LayoutUnsupportedError(
            f"view: segment {seg.segment.name!r} ({seg.segment.dtype.value}) has byte offset "
            f"{seg.offset}, block stride {seg.block_stride} and strides {seg.strides}; all must "
            f"be multiples of its element size {size} (round page_bytes to a multiple of {size})"
        )
    shape = (num_blocks, *seg.segment.shape, size)
    strides = (seg.block_stride, *seg.strides, 1)
    raw = buffer.as_strided(shape, strides, buffer.storage_offset() + seg.offset)
    return raw.view(torch_dtype(seg.segment.dtype)).squeeze(-1)


def kernel_block_view(view: torch.Tensor, token_axis: int, ratio: int) -> torch.Tensor:
    """Flatten manager blocks of ``view`` into kernel blocks of ``size(token_axis) // ratio``.

    ``view`` has the block axis first and the token axis at ``token_axis``.  The result has
    ``size(0) * ratio`` blocks of ``size(token_axis) // ratio`` tokens, kernel block
    ``b * ratio + j`` being tokens ``[j*kbs, (j+1)*kbs)`` of manager block ``b``; it shares
    storage with ``view``.  Raises :class:`KernelViewError` when the strides cannot express it.
    """
    if ratio == 1:
        return view
    tokens = view.size(token_axis)
    block_stride, token_stride = view.stride(0), view.stride(token_axis)
    if block_stride != tokens * token_stride:
        raise KernelViewError(
            f"kernel view: block stride {block_stride} is not block_size {tokens} x token "
            f"stride {token_stride} (elements), so kernel blocks of {tokens // ratio} tokens are "
            "not uniformly strided (they are where a block is one layer's pages alone: layout "
            "kind per_layer with NHD pages, on a pools layout whose pool's groups share one "
            "page profile); index the manager view as view.unflatten(1, (ratio, kernel_block_size))"
        )
    kbs = tokens // ratio
    shape = list(view.shape)
    strides = list(view.stride())
    shape[0], strides[0] = view.size(0) * ratio, kbs * token_stride
    shape[token_axis] = kbs
    return view.as_strided(shape, strides, view.storage_offset())
