"""The consistency check of :class:`~hybridkv.engine.disk_tier.DiskTier`
(:meth:`~hybridkv.engine.disk_tier.DiskTier.check_invariants`): what the tier keeps
redundant, checked in O(entries held) without I/O.  Run it on the thread that drives the tier
(the step): the writer, helper and reader threads change only the disk slots of keys with a
write queued, the spares (under their lock) and their own jobs' results, none of which the
check reads unguarded.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NoReturn

import torch

from hybridkv.errors import InvariantError

if TYPE_CHECKING:
    from hybridkv.engine.disk_tier import DiskTier

__all__ = ["check_disk_tier"]


def _fail(message: str) -> NoReturn:
    raise InvariantError(f"disk tier: {message}")


def check_disk_tier(tier: DiskTier) -> None:
    """Raise :class:`~hybridkv.errors.InvariantError` at the first broken invariant of
    ``tier`` (see :meth:`~hybridkv.engine.disk_tier.DiskTier.check_invariants`)."""
    for name in ("bad_reads", "expired", "expired_bad", "failed_runs", "_ticks", "_clock"):
        if getattr(tier, name) < 0:
            _fail(f"counter {name} is {getattr(tier, name)} < 0")
    spares = _check_spares(tier)
    _check_staged(tier, spares)
    _check_reads(tier, spares)
    _check_batch(tier, spares)
    _check_queue(tier)


def _check_spares(tier: DiskTier) -> set[int]:
    """The spares against ``_spare_bytes`` and ``max_spare_bytes``; returns their ids."""
    ids: set[int] = set()
    with tier._spare_lock:  # the writer and readers give and take spares too
        total = 0
        for size, tensors in tier._spare.items():
            for data in tensors:
                if data.numel() != size:
                    _fail(f"a {data.numel()}-byte tensor is kept among the {size}-byte spares")
                if id(data) in ids:
                    _fail(f"a {size}-byte spare is kept twice (two buffer() calls would share it)")
                ids.add(id(data))
                total += size
        if total != tier._spare_bytes:
            _fail(f"the spares hold {total} B, spare_bytes says {tier._spare_bytes}")
        if total > tier.max_spare_bytes:
            _fail(f"the spares hold {total} B, over max_spare_bytes={tier.max_spare_bytes}")
    return ids


def _check_staged(tier: DiskTier, spares: set[int]) -> None:
    """Staged copies against their ages (oldest first, none past ``max_staged_ticks``), the
    disk entries they were read from, the spares and the reads in flight."""
    staged, ages = tier.staged, tier._staged_at
    if staged.keys() != ages.keys():
        _fail(
            f"staged copies {sorted(staged.keys() - ages.keys())[:4]} have no age, ages "
            f"{sorted(ages.keys() - staged.keys())[:4]} no staged copy"
        )
    last = 0
    for key, at in ages.items():
        if not last <= at <= tier._ticks:
            _fail(f"staged copy {key}: age {at} out of order (previous {last}, now {tier._ticks})")
        if tier._ticks - at > tier.max_staged_ticks:
            _fail(
                f"staged copy {key} last asked for at tick {at}, now {tier._ticks}: past "
                f"max_staged_ticks={tier.max_staged_ticks}, tick() should have given it back"
            )
        last = at
    owners: set[int] = set()
    for key, data in staged.items():
        if data.dtype != torch.uint8 or data.dim() != 1 or data.device.type != "cpu":
            _fail(f"staged copy {key} is not a 1-D CPU uint8 tensor ({data.dtype}, {data.shape})")
        entry = tier.slots.entries.get(key)  # no write or drop of it is queued (else unstaged)
        if entry is None or entry.size != data.numel():
            held = "no entry" if entry is None else f"an entry of {entry.size} B"
            _fail(f"staged copy {key} holds {data.numel()} B, the disk has {held}")
        if id(data) in spares:
            _fail(f"staged copy {key} is also a spare: the next buffer() would overwrite it")
        if id(data) in owners:
            _fail(f"staged copy {key} shares its tensor with another staged copy")
        owners.add(id(data))
        if key in tier._reads:
            _fail(f"staged copy {key} is also being read")


def _check_reads(tier: DiskTier, spares: set[int]) -> None:
    """Generations and bad marks against the reads in flight (the bound on both), and fresh
    reads against queued writes (a write after a read's ask must have made it stale)."""
    reads, gen, bad = tier._reads, tier._gen, tier._bad_at
    if (tier._clear_queued or tier._clearing is not None) and (reads or tier.staged):
        _fail(f"{len(reads)} reads and {len(tier.staged)} staged copies outlive a clear")
    queued = set(tier._pending_keys) | tier._writing.keys()
    for key, (asked, job) in reads.items():
        if asked > tier._clock:
            _fail(f"read of {key} asked at clock {asked}, after now ({tier._clock})")
        if key not in gen and key in queued:
            _fail(f"read of {key} is not stale though a write or drop of it is queued")
        if job.done() and not job.cancelled() and job.exception() is None:
            result = job.result()
            if key not in result:
                _fail(f"read of {key}: its job's result no longer holds it")
            data = result[key]
            if data is not None and id(data) in spares:
                _fail(f"read of {key}: its copy is also a spare")
    for key, at in gen.items():
        read = reads.get(key)
        if read is None:
            _fail(f"generation of {key} kept with no read of it in flight (unbounded growth)")
        elif not read[0] < at <= tier._clock:
            _fail(f"generation {at} of {key} does not follow its read's ask ({read[0]})")
    last = 0
    for key, at in bad.items():
        read = reads.get(key)
        if read is None or key in gen or not read[1].done():
            _fail(f"bad mark of {key} without a finished, current read of it")
        job = read[1]
        if not job.cancelled() and job.exception() is None and job.result().get(key) is not None:
            _fail(f"bad mark of {key} on a read that found a good copy")
        if not last <= at <= tier._ticks or tier._ticks - at > tier.max_staged_ticks:
            _fail(
                f"bad mark of {key} at tick {at} (previous {last}, now {tier._ticks}): out of "
                f"order or past max_staged_ticks={tier.max_staged_ticks}"
            )
        last = at


def _check_batch(tier: DiskTier, spares: set[int]) -> None:
    """The batch not yet handed over against its byte count, its keys and its clear flag."""
    keys, nbytes, clears = [], 0, 0
    for item in tier._batch:
        if item is None:
            clears += 1
            continue
        key, _, payload, _, owner = item
        keys.append(key)
        if owner is not None:
            nbytes += owner.numel()
            if id(owner) in spares:
                _fail(f"the queued write of {key} uses a spare tensor (it may be overwritten)")
        elif isinstance(payload, tuple):
            nbytes += sum(v.nbytes for v in payload)
    if keys != tier._pending_keys:
        _fail(
            f"the batch writes or drops {keys[:4]}, its pending keys are {tier._pending_keys[:4]}"
        )
    if nbytes != tier._batch_bytes:
        _fail(f"the batch holds {nbytes} B, its count says {tier._batch_bytes}")
    if bool(clears) != tier._clear_queued:
        _fail(f"the batch holds {clears} clears, clear_queued is {tier._clear_queued}")


def _check_queue(tier: DiskTier) -> None:
    """The writer queue against its byte count, ``max_pending_bytes`` and :attr:`_writing`."""
    queue = tier._queue
    total = sum(n for _, n, _ in queue)
    if total != tier._queued_bytes:
        _fail(f"the writer queue holds {total} B, its count says {tier._queued_bytes}")
    if total > tier.max_pending_bytes and len(queue) > 1:
        _fail(
            f"{len(queue)} writer jobs hold {total} B, over max_pending_bytes="
            f"{tier.max_pending_bytes} (only a lone job may)"
        )
    jobs = {id(job): set(keys) for job, _, keys in queue}
    for key, job in tier._writing.items():
        if key not in jobs.get(id(job), ()):
            _fail(f"the queued write of {key} names a job not queued with it (never pruned)")
    clearing = tier._clearing
    if clearing is not None and id(clearing) not in jobs and not clearing.done():
        _fail("the clear in flight is neither queued nor done")
