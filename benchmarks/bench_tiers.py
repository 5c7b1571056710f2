"""The engine's host and disk tiers: evicted blocks out and back, vs plain contiguous copies.

Runs :class:`hybridkv.engine.tier_store.TierStore` on the operation stream the manager emits
(one ``store`` per evicted block, one ``load`` per block a hit reads back) for ``--blocks``
blocks of a ``--layers``-layer full-attention group in a cross-layer storage, and times it
against one contiguous copy of the same bytes each way (device -> host, host -> device).
Reports GB/s, the ratio to the contiguous copies (target >= 0.8) and whether the round trip
is byte-identical.  Blocks are copied one at a time, as evictions and hits arrive, into the
store's host buffer, emptied (untimed) before each timed store so that every run writes
the same slots; the per-layer layout is measured too (one range per layer and block).
Each row also says where the time goes: how long the store's calls take to return (on CUDA
the copies they queue are not waited for: the host's own share), and the round trip of the
same blocks as one run each way (one indexed gather / scatter and one copy, no per-block
walk: the most the runs can reach).

The disk half runs the same blocks through the disk tier (:mod:`hybridkv.engine.disk_tier`:
``store`` operations written, checksummed, by its writer thread into a
:class:`~hybridkv.storage.disk_slots.DiskSlots` directory; then every block read and checked
by its reader threads, as before an admission, and loaded to the device) against one plain
sequential ``pwrite`` / ``preadv`` of the same bytes to a preallocated file in the same
directory (target >= 0.7 each way).  By default both sides stay in the page cache; with
``--cold`` both ``fsync`` after writing and drop the file's cached pages before reading
(``posix_fadvise``), so the reads come from the device under the directory.

``--sweep 2,4,8,16`` adds the host round trip at each of those layer counts (block sizes) for
both layouts, as a table (the disk half runs at ``--layers`` only).

    python benchmarks/bench_tiers.py
    python benchmarks/bench_tiers.py --device cuda --blocks 512 --disk-dir /nvme/tmp --cold
    python benchmarks/bench_tiers.py --device cuda --sweep 2,4,8,16
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from hybridkv.cache.tiers import TierOp
from hybridkv.engine.block_places import BlockPlaces
from hybridkv.engine.host_runs import load_rows, store_rows
from hybridkv.engine.tier_store import TierStore
from hybridkv.plan import MemoryLayout
from hybridkv.storage import KVCacheStorage, LayoutKind, gather
from hybridkv.storage.disk_slots import DiskSlots

from bench_cli import at_least, out_path
from bench_transfer import _layout, _paired, _sync, add_block_arguments, check_block_arguments


def _filled(
    kind: LayoutKind, args: argparse.Namespace, device: torch.device
) -> tuple[MemoryLayout, KVCacheStorage, list[int], list[int]]:
    """A storage of random bytes, the block ids evicted to the tier and (as many others) the
    ids hits read back into, shuffled with the benchmark's seed."""
    layout = _layout(args)
    storage = KVCacheStorage(layout, kind=kind, device=device)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    for buf in storage.buffers:
        buf.copy_(torch.randint(0, 256, buf.shape, generator=gen, dtype=torch.uint8, device=device))
    ids = list(range(1, 2 * args.blocks + 1))
    random.Random(args.seed).shuffle(ids)
    return layout, storage, ids[: args.blocks], ids[args.blocks :]


def _bench(kind: LayoutKind, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    layout, storage, evicted, reused = _filled(kind, args, device)
    stores = [TierOp("store", "host", 0, 1000 + i, b) for i, b in enumerate(evicted)]
    loads = [TierOp("load", "host", 0, 1000 + i, b) for i, b in enumerate(reused)]
    store = TierStore(storage, 4 * args.blocks * layout.groups[0].block_bytes)
    total = storage.descriptor(0, evicted).total_bytes
    pin = device.type == "cuda"
    staging = torch.empty(total, dtype=torch.uint8, pin_memory=pin)
    flat = storage.buffers[0][:total]

    def clear() -> object:  # untimed before each store: the same slots are written again
        store.apply([TierOp("clear", "", 0, 0, 0)])
        return None

    def out() -> object:
        store.apply(stores)
        return None

    def back() -> object:
        store.apply(loads)
        return None

    def d2h_one() -> object:
        return staging.copy_(flat)

    def h2d_one() -> object:
        return flat.copy_(staging)

    t_out, t_d2h = _paired((out, d2h_one), device, args.repeats, reset=clear)
    clear()
    out()  # the entries the loads read
    t_back, t_h2d = _paired((back, h2d_one), device, args.repeats)
    # where the time goes: the host's share (until the calls return, queued copies not
    # waited for), and the same blocks as one run each way (one indexed copy, no walk)
    host_out = _host_time(out, device, args.repeats, reset=clear)
    host_back = _host_time(back, device, args.repeats)
    places = BlockPlaces(storage, pin)
    table = places.place(0, evicted[0])[1]
    one = table >= 0 and all(places.place(0, b)[1] == table for b in evicted + reused)
    rows_out = [r for b in evicted for r in places.place(0, b)[2]]
    rows_back = [r for b in reused for r in places.place(0, b)[2]]

    def out_one() -> object:
        return store_rows(places.rows, table, rows_out, staging, pin)

    def back_one() -> object:
        return load_rows(places.rows, table, rows_back, staging, pin)

    t_out_one, _ = _paired((out_one, d2h_one), device, args.repeats) if one else (0.0, 0.0)
    t_back_one, _ = _paired((back_one, h2d_one), device, args.repeats) if one else (0.0, 0.0)
    # a clean round trip: the stored blocks, read back into the other blocks, are identical
    clear()
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
        "store_us": t_out * 1e6,
        "load_us": t_back * 1e6,
        "store_host_us": host_out * 1e6,
        "load_host_us": host_back * 1e6,
        "one_run_ratio": (t_d2h + t_h2d) / (t_out_one + t_back_one) if one else None,
    }


