"""Transfer plans between two processes over gloo: byte-exact, and a vanished peer is a typed
error, never a silent partial transfer."""

from __future__ import annotations

import dataclasses
import datetime
import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hybridkv.plan import MemoryLayout
from hybridkv.storage import KVCacheStorage, LayoutKind, TransferError
from hybridkv.storage.connector import register
from hybridkv.storage.transfer_plan import plan_transfer
from hybridkv.storage.transport import (
    free_port,
    recv_object,
    recv_plan,
    schedule,
    send_object,
    send_plan,
)
from test_storage_transfer_plan import TOKENS, filled, groups, make, specs, tables


def _init(rank: int, port: int, seconds: float = 60.0) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=seconds)
    )


def _source() -> tuple[MemoryLayout, KVCacheStorage]:
    layout = make("pools", groups(specs(1), 4))
    return layout, filled(layout, LayoutKind.CROSS_LAYER, "nhd", 1)


def _dest() -> tuple[MemoryLayout, KVCacheStorage]:
    layout = make("arena", groups(specs(1), 8))
    return layout, filled(layout, LayoutKind.PER_LAYER, "hnd", 2)


def _handover(rank: int, port: int, direct: int, box: Any) -> None:
    _init(rank, port)
    try:
        if rank == 0:  # prefill: tell the decode side what it has, send what it asks for
            layout, src = _source()
            st = tables(layout, 0)
            send_object((register(src.placement, instance="prefill"), st), 1)
            plan = recv_object(1)
            send_plan(plan, src.buffers, 1, direct_bytes=direct)
        else:  # decode: plan against its own layout, pull, check against a local copy
            layout, dst = _dest()
            dt = tables(layout, 1)
            reg, st = recv_object(0)
            plan = plan_transfer(
                reg, st, register(dst.placement, instance="decode"), dt, tokens=(0, TOKENS)
            )
            send_object(plan, 0)
            recv_plan(plan, dst.buffers, 0, direct_bytes=direct)
            _, want = _dest()
            _, src = _source()
            plan.copy(src.buffers, want.buffers)
            same = all(torch.equal(a, b) for a, b in zip(dst.buffers, want.buffers, strict=True))
            box.put((same, plan.num_runs, len(schedule(plan, direct_bytes=direct))))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("direct", [1, 1 << 30])  # every run its own message / all packed
def test_a_plan_moves_byte_exact_between_processes(direct: int) -> None:
    ctx = mp.get_context("spawn")
    box = ctx.Queue()
    mp.start_processes(_handover, args=(free_port(), direct, box), nprocs=2, start_method="spawn")
    same, runs, messages = box.get(timeout=5)
    assert same
    assert messages == (runs if direct == 1 else 1)


def _vanishing(rank: int, port: int, box: Any) -> None:
    _init(rank, port, seconds=3.0)
    if rank == 0:
        recv_object(1)
        os._exit(0)  # the prefill side dies before it sends anything
    layout, dst = _dest()
    _, src = _source()
    plan = plan_transfer(
        register(src.placement),
        tables(_source()[0], 0),
        register(dst.placement),
        tables(layout, 1),
        tokens=(0, TOKENS),
    )
    send_object("go", 0)
    try:
        recv_plan(plan, dst.buffers, 0)
        box.put("received")
    except TransferError as exc:
        box.put(f"error: {exc}")
    box.close()
    box.join_thread()  # the result is in the pipe before the process ends
    os._exit(0)


def test_a_vanished_peer_is_a_transfer_error() -> None:
    ctx = mp.get_context("spawn")
    box = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_vanishing, args=(rank, port, box)) for rank in range(2)]
    for p in procs:
        p.start()
    result = box.get(timeout=60)
    for p in procs:
        p.join(timeout=30)
    assert result.startswith("error: transfer: could not receive from/to rank 0")


def _mismatch(rank: int, port: int, case: str, box: Any) -> None:
    """Both sides make the same plan; ``case`` then makes the sender's differ.  Each side
    reports what its call did, then both run the agreed transfer on the same group."""
    _init(rank, port)
    try:
        layout, dst = _dest()
        slayout, src = _source()
        plan = plan_transfer(
            register(src.placement),
            tables(slayout, 0),
            register(dst.placement),
            tables(layout, 1),
            tokens=(0, TOKENS),
        )
        direct = 1 << 30
        mine = plan
        if rank == 0 and case == "thresholds":
            direct = 64  # long runs become their own messages on this side only
        if rank == 0 and case == "plan":  # a stale copy: one run a byte shorter
            length = plan.length.copy()
            length[-1] -= 1
            mine = dataclasses.replace(plan, length=length)
        before = [b.clone() for b in dst.buffers]
        try:
            if rank == 0:
                send_plan(mine, src.buffers, 1, direct_bytes=direct)
            else:
                recv_plan(mine, dst.buffers, 0, direct_bytes=direct)
            outcome = "moved"
        except TransferError as exc:
            outcome = f"error: {exc}"
        untouched = all(torch.equal(a, b) for a, b in zip(before, dst.buffers, strict=True))
        # the channel is clean afterwards: the agreed transfer goes through
        if rank == 0:
            send_plan(plan, src.buffers, 1)
        else:
            recv_plan(plan, dst.buffers, 0)
            _, want = _dest()
            plan.copy(src.buffers, want.buffers)
            same = all(torch.equal(a, b) for a, b in zip(dst.buffers, want.buffers, strict=True))
        box.put((rank, outcome, untouched, same if rank == 1 else None))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("case", ["thresholds", "plan"])
def test_sides_that_disagree_both_refuse_before_any_data_moves(case: str) -> None:
    ctx = mp.get_context("spawn")
    box = ctx.Queue()
    mp.start_processes(_mismatch, args=(free_port(), case, box), nprocs=2, start_method="spawn")
    results = dict((r[0], r[1:]) for r in (box.get(timeout=5), box.get(timeout=5)))
    field = "messages" if case == "thresholds" else "bytes"
    for rank, (outcome, untouched, _) in results.items():
        assert outcome.startswith("error: transfer: the two sides' plans or thresholds differ")
        assert f"{field} " in outcome and f"on rank {1 - rank}" in outcome
        assert untouched
    assert results[1][2] is True  # and a transfer both agree on is byte-exact after it
