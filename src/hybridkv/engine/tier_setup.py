"""Setting up an engine's lower cache tiers: the manager's tier specs for a host and a disk
size, the disk directory's fingerprint (what its bytes depend on), and the
:class:`~hybridkv.engine.tier_store.TierStore` over them, with what an earlier process left
in the directory adopted."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import xxhash

from hybridkv.cache import KVCacheManager
from hybridkv.cache.tiers import TierSpec
from hybridkv.engine.tier_store import TierStore
from hybridkv.plan.layout import MemoryLayout
from hybridkv.storage import KVCacheStorage
from hybridkv.storage.disk_slots import FORMAT_VERSION, DiskSlots

__all__ = ["fingerprint", "open_tiers", "tier_specs", "weights_digest"]


def tier_specs(host_bytes: int | None, disk_bytes: int | None) -> tuple[TierSpec, ...]:
    """The lower tiers for a host size and a disk size (None or 0: no such tier)."""
    specs = []
    if host_bytes:
        specs.append(TierSpec("host", host_bytes))
    if disk_bytes:
        specs.append(TierSpec("disk", disk_bytes))
    return tuple(specs)


def open_tiers(
    storage: KVCacheStorage,
    manager: KVCacheManager,
    *,
    host_bytes: int | None,
    disk_dir: str | Path | None,
    disk_bytes: int | None,
    fingerprint: Mapping[str, Any],
) -> TierStore | None:
    """The tier storage for ``manager`` (built with :func:`tier_specs` of the same sizes), or
    None without tiers.  A disk directory an earlier process left is reopened and its entries
    adopted by the manager, oldest first (those that find no room are freed).  Raises
    :class:`~hybridkv.storage.disk_slots.DiskCacheError` for a directory that cannot be used
    (see :class:`~hybridkv.storage.disk_slots.DiskSlots`)."""
    if not host_bytes and not disk_bytes:
        return None
    disk = None
    if disk_dir is not None and disk_bytes:
        sizes = [g.block_bytes for g in storage.layout.groups]
        disk = DiskSlots(disk_dir, disk_bytes, fingerprint, sizes)
    try:
        found = disk.recovered if disk is not None else []
        if found:
            assert disk is not None
            taken = manager.adopt_tier_entries(
                "disk", [(e.group_id, e.block_hash, e.tag) for e in found]
            )
            disk.keep_only((found[i].group_id, found[i].block_hash) for i in taken)
        return TierStore(storage, host_bytes or 0, disk)
    except BaseException:  # the directory's lock is not left held (a host buffer too big)
        if disk is not None:
            disk.close()
        raise


def weights_digest(model: torch.nn.Module) -> str:
    """An XXH3-128 digest of ``model``'s weights and buffers: every entry of its state dict,
    in name order, with its dtype, shape and bytes.  Two models whose KV for the same tokens
    could differ get different digests, whatever they are called: a name alone cannot tell
    two checkpoints of one architecture apart, nor a module built from another seed (found by
    review: a second engine adopted the first one's blocks and generated wrong tokens).  It
    reads every weight once (a copy to host memory first for a tensor elsewhere)."""
    h = xxhash.xxh3_128()
    for name, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().reshape(-1)
        h.update(f"{name}|{t.dtype}|{tuple(tensor.shape)}|".encode())
        if t.numel():
            h.update(t.contiguous().cpu().view(torch.uint8).numpy().data)
    return h.hexdigest()


def fingerprint(
    model: str, dtype: torch.dtype, layout: MemoryLayout, hasher: str, **extra: Any
) -> dict[str, Any]:
    """What a disk cache's bytes depend on: the model (name, dtype, ``extra`` such as the
    digest of its weights, :func:`weights_digest`, or the attention sinks), the layout's
    groups and packing, the block hasher and the file format.  A directory made with another
    one is refused.  The budget's share of the layout (the arena's chunks, the pools' block
    counts) is left out: a block's bytes do not depend on it, so a run with another
    ``--memory`` reuses the cache (found by review: it was refused)."""
    shape = layout.to_dict()
    shape.pop("arena", None)
    shape["pools"] = [
        {k: v for k, v in pool.items() if k != "num_blocks"} for pool in shape["pools"]
    ]
    return {
        "model": model,
        "dtype": str(dtype).removeprefix("torch."),
        "layout": shape,
        "hasher": hasher,
        "format": FORMAT_VERSION,
        **extra,
    }