def _host_time(
    fn: Callable[[], object],
    device: torch.device,
    repeats: int,
    reset: Callable[[], object] | None = None,
) -> float:
    """Best seconds until ``fn`` returns, the device idle before each run (on CUDA the copies
    it queues are not waited for: the host's own share of the work); ``reset`` (untimed)
    before each run."""
    best = float("inf")
    for _ in range(max(1, repeats)):
        if reset is not None:
            reset()
        _sync(device)
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    _sync(device)
    return best


def _bench_disk(
    kind: LayoutKind, args: argparse.Namespace, device: torch.device, directory: Path
) -> dict[str, Any]:
    layout, storage, evicted, reused = _filled(kind, args, device)
    block_bytes = layout.groups[0].block_bytes
    ours = directory / f"tier-{kind.value}"
    slots = DiskSlots(ours, 2 * args.blocks * block_bytes, {"bench": kind.value}, [block_bytes])
    store = TierStore(storage, 0, slots, readers=args.readers)
    disk = store.disk
    assert disk is not None
    keys = [(0, 1000 + i) for i in range(args.blocks)]
    stores = [TierOp("store", "disk", 0, h, b) for (_, h), b in zip(keys, evicted, strict=True)]
    loads = [TierOp("load", "disk", 0, h, b) for (_, h), b in zip(keys, reused, strict=True)]
    total = storage.descriptor(0, evicted).total_bytes
    staging = torch.empty(total, dtype=torch.uint8, pin_memory=device.type == "cuda")
    flat = storage.buffers[0][:total]
    plain = directory / f"plain-{kind.value}.bin"
    fd = os.open(plain, os.O_RDWR | os.O_CREAT, 0o644)
    os.posix_fallocate(fd, 0, total)

    def cold(descriptor: int) -> None:
        if args.cold:
            os.fsync(descriptor)
            os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)

    def write_ours() -> None:
        store.apply(stores)
        disk.flush()
        cold(slots._fd)

    def write_plain() -> None:
        view = staging.copy_(flat).numpy().data if device.type == "cuda" else flat.numpy().data
        assert os.pwrite(fd, view, 0) == total
        cold(fd)

    def read_ours() -> None:
        # as check_hit before an admission: every read asked for, waited for; then the loads
        disk.prefetch(keys)
        while disk.reading():
            disk.wait()
        assert all(disk.read_state(k) for k in keys)
        store.apply(loads)
        _sync(device)

    def read_plain() -> None:
        assert os.preadv(fd, [staging.numpy().data], 0) == total
        flat.copy_(staging)
        _sync(device)

    best = {"w": float("inf"), "wp": float("inf"), "r": float("inf"), "rp": float("inf")}
    for i in range(args.repeats + 1):  # the first round warms up, its times are dropped
        store.apply([TierOp("clear", "", 0, 0, 0)])  # untimed: the slots are reused
        disk.flush()
        for name, fn in (
            ("w", write_ours),
            ("wp", write_plain),
            ("r", read_ours),
            ("rp", read_plain),
        ):
            start = time.perf_counter()
            fn()
            if i:
                best[name] = min(best[name], time.perf_counter() - start)
    # a clean round trip: the blocks written, read back into the other blocks, are identical
    store.apply([TierOp("clear", "", 0, 0, 0)])
    write_ours()
    read_ours()
    same = all(
        torch.equal(a, b)
        for a, b in zip(_gathered(storage, evicted), _gathered(storage, reused), strict=True)
    )
    errors = slots.write_errors + disk.bad_reads
    store.close()
    os.close(fd)
    return {
        "kind": kind.value,
        "blocks": args.blocks,
        "bytes": total,
        "write_gbps": total / best["w"] / 1e9,
        "plain_write_gbps": total / best["wp"] / 1e9,
        "read_gbps": total / best["r"] / 1e9,
        "plain_read_gbps": total / best["rp"] / 1e9,
        "write_ratio": best["wp"] / best["w"],
        "read_ratio": best["rp"] / best["r"],
        "round_trip_identical": same and not errors,
        "cold": bool(args.cold),
    }


