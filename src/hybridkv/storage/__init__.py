"""Storage: backing memory, zero-copy kernel views, block tables and transfer descriptors.

This is the first layer that imports torch.  Modules, one concept each:

* :mod:`~hybridkv.storage.segments`    what a member page holds (K, V, latent, state tensors)
* :mod:`~hybridkv.storage.placement`   layout kinds: where every byte of a page lives
* :mod:`~hybridkv.storage.views`       torch views at manager- and kernel-block granularity
* :mod:`~hybridkv.storage.block_table` manager/kernel block tables
* :mod:`~hybridkv.storage.transfer`    byte-range descriptors, gather/scatter/copy
* :mod:`~hybridkv.storage.ondemand`    on-demand physical memory (CPU mmap backend)
* :mod:`~hybridkv.storage.cuda_vmm`    CUDA virtual-memory backend (optional cuda-bindings)
* :mod:`~hybridkv.storage.storage`     :class:`KVCacheStorage`, the facade
* :mod:`~hybridkv.storage.connector`   what an instance tells a peer (buffers, array maps)
* :mod:`~hybridkv.storage.transfer_plan` a request's bytes between two instances' layouts
* :mod:`~hybridkv.storage.transport`   executing a plan over torch.distributed
* :mod:`~hybridkv.storage.cp`          context-parallel token maps for transfer plans
* :mod:`~hybridkv.storage.disk_slots`  a disk tier's file of checksummed slots
* :mod:`~hybridkv.storage.disk_format` the slot header format and checksum
* :mod:`~hybridkv.storage.disk_io`     positioned writes that finish (resumed after short ones)
* :mod:`~hybridkv.storage.disk_manifest` who made a disk-cache directory, checked on open
* :mod:`~hybridkv.storage.errors`      the storage exceptions
"""

from __future__ import annotations

from hybridkv.storage.block_table import BlockTable, batch_kernel_table, kernel_ratio
from hybridkv.storage.errors import (
    BlockRangeError,
    FreedBlockError,
    KernelBlockSizeError,
    KernelViewError,
    LayoutUnsupportedError,
    MemoryBackendError,
    StorageAllocationError,
    TransferError,
    UnknownLayerError,
    ViewKindError,
)
from hybridkv.storage.ondemand import CpuMmapBackend, OnDemandArena, PageBackend
from hybridkv.storage.placement import (
    GroupPlacement,
    LayoutKind,
    PageOrder,
    Piece,
    SegmentPlacement,
    StoragePlacement,
    place,
)
from hybridkv.storage.segments import Segment, page_segments
from hybridkv.storage.storage import KVCacheStorage, KVView, allocate_bytes
from hybridkv.storage.transfer import (
    BlockLiveness,
    ByteRange,
    TransferDescriptor,
    build_descriptor,
    copy_blocks,
    gather,
    scatter,
)

__all__ = [
    "BlockLiveness",
    "BlockRangeError",
    "BlockTable",
    "ByteRange",
    "CpuMmapBackend",
    "FreedBlockError",
    "GroupPlacement",
    "KVCacheStorage",
    "KVView",
    "KernelBlockSizeError",
    "KernelViewError",
    "LayoutKind",
    "LayoutUnsupportedError",
    "MemoryBackendError",
    "OnDemandArena",
    "PageBackend",
    "PageOrder",
    "Piece",
    "Segment",
    "SegmentPlacement",
    "StorageAllocationError",
    "StoragePlacement",
    "TransferDescriptor",
    "TransferError",
    "UnknownLayerError",
    "ViewKindError",
    "allocate_bytes",
    "batch_kernel_table",
    "build_descriptor",
    "copy_blocks",
    "gather",
    "kernel_ratio",
    "page_segments",
    "place",
    "scatter",
]
