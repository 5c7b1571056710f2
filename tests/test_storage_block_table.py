"""Kernel block tables: exact ids, typed errors, and a random-mutation state machine."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hybridkv.storage import (
    BlockRangeError,
    BlockTable,
    KernelBlockSizeError,
    batch_kernel_table,
    kernel_ratio,
)
from test_storage_factories import SPECS, group


def test_kernel_ids_follow_manager_ids() -> None:
    table = BlockTable(4, block_ids=[7, 0, 2])
    assert table.manager_ids.tolist() == [7, 0, 2]
    assert table.kernel_ids.tolist() == [28, 29, 30, 31, 0, 1, 2, 3, 8, 9, 10, 11]
    assert table.kernel_ids.dtype == np.int32
    table.swap(0, 2)
    assert table.kernel_ids.tolist() == [8, 9, 10, 11, 0, 1, 2, 3, 28, 29, 30, 31]
    table.set_null(2)
    assert table.manager_ids.tolist() == [2, 0, 0]
    assert table.kernel_ids[8:].tolist() == [0, 1, 2, 3]
    assert table.pop() == 0
    table.resize(4)
    assert table.manager_ids.tolist() == [2, 0, 0, 0]
    table.truncate(1)
    assert table.kernel_ids.tolist() == [8, 9, 10, 11]
    table.check_invariants()


def test_kernel_ratio_and_override() -> None:
    g = group(0, SPECS["full"], (0,), block_size=16, kernel_block_size=8)
    assert kernel_ratio(g) == 2
    assert kernel_ratio(g, 4) == 4
    with pytest.raises(KernelBlockSizeError, match=r"kernel_block_size: 6 does not divide .* 16"):
        kernel_ratio(g, 6)
    with pytest.raises(KernelBlockSizeError, match="0 does not divide"):
        BlockTable.for_group(g, kernel_block_size=0)
    assert BlockTable.for_group(g, num_blocks=10).ratio == 2


def test_failed_mutations_leave_the_table_unchanged() -> None:
    table = BlockTable(2, num_blocks=8, block_ids=[1, 2])
    before = (table.manager_ids.copy(), table.kernel_ids.copy())
    with pytest.raises(
        BlockRangeError, match=r"\[8\] out of range; valid manager ids are \[0, 8\)"
    ):
        table.extend([3, 8])
    with pytest.raises(BlockRangeError, match="index: 2 is out of range"):
        table.swap(0, 2)
    with pytest.raises(BlockRangeError, match="-1"):
        table.set(0, -1)
    with pytest.raises(BlockRangeError, match=r"length must be in \[0, 2\], got 3"):
        table.truncate(3)
    assert table.manager_ids.tolist() == before[0].tolist()
    assert table.kernel_ids.tolist() == before[1].tolist()
    with pytest.raises(BlockRangeError, match="empty"):
        BlockTable(1).pop()
    with pytest.raises(ValueError, match="read-only"):
        table.kernel_ids[0] = 5


def test_batch_kernel_table_pads_with_null() -> None:
    rows = [BlockTable(2, block_ids=[3]), BlockTable(2, block_ids=[1, 4]), BlockTable(2)]
    out = batch_kernel_table(rows)
    assert out.tolist() == [[6, 7, 0, 0], [2, 3, 8, 9], [0, 0, 0, 0]]
    assert out.dtype == np.int32
    assert batch_kernel_table(rows, width=5).shape == (3, 5)
    with pytest.raises(BlockRangeError, match="width: 3 is shorter than the longest row"):
        batch_kernel_table(rows, width=3)
    with pytest.raises(BlockRangeError, match=r"one ratio, got \[1, 2\]"):
        batch_kernel_table([BlockTable(1), BlockTable(2)])


def test_counts_that_are_bools_floats_or_not_iterable_are_refused() -> None:
    # Found by review: a bool ratio, a float num_blocks (2.5 let id 2 in) and bool lengths or
    # indexes were taken as numbers; extend(5) and a huge pad raised raw TypeError/OverflowError.
    with pytest.raises(KernelBlockSizeError, match="ratio: must be a positive integer, got True"):
        BlockTable(True)  # type: ignore[arg-type]
    for bad in (2.5, True):
        with pytest.raises(BlockRangeError, match=f"num_blocks: must be in .*got {bad}"):
            BlockTable(2, num_blocks=bad)  # type: ignore[arg-type]
    table = BlockTable(1, block_ids=[5, 6])
    with pytest.raises(BlockRangeError, match="truncate: length must be in"):
        table.truncate(True)  # type: ignore[arg-type]
    with pytest.raises(BlockRangeError, match="index: True is out of range"):
        table[True]  # type: ignore[index]
    with pytest.raises(BlockRangeError, match="block_ids: need an iterable of block ids, got int"):
        table.extend(5)  # type: ignore[arg-type]
    for pad in (-5, 2**40, 1.0):
        with pytest.raises(BlockRangeError, match="pad: must be a kernel block id"):
            batch_kernel_table([table], pad=pad)  # type: ignore[arg-type]
    assert table.manager_ids.tolist() == [5, 6] and table[np.int64(1)] == 6
    assert BlockTable(np.int64(2), num_blocks=np.int64(4)).num_blocks == 4


NUM_BLOCKS = 12
ids = st.integers(0, NUM_BLOCKS - 1)


class BlockTableMachine(RuleBasedStateMachine):
    """Mutate a table and a plain list side by side; they must always agree."""

    def __init__(self) -> None:
        super().__init__()
        self.ratio = 3
        self.table = BlockTable(self.ratio, num_blocks=NUM_BLOCKS)
        self.model: list[int] = []

    @rule(block=ids)
    def append(self, block: int) -> None:
        self.table.append(block)
        self.model.append(block)

    @rule(blocks=st.lists(ids, max_size=5))
    def extend(self, blocks: list[int]) -> None:
        self.table.extend(blocks)
        self.model.extend(blocks)

    @rule(blocks=st.lists(st.integers(-2, NUM_BLOCKS + 2), min_size=1, max_size=3))
    def extend_maybe_bad(self, blocks: list[int]) -> None:
        if all(0 <= b < NUM_BLOCKS for b in blocks):
            self.table.extend(blocks)
            self.model.extend(blocks)
        else:
            with pytest.raises(BlockRangeError):
                self.table.extend(blocks)

    @precondition(lambda self: self.model)
    @rule()
    def pop(self) -> None:
        assert self.table.pop() == self.model.pop()

    @rule(data=st.data())
    def truncate(self, data: st.DataObject) -> None:
        n = data.draw(st.integers(0, len(self.model)))
        self.table.truncate(n)
        del self.model[n:]

    @rule(n=st.integers(0, 20))
    def resize(self, n: int) -> None:
        self.table.resize(n)
        self.model = (self.model + [0] * n)[:n]

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def set_null(self, data: st.DataObject) -> None:
        i = data.draw(st.integers(-len(self.model), len(self.model) - 1))
        self.table.set_null(i)
        self.model[i] = 0

    @precondition(lambda self: self.model)
    @rule(data=st.data(), block=ids)
    def set(self, data: st.DataObject, block: int) -> None:
        i = data.draw(st.integers(0, len(self.model) - 1))
        self.table.set(i, block)
        self.model[i] = block

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def swap(self, data: st.DataObject) -> None:
        i = data.draw(st.integers(0, len(self.model) - 1))
        j = data.draw(st.integers(0, len(self.model) - 1))
        self.table.swap(i, j)
        self.model[i], self.model[j] = self.model[j], self.model[i]

    @invariant()
    def consistent(self) -> None:
        self.table.check_invariants()
        assert self.table.manager_ids.tolist() == self.model
        expected = [m * self.ratio + j for m in self.model for j in range(self.ratio)]
        assert self.table.kernel_ids.tolist() == expected
        assert len(self.table) == len(self.model)


# inherits the loaded profile (max_examples, deadline); shorter runs keep the test fast
BlockTableMachine.TestCase.settings = settings(stateful_step_count=25)
TestBlockTableMachine = BlockTableMachine.TestCase
