"""Moving a :class:`~hybridkv.storage.transfer_plan.TransferPlan` between processes with
``torch.distributed`` (gloo on CPU, NCCL on CUDA).

Both sides hold the same plan (the receiver makes it and sends it over with
:func:`send_object`, or both make it from the same registrations and tables) and derive the
same message schedule from it (:func:`schedule`): a run of at least ``direct_bytes`` is its
own message, sent from and received into the storage buffers themselves (a contiguous slice:
no copy); shorter runs are packed, in run order, into messages of up to ``pack_bytes``.  All
messages go out as one batch of point-to-point operations (``batch_isend_irecv``).

Before any message goes out, the two sides swap a header: the run count, the total bytes,
the message count and a digest of the plan's arrays and of the schedule.  A stale or edited
plan on one side, or different ``direct_bytes`` / ``pack_bytes``, would otherwise put bytes
in the wrong places without an error (a message shorter than the posted buffer is accepted)
or abort the receiving process (a longer one); instead both sides raise
:class:`~hybridkv.storage.errors.TransferError` naming both headers, and no data moves.

A peer that dies or stalls makes the collective raise (after the process group's timeout);
:func:`recv_plan` then raises :class:`~hybridkv.storage.errors.TransferError`, and the bytes
already written into the destination runs must be treated as garbage: the caller recomputes
what the plan was to fill, never reads it.
"""

from __future__ import annotations

import hashlib
import socket
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from hybridkv.storage.errors import TransferError
from hybridkv.storage.transfer_plan import TransferPlan

__all__ = [
    "free_port",
    "header",
    "recv_object",
    "recv_plan",
    "schedule",
    "send_object",
    "send_plan",
]

#: Runs at least this long travel as their own message, straight from / into the buffers.
DIRECT_BYTES = 256 << 10
#: Shorter runs are packed into messages of up to this many bytes.
PACK_BYTES = 8 << 20


def schedule(
    plan: TransferPlan, *, direct_bytes: int = DIRECT_BYTES, pack_bytes: int = PACK_BYTES
) -> list[list[int]]:
    """The messages of ``plan``: each a list of run indices (one long run, or consecutive
    short runs packed together), in the order both sides post them."""
    messages: list[list[int]] = []
    packed: list[int] = []
    size = 0
    for i, n in enumerate(plan.length.tolist()):
        if n >= direct_bytes:
            if packed:
                messages.append(packed)
                packed, size = [], 0
            messages.append([i])
            continue
        if packed and size + n > pack_bytes:
            messages.append(packed)
            packed, size = [], 0
        packed.append(i)
        size += n
    if packed:
        messages.append(packed)
    return messages


#: First word of every transfer header (the bytes ``hkvxfer1``), so a peer that sends
#: something else is told apart from one that disagrees on the plan.
_MAGIC = int.from_bytes(b"hkvxfer1", "little", signed=True)
_HEADER_FIELDS = ("magic", "runs", "bytes", "messages", "digest")


def header(
    plan: TransferPlan, *, direct_bytes: int = DIRECT_BYTES, pack_bytes: int = PACK_BYTES
) -> list[int]:
    """What the two sides of a transfer of ``plan`` swap and compare before any data moves:
    ``[magic, runs, bytes, messages, digest]``, the digest (64 bits of BLAKE2b) covering the
    plan's five arrays and the number of runs in each message."""
    return _header(plan, schedule(plan, direct_bytes=direct_bytes, pack_bytes=pack_bytes))


def _header(plan: TransferPlan, messages: list[list[int]]) -> list[int]:
    h = hashlib.blake2b(digest_size=8)
    for a in (plan.src_buffer, plan.src_offset, plan.dst_buffer, plan.dst_offset, plan.length):
        h.update(np.ascontiguousarray(a, dtype=np.int64).tobytes())
    h.update(np.asarray([len(m) for m in messages], dtype=np.int64).tobytes())
    digest = int.from_bytes(h.digest(), "little", signed=True)
    return [_MAGIC, plan.num_runs, plan.total_bytes, len(messages), digest]


def _agree(mine: list[int], peer: int, group: Any, device: torch.device, what: str) -> None:
    """Swap headers with ``peer``; raise :class:`TransferError` on both sides when they
    differ (each side sees the other's header, so both refuse and no data message is
    posted)."""
    out = torch.tensor(mine, dtype=torch.int64, device=device)
    got = torch.empty_like(out)
    _run(
        [dist.P2POp(dist.isend, out, peer, group), dist.P2POp(dist.irecv, got, peer, group)],
        what,
        peer,
    )
    theirs = [int(v) for v in got.tolist()]
    if theirs == mine:
        return
    if theirs[0] != _MAGIC:
        raise TransferError(
            f"transfer: rank {peer} sent {theirs} where a transfer header starts with "
            f"{_MAGIC}; both sides must call send_plan / recv_plan at the same point"
        )
    diff = ", ".join(
        f"{name} {a} here, {b} on rank {peer}"
        for name, a, b in zip(_HEADER_FIELDS, mine, theirs, strict=True)
        if a != b
    )
    raise TransferError(
        f"transfer: the two sides' plans or thresholds differ ({diff}); both must hold the "
        "same plan and pass the same direct_bytes and pack_bytes; no data was moved"
    )


