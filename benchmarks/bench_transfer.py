"""Copy KV blocks device -> host -> device through transfer descriptors, per layout kind.

For each layout kind (cross-layer, cross-layer head-major, per-layer) and each block-id set
(contiguous ids, random ids), gathers ``--blocks`` blocks of a ``--layers``-layer
full-attention group from a device storage into a host staging buffer (pinned when CUDA is
used), then scatters them into a second device storage, using only the descriptors.  Reports
GB/s per direction, copy calls per block (ranges per block), and the ratio of the throughput to
one contiguous copy of the same number of bytes (1.0 = as fast as a single memcpy).  With
``--device cuda`` it also times committing and releasing one arena chunk through the CUDA VMM
API (needs ``cuda-bindings``); on CPU it times the mmap backend (touch-commit and
``madvise`` release).

    python benchmarks/bench_transfer.py                     # CPU
    python benchmarks/bench_transfer.py --device cuda --blocks 512
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from hybridkv.errors import HybridKVError
from hybridkv.plan import GroupPlan, MemoryLayout, PoolPlan, Strategy
from hybridkv.specs import FullAttentionSpec
from hybridkv.storage import (
    KVCacheStorage,
    LayoutKind,
    OnDemandArena,
    TransferDescriptor,
    gather,
    scatter,
)
from hybridkv.storage.ondemand import CpuMmapBackend, PageBackend

from bench_cli import at_least, out_path


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _paired(
    fns: tuple[Callable[[], object], Callable[[], object]],
    device: torch.device,
    repeats: int,
    reset: Callable[[], object] | None = None,
) -> tuple[float, float]:
    """Best seconds of ``repeats`` interleaved runs of each of two functions (after a warm-up).

    Interleaving and taking the minimum keep the comparison fair on a shared, noisy machine:
    both functions see the same background load, and the minimum is the least disturbed run.
    ``reset`` (untimed) runs before each run of the first function: what it needs to start
    from the same state again.
    """
    best = [float("inf"), float("inf")]
    for fn in fns:
        if reset is not None and fn is fns[0]:
            reset()
        fn()
    _sync(device)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            if reset is not None and i == 0:
                reset()
                _sync(device)
            start = time.perf_counter()
            fn()
            _sync(device)
            best[i] = min(best[i], time.perf_counter() - start)
    return best[0], best[1]


def _layout(args: argparse.Namespace) -> MemoryLayout:
    spec = FullAttentionSpec(num_kv_heads=args.heads, head_dim=args.head_dim, dtype=args.dtype)
    page = spec.bytes_per_block(args.block_size)
    group = GroupPlan(
        group_id=0,
        spec=spec,
        members=tuple((layer, 0) for layer in range(args.layers)),
        block_size=args.block_size,
        kernel_block_size=args.block_size,
        page_bytes=page,
    )
    pool = PoolPlan(
        pool_id=0, group_ids=(0,), block_bytes=group.block_bytes, num_blocks=2 * args.blocks + 1
    )
    return MemoryLayout(strategy=Strategy.POOLS, groups=(group,), pools=(pool,))


def _bench_kind(
    kind: LayoutKind,
    layout: MemoryLayout,
    args: argparse.Namespace,
    device: torch.device,
    host: torch.Tensor,
    id_sets: dict[str, list[int]],
) -> list[dict[str, Any]]:
    src = KVCacheStorage(layout, kind=kind, device=device)
    dst = KVCacheStorage(layout, kind=kind, device=device)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    for buf in src.buffers:
        buf.copy_(torch.randint(0, 256, buf.shape, generator=gen, dtype=torch.uint8, device=device))
    nb = device.type == "cuda"
    rows = []
    for pattern, ids in id_sets.items():
        desc: TransferDescriptor = src.descriptor(0, ids)
        back = dst.descriptor(0, ids)
        total = desc.total_bytes
        staging = host[:total]
        flat_src, flat_dst = src.buffers[0][:total], dst.buffers[0][:total]

        def d2h_desc(d: TransferDescriptor = desc, s: torch.Tensor = staging) -> object:
            return gather(d, src.buffers, s, non_blocking=nb)

        def h2d_desc(d: TransferDescriptor = back, s: torch.Tensor = staging) -> object:
            scatter(d, dst.buffers, s, non_blocking=nb)
            return None

        def d2h_one(s: torch.Tensor = staging, f: torch.Tensor = flat_src) -> object:
            return s.copy_(f, non_blocking=nb)

        def h2d_one(s: torch.Tensor = staging, f: torch.Tensor = flat_dst) -> object:
            return f.copy_(s, non_blocking=nb)

        d2h, d2h_base = _paired((d2h_desc, d2h_one), device, args.repeats)
        h2d, h2d_base = _paired((h2d_desc, h2d_one), device, args.repeats)
        # a clean round trip (the baselines above overwrote staging and dst's first bytes)
        scatter(back, dst.buffers, gather(desc, src.buffers, staging, non_blocking=nb))
        _sync(device)
        same = torch.equal(gather(desc, src.buffers).cpu(), gather(back, dst.buffers).cpu())
        rows.append(
            {
                "kind": kind.value,
                "block_ids": pattern,
                "blocks": len(ids),
                "bytes": total,
                "ranges": len(desc.ranges),
                "copy_calls_per_block": len(desc.ranges) / len(ids),
                "d2h_gbps": total / d2h / 1e9,
                "h2d_gbps": total / h2d / 1e9,
                "contiguous_d2h_gbps": total / d2h_base / 1e9,
                "contiguous_h2d_gbps": total / h2d_base / 1e9,
                "ratio_to_contiguous": (d2h_base + h2d_base) / (d2h + h2d),
                "round_trip_identical": same,
            }
        )
    return rows


def _bench_commit(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """Latency of committing and releasing one chunk (``--chunk-mib``)."""
    chunk = args.chunk_mib << 20
    num_chunks = 4
    backend: PageBackend
    if device.type == "cuda":
        from hybridkv.storage.cuda_vmm import CudaVMMBackend

        backend = CudaVMMBackend(chunk * num_chunks, device=device.index or 0)
        name = "cuda_vmm"
    else:
        backend = CpuMmapBackend(chunk * num_chunks, populate=True)
        name = "cpu_mmap_populate"
    arena = OnDemandArena(
        chunk_bytes=chunk, num_chunks=num_chunks, backend=backend, initial_chunks=(0,)
    )
    commit, release = [], []
    for _ in range(args.repeats):
        start = time.perf_counter()
        arena.commit(1)
        _sync(device)
        commit.append(time.perf_counter() - start)
        start = time.perf_counter()
        arena.release(1)
        _sync(device)
        release.append(time.perf_counter() - start)
    arena.close()
    return {
        "backend": name,
        "chunk_bytes": chunk,
        "page_bytes": backend.page_bytes,
        "commit_ms": min(commit) * 1e3,
        "release_ms": min(release) * 1e3,
        "commit_ms_median": statistics.median(commit) * 1e3,
        "release_ms_median": statistics.median(release) * 1e3,
    }


def add_block_arguments(parser: argparse.ArgumentParser) -> None:
    """The device, the full-attention group whose blocks move, and the timing settings."""
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--blocks", type=int, default=128, help="blocks copied per transfer")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--repeats", type=int, default=9, help="interleaved runs; best is kept")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)"
    )


def check_block_arguments(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> MemoryLayout:
    """Refuse, as one-line errors, what :func:`add_block_arguments` took but cannot run:
    counts below 1, an unknown dtype, CUDA on a machine without it.  Returns the layout."""
    for flag in ("blocks", "layers", "heads", "head_dim", "block_size", "repeats", "threads"):
        at_least(parser, "--" + flag.replace("_", "-"), getattr(args, flag))
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available")
    try:
        return _layout(args)
    except HybridKVError as exc:
        parser.error(str(exc))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_block_arguments(parser)
    parser.add_argument("--chunk-mib", type=int, default=64)
    parser.add_argument("--out", default="results/bench_transfer.json")
    args = parser.parse_args(argv)
    layout = check_block_arguments(parser, args)
    at_least(parser, "--chunk-mib", args.chunk_mib)
    out = out_path(parser, args.out)
    torch.manual_seed(args.seed)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    rng = random.Random(args.seed)
    id_sets = {
        "contiguous": list(range(1, args.blocks + 1)),
        "random": rng.sample(range(1, 2 * args.blocks + 1), args.blocks),
    }
    total = args.blocks * layout.groups[0].used_block_bytes
    host = torch.empty(total, dtype=torch.uint8, pin_memory=device.type == "cuda")
    rows: list[dict[str, Any]] = []
    for kind in LayoutKind:
        rows += _bench_kind(kind, layout, args, device, host, id_sets)
    commit = _bench_commit(args, device)
    result = {
        "benchmark": "bench_transfer",
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "torch_threads": torch.get_num_threads(),
        "block_bytes": layout.groups[0].used_block_bytes,
        "results": rows,
        "chunk_commit": commit,
    }
    print(
        f"{'kind':<24}{'ids':<12}{'calls/blk':>10}{'d2h GB/s':>10}{'h2d GB/s':>10}"
        f"{'1-copy GB/s':>12}{'ratio':>7}"
    )
    for r in rows:
        one = 2 / (1 / r["contiguous_d2h_gbps"] + 1 / r["contiguous_h2d_gbps"])
        print(
            f"{r['kind']:<24}{r['block_ids']:<12}{r['copy_calls_per_block']:>10.3f}"
            f"{r['d2h_gbps']:>10.2f}{r['h2d_gbps']:>10.2f}{one:>12.2f}"
            f"{r['ratio_to_contiguous']:>7.2f}"
        )
    print(
        f"chunk commit/release ({commit['backend']}, {commit['chunk_bytes'] >> 20} MiB): "
        f"{commit['commit_ms']:.3f} ms / {commit['release_ms']:.3f} ms"
    )
    worst = min(r["ratio_to_contiguous"] for r in rows if r["kind"] == LayoutKind.CROSS_LAYER.value)
    per_layer = min(
        r["ratio_to_contiguous"] for r in rows if r["kind"] == LayoutKind.PER_LAYER.value
    )
    print(
        f"summary: {args.device} {args.blocks} blocks x {result['block_bytes'] >> 10} KiB: "
        f"cross-layer ratio to one copy >= {worst:.2f} (target 0.8), per-layer >= "
        f"{per_layer:.2f}; all round trips identical: "
        f"{all(r['round_trip_identical'] for r in rows)}"
    )
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