def _gathered(storage: KVCacheStorage, ids: list[int]) -> list[torch.Tensor]:
    return [gather(storage.descriptor(0, [b]), storage.buffers).cpu() for b in ids]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_block_arguments(parser)
    parser.add_argument("--out", default="results/bench_tiers.json")
    parser.add_argument(
        "--disk-dir", default=None, help="where the disk half writes (default: a temp dir)"
    )
    parser.add_argument("--readers", type=int, default=2, help="disk reader threads")
    parser.add_argument(
        "--cold", action="store_true", help="fsync writes and drop cached pages before reads"
    )
    parser.add_argument(
        "--sweep",
        default="",
        help="comma-separated layer counts: the host round trip at each block size too",
    )
    args = parser.parse_args(argv)
    check_block_arguments(parser, args)
    at_least(parser, "--readers", args.readers)
    if args.disk_dir is not None and not Path(args.disk_dir).is_dir():
        parser.error(f"--disk-dir: {args.disk_dir} is not a directory")
    out = out_path(parser, args.out)
    try:
        sweep = [int(x) for x in args.sweep.split(",") if x.strip()]
    except ValueError:
        parser.error(f"--sweep: {args.sweep!r} is not a comma-separated list of layer counts")
    if any(n <= 0 for n in sweep):
        parser.error(f"--sweep: layer counts must be positive, got {args.sweep!r}")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    kinds = (LayoutKind.CROSS_LAYER, LayoutKind.PER_LAYER)
    rows = [_bench(kind, args, device) for kind in kinds]
    root = Path(args.disk_dir) if args.disk_dir else None
    work = Path(tempfile.mkdtemp(prefix="bench_tiers-", dir=root))
    try:
        disk_rows = [_bench_disk(kind, args, device, work) for kind in kinds]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    sweep_rows = [
        _bench(kind, argparse.Namespace(**{**vars(args), "layers": n}), device)
        for n in sweep
        for kind in kinds
    ]
    result = {
        "config": vars(args),
        "torch_threads": torch.get_num_threads(),
        "rows": rows,
        "disk_rows": disk_rows,
        "sweep": sweep_rows,
    }
    for r in rows:
        print(
            f"{r['kind']:<12} {r['blocks']} blocks, {r['bytes'] / 2**20:.1f} MiB: store "
            f"{r['store_gbps']:.2f} GB/s, load {r['load_gbps']:.2f} GB/s; one contiguous copy "
            f"{r['contiguous_d2h_gbps']:.2f} / {r['contiguous_h2d_gbps']:.2f} GB/s; ratio "
            f"{r['ratio_to_contiguous']:.2f} (target >= 0.8); identical {r['round_trip_identical']}"
        )
        one = r["one_run_ratio"]
        print(
            f"{'':<12} store {r['store_us']:.0f} us ({r['store_host_us']:.0f} us on the host), "
            f"load {r['load_us']:.0f} us ({r['load_host_us']:.0f} us on the host); "
            + ("" if one is None else f"all blocks as one run each way: ratio {one:.2f}")
        )
    for r in disk_rows:
        print(
            f"{r['kind']:<12} disk{' (cold)' if r['cold'] else ''}: write {r['write_gbps']:.2f} "
            f"GB/s vs plain {r['plain_write_gbps']:.2f} (ratio {r['write_ratio']:.2f}), read "
            f"{r['read_gbps']:.2f} GB/s vs plain {r['plain_read_gbps']:.2f} (ratio "
            f"{r['read_ratio']:.2f}) (target >= 0.7); identical {r['round_trip_identical']}"
        )
    if sweep_rows:
        print(
            f"{'block':>9} {'layout':<12} {'store GB/s':>10} {'load GB/s':>9} {'ratio':>6} "
            f"{'host us (store/load)':>21} {'one run':>7}"
        )
        for r in sweep_rows:
            one = r["one_run_ratio"]
            host = f"{r['store_host_us']:.0f} / {r['load_host_us']:.0f}"
            print(
                f"{r['bytes'] // r['blocks'] // 1024:>6} KiB {r['kind']:<12} "
                f"{r['store_gbps']:>10.2f} {r['load_gbps']:>9.2f} {r['ratio_to_contiguous']:>6.2f} "
                f"{host:>21} {'-' if one is None else f'{one:.2f}':>7}"
            )
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