def _device(buffers: Sequence[torch.Tensor]) -> torch.device:
    return buffers[0].device if len(buffers) else torch.device("cpu")


def _views(plan: TransferPlan, buffers: Sequence[torch.Tensor], side: str) -> list[torch.Tensor]:
    """Each run's contiguous slice of its buffer on ``side`` (``src`` or ``dst``); buffers
    that cannot serve the runs raise :class:`TransferError` before any message goes out."""
    plan.check_buffers(buffers, "source" if side == "src" else "destination")
    bufs = plan.src_buffer if side == "src" else plan.dst_buffer
    offs = plan.src_offset if side == "src" else plan.dst_offset
    return [
        buffers[b][o : o + n]
        for b, o, n in zip(bufs.tolist(), offs.tolist(), plan.length.tolist(), strict=True)
    ]


def send_plan(
    plan: TransferPlan,
    src_buffers: Sequence[torch.Tensor],
    peer: int,
    *,
    group: Any = None,
    direct_bytes: int = DIRECT_BYTES,
    pack_bytes: int = PACK_BYTES,
) -> int:
    """Send the source bytes of ``plan`` to rank ``peer``; returns the bytes sent.  Raises
    :class:`TransferError` when the peer is gone or the transfer times out, and before any
    data moves when the peer's plan or thresholds differ (see :func:`header`)."""
    views = _views(plan, src_buffers, "src")
    messages = schedule(plan, direct_bytes=direct_bytes, pack_bytes=pack_bytes)
    _agree(_header(plan, messages), peer, group, _device(src_buffers), "send")
    tensors = []
    for message in messages:
        if len(message) == 1:
            tensors.append(views[message[0]])
        else:
            tensors.append(torch.cat([views[i] for i in message]))
    _run([dist.P2POp(dist.isend, t, peer, group) for t in tensors], "send", peer)
    return plan.total_bytes


def recv_plan(
    plan: TransferPlan,
    dst_buffers: Sequence[torch.Tensor],
    peer: int,
    *,
    group: Any = None,
    direct_bytes: int = DIRECT_BYTES,
    pack_bytes: int = PACK_BYTES,
) -> int:
    """Receive ``plan``'s bytes from rank ``peer`` into ``dst_buffers``; returns the bytes
    received.  Raises :class:`TransferError` when the peer is gone or the transfer times out
    (the destination runs then hold partial data: recompute them)."""
    views = _views(plan, dst_buffers, "dst")
    messages = schedule(plan, direct_bytes=direct_bytes, pack_bytes=pack_bytes)
    _agree(_header(plan, messages), peer, group, _device(dst_buffers), "receive")
    tensors = []
    for message in messages:
        if len(message) == 1:
            tensors.append(views[message[0]])
        else:
            size = sum(views[i].numel() for i in message)
            tensors.append(torch.empty(size, dtype=torch.uint8, device=views[0].device))
    _run([dist.P2POp(dist.irecv, t, peer, group) for t in tensors], "receive", peer)
    for message, t in zip(messages, tensors, strict=True):
        if len(message) > 1:
            pos = 0
            for i in message:
                n = views[i].numel()
                views[i].copy_(t[pos : pos + n])
                pos += n
    return plan.total_bytes


def _run(ops: list[Any], what: str, peer: int) -> None:
    if not ops:
        return
    try:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    except RuntimeError as exc:  # gloo/NCCL: peer closed, timeout
        raise TransferError(f"transfer: could not {what} from/to rank {peer}: {exc}") from exc


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now, for a process group's rendezvous
    (``MASTER_PORT``)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def send_object(obj: Any, peer: int, *, group: Any = None) -> None:
    """Send a picklable object (request metadata, a registration, a plan) to rank ``peer``."""
    try:
        dist.send_object_list([obj], dst=peer, group=group)
    except RuntimeError as exc:
        raise TransferError(f"transfer: could not send metadata to rank {peer}: {exc}") from exc


def recv_object(peer: int, *, group: Any = None) -> Any:
    """Receive an object :func:`send_object` sent from rank ``peer``."""
    box: list[Any] = [None]
    try:
        dist.recv_object_list(box, src=peer, group=group)
    except RuntimeError as exc:
        raise TransferError(
            f"transfer: could not receive metadata from rank {peer}: {exc}"
        ) from exc
    return box[0]
