"""The engine's host tier: evicted blocks out to host memory and back, vs one contiguous copy.

Runs :class:`hybridkv.engine.tier_store.TierStore` on the operation stream the manager emits
(one ``store`` per evicted block, one ``load`` per block a hit reads back) for ``--blocks``
blocks of a ``--layers``-layer full-attention group in a cross-layer storage, and times it
against one contiguous copy of the same bytes each way (device -> host, host -> device).
Reports GB/s, the ratio to the contiguous copies (target >= 0.8) and whether the round trip
is byte-identical.  Blocks are copied one at a time, as evictions and hits arrive, into the
store's host buffer; the per-layer layout is measured too (one range per layer and block).

The disk tier's storage is not built yet, so its half of the issue's benchmark (disk
write/read vs a plain sequential file) is not measured here.

    python benchmarks/bench_tiers.py
    python benchmarks/bench_tiers.py --device cuda --blocks 512
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

import torch

from bench_transfer import _layout, _paired, add_block_arguments
from hybridkv.cache.tiers import TierOp
from hybridkv.engine.tier_store import TierStore
from hybridkv.storage import KVCacheStorage, LayoutKind, gather


def _bench(kind: LayoutKind, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    layout = _layout(args)
    storage = KVCacheStorage(layout, kind=kind, device=device)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    for buf in storage.buffers:
        buf.copy_(torch.randint(0, 256, buf.shape, generator=gen, dtype=torch.uint8, device=device))
    rng = random.Random(args.seed)
    ids = list(range(1, 2 * args.blocks + 1))
    rng.shuffle(ids)
    evicted, reused = ids[: args.blocks], ids[args.blocks :]
    stores = [TierOp("store", "host", 0, 1000 + i, b) for i, b in enumerate(evicted)]
    loads = [TierOp("load", "host", 0, 1000 + i, b) for i, b in enumerate(reused)]
    store = TierStore(storage, 4 * args.blocks * layout.groups[0].block_bytes)
    total = storage.descriptor(0, evicted).total_bytes
    pin = device.type == "cuda"
    staging = torch.empty(total, dtype=torch.uint8, pin_memory=pin)
    flat = storage.buffers[0][:total]

    def out() -> object:
        store.apply([TierOp("clear", "", 0, 0, 0)])  # as a prefix-cache reset: slots reused
        store.apply(stores)
        return None

    def back() -> object:
        store.apply(loads)
        return None

    def d2h_one() -> object:
        return staging.copy_(flat)

    def h2d_one() -> object:
        return flat.copy_(staging)

    out()  # the entries the loads read
    t_out, t_d2h = _paired((out, d2h_one), device, args.repeats)
    out()
    t_back, t_h2d = _paired((back, h2d_one), device, args.repeats)
    # a clean round trip: the stored blocks, read back into the other blocks, are identical
    out()
    back()
    same = all(
        torch.equal(a, b)
        for a, b in zip(_gathered(storage, evicted), _gathered(storage, reused), strict=True)
    )
    return {
        "kind": kind.value,
        "blocks": args.blocks,
        "bytes": total,
        "store_gbps": total / t_out / 1e9,
        "load_gbps": total / t_back / 1e9,
        "contiguous_d2h_gbps": total / t_d2h / 1e9,
        "contiguous_h2d_gbps": total / t_h2d / 1e9,
        "ratio_to_contiguous": (t_d2h + t_h2d) / (t_out + t_back),
        "round_trip_identical": same,
    }


def _gathered(storage: KVCacheStorage, ids: list[int]) -> list[torch.Tensor]:
    return [gather(storage.descriptor(0, [b]), storage.buffers).cpu() for b in ids]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_block_arguments(parser)
    parser.add_argument("--out", default="results/bench_tiers.json")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    rows = [_bench(kind, args, device) for kind in (LayoutKind.CROSS_LAYER, LayoutKind.PER_LAYER)]
    result = {"config": vars(args), "rows": rows}
    for r in rows:
        print(
            f"{r['kind']:<12} {r['blocks']} blocks, {r['bytes'] / 2**20:.1f} MiB: store "
            f"{r['store_gbps']:.2f} GB/s, load {r['load_gbps']:.2f} GB/s; one contiguous copy "
            f"{r['contiguous_d2h_gbps']:.2f} / {r['contiguous_h2d_gbps']:.2f} GB/s; ratio "
            f"{r['ratio_to_contiguous']:.2f} (target >= 0.8); identical {r['round_trip_identical']}"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
