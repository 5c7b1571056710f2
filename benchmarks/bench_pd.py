"""Prefill -> decode handover over torch.distributed: a request's blocks, planned between two
instances' layouts, vs one ``send`` of a contiguous tensor of the same bytes.

Two processes (gloo on CPU; ``--device cuda`` uses NCCL and needs two GPUs) each build a
hybrid cache: a full-attention group (``--layers`` layers) and a recurrent-state group, the
decode side with other block ids (shuffled, so no two blocks merge).  The decode side plans
the request's ``--blocks`` blocks and its state slot from the prefill side's registration
(:mod:`hybridkv.storage.transfer_plan`) and pulls them (:mod:`hybridkv.storage.transport`);
interleaved with that, the prefill side sends one contiguous tensor of the same size.
Reports GB/s of both, their ratio (target >= 0.8), the runs per block of each cross-layer
page-size group (target: 1) and whether the bytes arrived exactly.

    python benchmarks/bench_pd.py
    python benchmarks/bench_pd.py --blocks 512 --layers 32
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hybridkv.plan import GroupPlan, MemoryLayout, PoolPlan, Strategy
from hybridkv.specs import FullAttentionSpec, StateMixer, StateSpec, StateTensor
from hybridkv.storage import KVCacheStorage, LayoutKind
from hybridkv.storage.connector import register_storage
from hybridkv.storage.transfer_plan import plan_transfer
from hybridkv.storage.transport import free_port, recv_object, recv_plan, send_object, send_plan

from bench_cli import at_least, out_path


def _layout(args: argparse.Namespace) -> MemoryLayout:
    attn = FullAttentionSpec(num_kv_heads=args.heads, head_dim=args.head_dim, dtype="bf16")
    state = StateSpec(
        mixer=StateMixer.MAMBA2,
        tensors=(
            StateTensor(name="conv", shape=(3, 4096), dtype="bf16"),
            StateTensor(name="ssm", shape=(32, 64, 128), dtype="fp32"),
        ),
    )
    groups = (
        GroupPlan(
            group_id=0,
            spec=attn,
            members=tuple((i, 0) for i in range(args.layers)),
            block_size=args.block_size,
            kernel_block_size=args.block_size,
            page_bytes=attn.bytes_per_block(args.block_size),
        ),
        GroupPlan(
            group_id=1,
            spec=state,
            members=tuple((args.layers + i, 0) for i in range(args.state_layers)),
            block_size=args.block_size * args.blocks,
            kernel_block_size=args.block_size * args.blocks,
            page_bytes=state.bytes_per_block(1),
        ),
    )
    pools = tuple(
        PoolPlan(
            pool_id=g.group_id,
            group_ids=(g.group_id,),
            block_bytes=g.block_bytes,
            num_blocks=2 * args.blocks + 2,
        )
        for g in groups
    )
    return MemoryLayout(strategy=Strategy.POOLS, groups=groups, pools=pools)


def _tables(args: argparse.Namespace, seed: int) -> dict[int, list[int]]:
    ids = list(range(1, 2 * args.blocks + 1))
    random.Random(seed).shuffle(ids)
    return {0: ids[: args.blocks], 1: [1 + seed % 2]}


def _worker(rank: int, port: int, args: argparse.Namespace, box: Any) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    backend = "nccl" if args.device == "cuda" else "gloo"
    dist.init_process_group(
        backend, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120)
    )
    device = torch.device(f"cuda:{rank}" if args.device == "cuda" else "cpu")
    layout = _layout(args)
    storage = KVCacheStorage(layout, kind=LayoutKind.CROSS_LAYER, device=device)
    gen = torch.Generator(device=device).manual_seed(args.seed + rank)
    for buf in storage.buffers:
        buf.copy_(torch.randint(0, 256, buf.shape, generator=gen, dtype=torch.uint8, device=device))
    tables = _tables(args, rank)
    tokens = (0, args.blocks * args.block_size)
    if rank == 0:
        send_object((register_storage(storage, instance="prefill"), tables), 1)
        plan = recv_object(1)
        flat = storage.buffers[0][: plan.total_bytes].clone()
        for _ in range(args.repeats + 1):
            dist.barrier()
            send_plan(plan, storage.buffers, 1)
            dist.barrier()
            dist.send(flat, 1)
        send_object([b.cpu() for b in storage.buffers], 1)
    else:
        src_reg, src_tables = recv_object(0)
        plan = plan_transfer(src_reg, src_tables, register_storage(storage), tables, tokens=tokens)
        send_object(plan, 0)
        flat = torch.empty(plan.total_bytes, dtype=torch.uint8, device=device)
        best_plan = best_one = float("inf")
        for i in range(args.repeats + 1):  # the first round warms up
            dist.barrier()
            start = time.perf_counter()
            recv_plan(plan, storage.buffers, 0)
            t_plan = time.perf_counter() - start
            dist.barrier()
            start = time.perf_counter()
            dist.recv(flat, 0)
            t_one = time.perf_counter() - start
            if i:
                best_plan, best_one = min(best_plan, t_plan), min(best_one, t_one)
        src_buffers = recv_object(0)
        exact = all(
            torch.equal(storage.buffers[db][do : do + n].cpu(), src_buffers[sb][so : so + n])
            for sb, so, db, do, n in plan.runs()
        )
        # a run is the attention group's when it lands inside that group's destination bytes
        attn = storage.descriptor(0, tables[0]).ranges
        runs_attn = sum(
            1
            for _, _, db, do, n in plan.runs()
            if any(
                r.buffer_id == db and r.offset <= do and do + n <= r.offset + r.length for r in attn
            )
        )
        box.put(
            {
                "bytes": plan.total_bytes,
                "runs": plan.num_runs,
                "attention_blocks": args.blocks,
                "attention_runs": runs_attn,
                "state_runs": plan.num_runs - runs_attn,
                "plan_gbps": plan.total_bytes / best_plan / 1e9,
                "one_send_gbps": plan.total_bytes / best_one / 1e9,
                "ratio": best_one / best_plan,
                "exact": exact,
            }
        )
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--blocks", type=int, default=128)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--state-layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="results/bench_pd.json")
    args = parser.parse_args(argv)
    for flag in ("blocks", "layers", "state_layers", "heads", "head_dim", "block_size", "repeats"):
        at_least(parser, "--" + flag.replace("_", "-"), getattr(args, flag))
    if args.device == "cuda" and torch.cuda.device_count() < 2:
        parser.error(
            f"--device cuda: needs two CUDA devices (one per process), this machine has "
            f"{torch.cuda.device_count()}"
        )
    if args.device == "cuda" and not dist.is_nccl_available():
        parser.error("--device cuda: this torch has no NCCL (torch.distributed)")
    out = out_path(parser, args.out)
    port = free_port()
    ctx = mp.get_context("spawn")
    box = ctx.Queue()
    mp.start_processes(_worker, args=(port, args, box), nprocs=2, start_method="spawn")
    row = box.get(timeout=60)
    result = {"config": vars(args), "row": row}
    print(
        f"{row['bytes'] / 2**20:.1f} MiB ({row['attention_blocks']} attention blocks + "
        f"{args.state_layers} state layers' slot): planned {row['plan_gbps']:.2f} GB/s vs one "
        f"send {row['one_send_gbps']:.2f} GB/s, ratio {row['ratio']:.2f} (target >= 0.8); "
        f"runs {row['attention_runs']} for {row['attention_blocks']} attention blocks, "
        f"{row['state_runs']} for the state slot (target: one per block); exact {row['exact']}"
    )
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
