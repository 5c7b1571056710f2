"""CUDA virtual-memory backend for :class:`~hybridkv.storage.ondemand.OnDemandArena`.

Uses the driver VMM API through the optional ``cuda-bindings`` package
(``from cuda.bindings import driver``), imported only when a backend is built:

* construction: ``cuInit``; make the device's primary context current (the one torch uses);
  ``cuMemGetAllocationGranularity`` (the page size, typically 2 MiB);
  ``cuMemAddressReserve`` for the whole arena, rounded up to the granularity;
* :meth:`CudaVMMBackend.map` (commit a run of pages): ``cuMemCreate`` (pinned device memory),
  ``cuMemMap`` at the run's address, ``cuMemSetAccess`` read-write for the device;
* :meth:`CudaVMMBackend.unmap` (release a run): ``cuMemUnmap`` then ``cuMemRelease`` of the
  run's handle, after synchronizing the device so no queued kernel still reads it;
* :meth:`CudaVMMBackend.close`: unmap everything, ``cuMemAddressFree``.

The reserved range is exposed as a flat ``uint8`` CUDA tensor through
``__cuda_array_interface__`` (``torch.as_tensor``), created on first use of
:attr:`CudaVMMBackend.tensor`.  torch asks the driver which device owns the base pointer, so
the first page must be mapped by then: :meth:`KVCacheStorage.on_demand` commits chunk 0 (the
null blocks) before anything reads the tensor.  Touching an unmapped page from a kernel is an
illegal address fault: only use blocks of committed chunks.

Install with ``pip install cuda-bindings`` (the ``cuda`` extra we would like in
``pyproject.toml``).
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

import torch

from hybridkv.storage.errors import MemoryBackendError

__all__ = ["CudaVMMBackend", "load_driver"]

logger = logging.getLogger(__name__)


def load_driver() -> Any:
    """Import ``cuda.bindings.driver``; raise :class:`MemoryBackendError` if it is missing."""
    try:
        return importlib.import_module("cuda.bindings.driver")
    except ImportError as exc:
        raise MemoryBackendError(
            "device: on-demand CUDA memory needs the cuda-bindings package "
            f"(pip install cuda-bindings): {exc}"
        ) from None


class _CudaRange:
    """A bare ``__cuda_array_interface__`` over ``nbytes`` bytes at device address ``ptr``."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "strides": None,
            "version": 3,
        }


