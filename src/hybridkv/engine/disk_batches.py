"""The disk tier's writer job: one batch of queued writes, drops and clears, run in order on
the writer thread (:class:`~hybridkv.engine.disk_tier.DiskTier` queues them)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Executor

import torch

from hybridkv.storage.disk_slots import DiskCacheError, DiskSlots

__all__ = ["Item", "Key", "Payload", "run_batch"]

logger = logging.getLogger("hybridkv.engine.disk_tier")

Key = tuple[int, int]
#: A write's payload: bytes of a staging tensor the tier owns, or borrowed pieces of the
#: caller's memory (:meth:`~hybridkv.engine.disk_tier.DiskTier.write_borrowed`).
Payload = torch.Tensor | tuple[memoryview, ...]
#: A queued write (key, tag, payload, the CUDA event the bytes are ready at, the tensor to
#: give back once it is written: a staging run's tensor on its last entry, else None) or
#: drop (no payload).
Item = tuple[Key, int, Payload | None, torch.cuda.Event | None, torch.Tensor | None]


def _view(data: Payload) -> memoryview | tuple[memoryview, ...]:
    return data.numpy().data if isinstance(data, torch.Tensor) else data


#: A run's items as :meth:`~hybridkv.storage.disk_slots.DiskSlots.write_many` takes them.
_Run = list[tuple[Key, int, memoryview | tuple[memoryview, ...]]]


def _one_by_one(slots: DiskSlots, run: _Run) -> int:
    """Write ``run`` entry by entry (as :meth:`DiskSlots.write_many` would, without its
    helper); returns how many entries the slots refused (each logged)."""
    refused = 0
    for key, tag, data in run:
        try:
            slots.write(key, tag, data)
        except DiskCacheError as exc:
            refused += 1
            logger.warning("a disk write refused: %s", exc)
    return refused


def run_batch(
    slots: DiskSlots,
    helper: Executor,
    batch: list[Item | None],
    give: Callable[[torch.Tensor], None],
) -> int:
    """Clears (None) and drops in order, each run of writes between them by one
    :meth:`~hybridkv.storage.disk_slots.DiskSlots.write_many` shared with ``helper`` (once
    the CUDA events their bytes are ready at are done); staging tensors go back to ``give``
    once written.  A run with an entry the slots refuse (a payload of a size no slot holds:
    :class:`DiskCacheError`, raised before any change) is written entry by entry, so only
    that entry fails (found by review: the whole run did).  Returns how many runs (or
    refused entries) failed (logged; their entries read as missing, and the batch goes
    on)."""
    failed = 0
    run: _Run = []
    ready: list[torch.cuda.Event] = []
    owners: list[torch.Tensor] = []

    def flush_run() -> None:
        nonlocal failed
        try:
            for event in ready:
                event.synchronize()
            if run:
                try:
                    slots.write_many(run, helper)
                except DiskCacheError:  # an entry refused: the others still go out
                    failed += _one_by_one(slots, run)
        except Exception:  # the run's entries read as missing; the batch goes on
            failed += 1  # (its drops and clears still run), and it is logged
            logger.exception("disk cache: a run of %d writes failed", len(run))
        finally:  # the staging tensors go back whatever happened
            for owner in owners:
                give(owner)
            run.clear()
            ready.clear()
            owners.clear()

    for item in batch:
        if item is None:
            flush_run()
            slots.clear()
            continue
        key, tag, data, event, owner = item
        if data is None:
            flush_run()
            slots.drop(key)
            continue
        run.append((key, tag, _view(data)))
        if event is not None and (not ready or ready[-1] is not event):
            ready.append(event)
        if owner is not None:
            owners.append(owner)
    flush_run()
    return failed
