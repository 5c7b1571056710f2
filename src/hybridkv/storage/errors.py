"""Typed errors of the storage layer, all :class:`hybridkv.errors.StorageError` subclasses."""

from __future__ import annotations

from hybridkv.errors import StorageError

__all__ = [
    "BlockRangeError",
    "FreedBlockError",
    "KernelBlockSizeError",
    "KernelViewError",
    "LayoutUnsupportedError",
    "MemoryBackendError",
    "StorageAllocationError",
    "TransferError",
    "UnknownLayerError",
    "ViewKindError",
]


class UnknownLayerError(StorageError):
    """A view was asked for a ``(layer, slot)`` the plan does not store."""


class ViewKindError(StorageError):
    """A view of the wrong kind was asked for (e.g. K/V of a state layer, an unknown tensor)."""


class BlockRangeError(StorageError):
    """A block id lies outside the ids of its group, or names the null block where data is due."""


class KernelBlockSizeError(StorageError):
    """A kernel block size does not divide the manager block size."""


class KernelViewError(StorageError):
    """A flat kernel-block view cannot be expressed with strides for this layout."""


class LayoutUnsupportedError(StorageError):
    """The layout kind cannot place this memory layout (sizes or alignment do not fit)."""


class FreedBlockError(StorageError):
    """A transfer descriptor was asked for a block its group does not hold."""


class TransferError(StorageError):
    """A gather, scatter or copy got buffers or descriptors that do not match."""


class MemoryBackendError(StorageError):
    """On-demand memory could not be reserved, committed or released."""


class StorageAllocationError(StorageError):
    """A buffer the plan asks for could not be allocated (more than the device or the host
    has).  The message starts with the budget's field, e.g. ``memory_bytes: ...``."""