class CudaVMMBackend:
    """Reserved device address space whose pages are mapped per run on demand.

    ``driver`` is the ``cuda.bindings.driver`` module (injectable for tests).  Every driver
    error raises :class:`MemoryBackendError` naming the call and the result code; a failed
    :meth:`map` leaves nothing mapped or allocated.
    """

    def __init__(self, total_bytes: int, *, device: int = 0, driver: Any = None) -> None:
        self._drv = load_driver() if driver is None else driver
        drv = self._drv
        self.device = device
        self._call("cuInit", drv.cuInit(0))
        ctx = self._call("cuCtxGetCurrent", drv.cuCtxGetCurrent())
        #: The device whose primary context this backend retained (released by close).
        self._retained: Any = None
        if ctx is None or int(ctx) == 0:
            dev = self._call("cuDeviceGet", drv.cuDeviceGet(device))
            ctx = self._call("cuDevicePrimaryCtxRetain", drv.cuDevicePrimaryCtxRetain(dev))
            self._retained = dev
            self._call("cuCtxSetCurrent", drv.cuCtxSetCurrent(ctx))
        prop = drv.CUmemAllocationProp()
        prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = device
        self._prop = prop
        access = drv.CUmemAccessDesc()
        access.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = device
        access.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._access = access
        granularity = self._call(
            "cuMemGetAllocationGranularity",
            drv.cuMemGetAllocationGranularity(
                prop, drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
            ),
        )
        self.page_bytes = int(granularity)
        self.total_bytes = total_bytes
        self.size = -(-total_bytes // self.page_bytes) * self.page_bytes
        ptr = self._call(
            "cuMemAddressReserve", drv.cuMemAddressReserve(self.size, self.page_bytes, 0, 0)
        )
        self.base = int(ptr)
        self._maps: dict[int, tuple[int, Any]] = {}
        self._tensor: torch.Tensor | None = None
        logger.debug("reserved %d bytes of device %d at %#x", self.size, device, self.base)

    @property
    def tensor(self) -> torch.Tensor:
        if self._tensor is None:
            if 0 not in self._maps:
                raise MemoryBackendError(
                    "tensor: map the first page (commit chunk 0) before viewing the range"
                )
            self._tensor = torch.as_tensor(
                _CudaRange(self.base, self.total_bytes), device=torch.device("cuda", self.device)
            )
        return self._tensor

    @property
    def mapped_bytes(self) -> int:
        return sum(count for count, _ in self._maps.values()) * self.page_bytes

    def map(self, first: int, count: int) -> None:
        drv = self._drv
        size = count * self.page_bytes
        ptr = drv.CUdeviceptr(self.base + first * self.page_bytes)
        handle = self._call("cuMemCreate", drv.cuMemCreate(size, self._prop, 0))
        try:
            self._call("cuMemMap", drv.cuMemMap(ptr, size, 0, handle, 0))
        except MemoryBackendError:
            drv.cuMemRelease(handle)
            raise
        try:
            self._call("cuMemSetAccess", drv.cuMemSetAccess(ptr, size, [self._access], 1))
        except MemoryBackendError:
            drv.cuMemUnmap(ptr, size)
            drv.cuMemRelease(handle)
            raise
        self._maps[first] = (count, handle)

    def unmap(self, first: int, count: int) -> None:
        found = self._maps.get(first)
        if found is None or found[0] != count:
            raise MemoryBackendError(
                f"unmap: pages [{first}, {first + count}) were not mapped as one run"
            )
        if self._tensor is not None:
            torch.cuda.synchronize(self.device)
        drv = self._drv
        size = count * self.page_bytes
        ptr = drv.CUdeviceptr(self.base + first * self.page_bytes)
        self._call("cuMemUnmap", drv.cuMemUnmap(ptr, size))
        self._call("cuMemRelease", drv.cuMemRelease(found[1]))
        del self._maps[first]

    def close(self) -> None:
        """Unmap every run, free the reservation and release the primary context this backend
        retained; views of the range become invalid.  A driver error does not stop the rest:
        the first one is raised after every step was tried."""
        first_error: MemoryBackendError | None = None
        for first, (count, _) in sorted(self._maps.items()):
            try:
                self.unmap(first, count)
            except MemoryBackendError as exc:
                first_error = first_error or exc
                self._maps.pop(first, None)  # the driver keeps what it could not give back
        drv = self._drv
        if self.base:
            try:
                self._call(
                    "cuMemAddressFree", drv.cuMemAddressFree(drv.CUdeviceptr(self.base), self.size)
                )
            except MemoryBackendError as exc:
                first_error = first_error or exc
            self.base = 0
        if self._retained is not None:
            try:
                self._call(
                    "cuDevicePrimaryCtxRelease", drv.cuDevicePrimaryCtxRelease(self._retained)
                )
            except MemoryBackendError as exc:
                first_error = first_error or exc
            self._retained = None
        self._tensor = None
        if first_error is not None:
            raise first_error

    def _call(self, name: str, result: Any) -> Any:
        """Unpack a ``cuda.bindings`` result tuple ``(err, *values)``; raise on error."""
        err, *values = result if isinstance(result, tuple) else (result,)
        if err != self._drv.CUresult.CUDA_SUCCESS:
            raise MemoryBackendError(f"{name}: CUDA driver error {err!r}")
        if not values:
            return None
        return values[0] if len(values) == 1 else tuple(values)
