"""The disk tier's writer job: one batch of queued writes, drops and clears, run in order on
the writer thread (:class:`~hybridkv.engine.disk_tier.DiskTier` queues them)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Executor

import torch

from hybridkv.storage.disk_slots import DiskSlots

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


def run_batch(
    slots: DiskSlots,
    helper: Executor,
    batch: list[Item | None],
    give: Callable[[torch.Tensor], None],
) -> int:
    """Clears (None) and drops in order, each run of writes between them by one
    :meth:`~hybridkv.storage.disk_slots.DiskSlots.write_many` shared with ``helper`` (once
    the CUDA events their bytes are ready at are done); staging tensors go back to ``give``
    once written.  Returns how many runs failed (logged; their entries read as missing, and
    the batch goes on)."""
    failed = 0
    run: list[tuple[Key, int, memoryview | tuple[memoryview, ...]]] = []
    ready: list[torch.cuda.Event] = []
    owners: list[torch.Tensor] = []

    def flush_run() -> None:
        nonlocal failed
        try:
            for event in ready:
                event.synchronize()
            if run:
                slots.write_many(run, helper)
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
