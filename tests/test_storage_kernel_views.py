"""Kernel-granularity views: flat where the strides allow it, a typed error elsewhere."""

from __future__ import annotations

import pytest
import torch

from hybridkv.storage import KernelBlockSizeError, KernelViewError, KVCacheStorage, LayoutKind
from test_storage_factories import SPECS, group, pools_layout


def _storage(kind: LayoutKind, order: str = "nhd", spec: str = "full") -> KVCacheStorage:
    g = group(0, SPECS[spec], (0, 1), block_size=8, kernel_block_size=2)
    return KVCacheStorage(pools_layout((g,), num_blocks=5), kind=kind, page_order=order)


@pytest.mark.parametrize("view_order", ["nhd", "hnd"])
def test_per_layer_kernel_view_indexes_kernel_blocks(view_order: str) -> None:
    storage = _storage(LayoutKind.PER_LAYER)
    kv = storage.kv_view(1, order=view_order)
    kernel = storage.kernel_kv_view(1, order=view_order)
    for manager, tensor in ((kv.key, kernel.key), (kv.value, kernel.value)):
        manager.copy_(torch.randn(manager.shape))
        assert kernel.key.untyped_storage().data_ptr() == storage.buffers[0].data_ptr()
        for b in range(5):
            for j in range(4):
                k = b * 4 + j  # kernel = manager * ratio + j
                if view_order == "nhd":
                    assert tensor.shape[0:2] == (20, 2)
                    assert torch.equal(tensor[k], manager[b, 2 * j : 2 * j + 2])
                else:
                    assert tensor.shape[0] == 20 and tensor.shape[2] == 2
                    assert torch.equal(tensor[k], manager[b, :, 2 * j : 2 * j + 2])


def test_kernel_view_override_and_identity() -> None:
    storage = _storage(LayoutKind.PER_LAYER)
    assert storage.kernel_kv_view(0, kernel_block_size=4).key.shape == (10, 4, 2, 8)
    cross = _storage(LayoutKind.CROSS_LAYER)
    same = cross.kernel_kv_view(0, kernel_block_size=8).key  # ratio 1: the manager view
    assert same.shape == cross.kv_view(0).key.shape
    with pytest.raises(KernelBlockSizeError, match="kernel_block_size: 3 does not divide"):
        storage.kernel_kv_view(0, kernel_block_size=3)


@pytest.mark.parametrize(
    ("kind", "order"),
    [
        (LayoutKind.CROSS_LAYER, "nhd"),
        (LayoutKind.CROSS_LAYER_HEAD_MAJOR, "nhd"),
        (LayoutKind.PER_LAYER, "hnd"),  # HND pages with 2 heads: tokens not outermost
    ],
)
def test_kernel_view_refused_where_strides_cannot_express_it(kind: LayoutKind, order: str) -> None:
    storage = _storage(kind, order)
    with pytest.raises(KernelViewError, match="not uniformly strided"):
        storage.kernel_kv_view(0)


def test_kernel_mla_view() -> None:
    storage = _storage(LayoutKind.PER_LAYER, spec="mla")
    latent = storage.mla_view(1)
    kernel = storage.kernel_mla_view(1)
    latent.copy_(torch.randn(latent.shape))
    assert kernel.shape == (20, 2, 16)
    assert torch.equal(kernel[4 * 3 + 1], latent[3, 2:4])
