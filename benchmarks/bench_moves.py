"""Copy compaction's block moves: one copy per move against ``KVCacheStorage.move_blocks``.

The scheduler's compaction returns moves ``(group, src, dst)``; the engine copies them before
the step's pass.  This builds a catalog model's ``arena`` storage (default gemma-3-27b, the
model compaction was built for) in each layout kind its plan supports, draws ``--moves``
moves per group (fixed seed; sources and destinations distinct, as one compaction's are),
and times copying them one ``copy_blocks`` call per move (two descriptors a move: the
engine's path before ``move_blocks``) against one ``move_blocks`` call (the moves of a
group as one run: on CUDA one gather and one scatter, on the CPU one copy per coalesced
range), interleaved, best of ``--repeats``.  Both must leave identical bytes.

    python benchmarks/bench_moves.py                                # CPU
    python benchmarks/bench_moves.py --device cuda --model gpt-oss-20b --memory 4GiB
"""

from __future__ import annotations

import argparse
import json
import random
from typing import Any

import torch

from hybridkv.errors import HybridKVError
from hybridkv.models.catalog import resolve_model
from hybridkv.plan.planner import make_plan
from hybridkv.storage import KVCacheStorage, LayoutKind, copy_blocks
from hybridkv.storage.errors import LayoutUnsupportedError
from hybridkv.units import parse_bytes

from bench_cli import out_path
from bench_transfer import _paired


def _per_move(storage: KVCacheStorage, moves: list[tuple[int, int, int]]) -> None:
    for g, src, dst in moves:
        copy_blocks(
            storage.descriptor(g, [src]),
            storage.buffers,
            storage.descriptor(g, [dst]),
            storage.buffers,
        )


def _moves(
    storage: KVCacheStorage, group_id: int, count: int, seed: int
) -> list[tuple[int, int, int]]:
    rng = random.Random(seed)
    n = storage.num_blocks(group_id)
    ids = rng.sample(range(1, n), min(n - 1, 2 * count))
    half = len(ids) // 2
    return [(group_id, s, d) for s, d in zip(ids[:half], ids[half : 2 * half], strict=True)]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gemma-3-27b")
    parser.add_argument("--memory", default="1GiB", help="the arena's budget (default: 1GiB)")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--moves", type=int, default=32, help="moves per group (default: 32)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (default: torch's choice; on a machine other work keeps busy, "
        "1 keeps copies from waiting for a second thread)",
    )
    parser.add_argument("--out", default="results/bench_moves.json")
    args = parser.parse_args(argv)
    if args.moves < 1 or args.repeats < 1:
        parser.error(f"--moves and --repeats must be at least 1, got {args.moves}, {args.repeats}")
    if args.threads is not None:
        if args.threads < 1:
            parser.error(f"--threads: must be at least 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: this machine's torch has no CUDA")
    out = out_path(parser, args.out)
    device = torch.device(args.device)
    try:
        plan = make_plan(
            resolve_model(args.model),
            memory_bytes=parse_bytes(args.memory, field="--memory"),
            max_model_len=args.max_model_len,
            strategy="arena",
        )
    except HybridKVError as exc:
        parser.error(str(exc))
    rows: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    for kind in (LayoutKind.CROSS_LAYER, LayoutKind.PER_LAYER):
        try:
            a = KVCacheStorage(plan.layout, kind=kind, device=device)
        except LayoutUnsupportedError as exc:
            skipped[kind.value] = str(exc)
            print(f"{kind.value}: skipped ({exc})")
            continue
        b = KVCacheStorage(plan.layout, kind=kind, device=device)
        gen = torch.Generator().manual_seed(args.seed)
        for x, y in zip(a.buffers, b.buffers, strict=True):
            x.copy_(torch.randint(0, 256, x.shape, generator=gen, dtype=torch.uint8))
            y.copy_(x)
        for g in plan.layout.groups:
            moves = _moves(a, g.group_id, args.moves, args.seed + g.group_id)
            _per_move(a, moves)
            b.move_blocks(moves)
            identical = all(torch.equal(x, y) for x, y in zip(a.buffers, b.buffers, strict=True))
            fns = (
                lambda a=a, m=moves: _per_move(a, m),
                lambda b=b, m=moves: b.move_blocks(m),
            )
            t_one, t_batch = _paired(fns, device, args.repeats)
            nbytes = len(moves) * g.block_bytes
            row = {
                "kind": kind.value,
                "group": g.group_id,
                "block_bytes": g.block_bytes,
                "moves": len(moves),
                "per_move_gbps": nbytes / t_one / 1e9,
                "move_blocks_gbps": nbytes / t_batch / 1e9,
                "speedup": t_one / t_batch,
                "identical": identical,
            }
            rows.append(row)
            print(
                f"{kind.value:12s} group {g.group_id}  {g.block_bytes >> 10:6d} KiB x {len(moves)}:"
                f"  per move {row['per_move_gbps']:6.2f} GB/s   move_blocks"
                f" {row['move_blocks_gbps']:6.2f} GB/s   {row['speedup']:.2f}x"
                f"   identical {identical}"
            )
    result = {
        "config": vars(args),
        "device": str(device),
        "torch_threads": torch.get_num_threads(),
        "rows": rows,
        "skipped": skipped,
    }
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
