"""The disk tier's writer job (engine/disk_batches.py): an entry the slots refuse fails alone
(review finding: a payload of a size no slot holds failed its whole run of writes, while the
manager believed every entry of the run on disk)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from hybridkv.engine.disk_tier import DiskTier
from hybridkv.storage.disk_slots import DiskSlots


@pytest.mark.parametrize("bad_size", [0, 128], ids=["empty", "larger-than-a-slot"])
def test_an_entry_no_slot_holds_fails_alone_and_its_run_is_written(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, bad_size: int
) -> None:
    tier = DiskTier(DiskSlots(tmp_path, 4096, {"t": 1}, [64]), readers=1)
    sizes = [64, bad_size, 64]
    data = tier.buffer(sum(sizes))
    data.copy_(torch.arange(sum(sizes)).remainder(251).to(torch.uint8))
    keys = [(0, 1), (0, 2), (0, 3)]
    with caplog.at_level(logging.WARNING, logger="hybridkv.engine.disk_tier"):
        tier.write_run([(k, 0) for k in keys], sizes, data)
        tier.flush()
    assert sorted(tier.slots.entries) == [(0, 1), (0, 3)]
    assert tier.failed_runs == 1 and f"a {bad_size}-byte payload for key (0, 2)" in caplog.text
    tier.check_invariants()
    first, third = tier.take((0, 1)), tier.take((0, 3))
    assert first is not None and third is not None and tier.take((0, 2)) is None
    assert torch.equal(first, data[:64]) and torch.equal(third, data[64 + bad_size :])
    tier.give(first)
    tier.give(third)
    tier.check_invariants()
    tier.close()
