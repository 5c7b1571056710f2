"""TierStore's host tier under random operation streams (hypothesis): stores in batches (runs
of rows, blocks of several ranges, entries that find no room in the buffer), loads into other
blocks, drops, clears, compaction's relocations among stores, syncs that discard what found
no room; after every step the slots check out and every entry's bytes are the ones its block
held when it was stored."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hybridkv.cache.tiers import TierOp
from hybridkv.engine import host_runs
from hybridkv.engine.errors import EngineError
from hybridkv.engine.tier_store import TierStore
from hybridkv.errors import InvariantError
from hybridkv.storage import KVCacheStorage, LayoutKind, copy_blocks, gather
from test_storage_factories import build, mixed_groups, owned_ids, uniform_layout


class Manager:
    """The two calls :meth:`TierStore.sync` makes of a manager: pending operations, and host
    drops (each records the ``drop`` that sync then runs, as the manager's tiers do)."""

    def __init__(self) -> None:
        self.ops: list[TierOp] = []
        self.discarded: list[tuple[int, int]] = []

    def take_tier_ops(self) -> list[TierOp]:
        ops, self.ops = self.ops, []
        return ops

    def drop_tier_copy(self, tier: str, group_id: int, block_hash: int) -> bool:
        assert tier == "host"
        self.discarded.append((group_id, block_hash))
        self.ops.append(TierOp("drop", "host", group_id, block_hash, 0))
        return True


class HostTier(RuleBasedStateMachine):
    kind = LayoutKind.CROSS_LAYER
    strategy = "pools"
    tier = "host"  # the tier the operations name (a subclass tests the disk tier's runs)

    def __init__(self) -> None:
        super().__init__()
        groups = mixed_groups()
        if self.strategy == "uniform":  # room for every group's blocks
            layout = uniform_layout(groups, num_blocks=32)
        else:
            layout = build(self.strategy, groups)
        self.storage = KVCacheStorage(layout, kind=self.kind)
        gen = torch.Generator().manual_seed(11)
        for buf in self.storage.buffers:
            buf.copy_(torch.randint(0, 256, buf.shape, generator=gen, dtype=torch.uint8))
        self.ids = {
            g.group_id: owned_ids(layout, g.group_id, 0) + owned_ids(layout, g.group_id, 1)
            for g in layout.groups
        }
        sizes = [g.block_bytes for g in layout.groups]
        # room for a few blocks only: later stores get tensors of their own
        self.capacity = 3 * max(sizes) + min(sizes)
        self.store = TierStore(self.storage, self.capacity)
        self.manager = Manager()
        self.held: dict[tuple[int, int], torch.Tensor] = {}
        self.next_hash = 1

    def _bytes(self, g: int, b: int) -> torch.Tensor:
        return gather(self.storage.descriptor(g, [b]), self.storage.buffers).clone()

    @rule(picks=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 99)), min_size=1, max_size=6))
    def store_batch(self, picks: list[tuple[int, int]]) -> None:
        ops = []
        for g, i in picks:
            b = self.ids[g][i % len(self.ids[g])]
            h = self.next_hash
            self.next_hash += 1
            self.held[g, h] = self._bytes(g, b)
            ops.append(TierOp("store", self.tier, g, h, b))
        self.store.apply(ops)

    @precondition(lambda self: bool(self.held))
    @rule(data=st.data(), n=st.integers(1, 4))
    def load_batch(self, data: st.DataObject, n: int) -> None:
        keys = sorted(self.held)
        picked = data.draw(st.lists(st.sampled_from(keys), min_size=1, max_size=n, unique=True))
        ops, want = [], []
        for g, h in picked:
            b = data.draw(st.sampled_from(self.ids[g]))
            if any(op.group_id == g and op.block == b for op in ops):
                continue  # one load per block in a batch
            ops.append(TierOp("load", self.tier, g, h, b))
            want.append((g, b, self.held[g, h]))
        self.store.apply(ops)
        for g, b, data_ in want:
            assert torch.equal(self._bytes(g, b), data_), (g, b)

    @rule(data=st.data(), g=st.integers(0, 5), n=st.integers(1, 6))
    def stores_and_relocations(self, data: st.DataObject, g: int, n: int) -> None:
        """Compaction's ``relocate`` operations among stores, in one batch: a store reads
        its block before a later relocation overwrites it (a borrowed disk write included),
        and relocations run one after the other (a block moved on, a chain).  The storage
        ends as copying the moves one by one on a copy of it leaves that copy."""
        ids, storage = self.ids[g], self.storage
        ref = [buf.clone() for buf in storage.buffers]
        ops, stored = [], {}
        for _ in range(n):
            if data.draw(st.booleans()):
                b = data.draw(st.sampled_from(ids))
                h = self.next_hash
                self.next_hash += 1
                stored[g, h] = gather(storage.descriptor(g, [b]), ref).clone()
                ops.append(TierOp("store", self.tier, g, h, b))
            else:
                src, dst = data.draw(
                    st.lists(st.sampled_from(ids), min_size=2, max_size=2, unique=True)
                )
                copy_blocks(storage.descriptor(g, [src]), ref, storage.descriptor(g, [dst]), ref)
                ops.append(TierOp("relocate", "device", g, 0, dst, from_block=src))
        moved = self.store.relocated
        self.store.apply(ops)
        self.held.update(stored)
        assert self.store.relocated - moved == sum(op.op == "relocate" for op in ops)
        assert all(torch.equal(a, b) for a, b in zip(ref, storage.buffers, strict=True))

    @precondition(lambda self: bool(self.held))
    @rule(data=st.data())
    def drop(self, data: st.DataObject) -> None:
        g, h = data.draw(st.sampled_from(sorted(self.held)))
        self.store.apply([TierOp("drop", self.tier, g, h, 0)])
        del self.held[g, h]

    @rule()
    def clear(self) -> None:
        self.store.apply([TierOp("clear", "", 0, 0, 0)])
        self.held.clear()

    @rule()
    def sync(self) -> None:
        """A sync drops the oldest entries in tensors of their own past the bound (all but
        the newest, with this buffer's bound of a few bytes) from the manager's host tier and
        runs the drops that records before it returns."""
        own = list(self.store._own)
        over = self.store.overflow()
        assert over == own[:-1]  # the bound here is under any block's size
        assert all(self.store._host[k][0] < 0 for k in own)
        before = self.store.overflowed
        self.store.sync(self.manager)  # type: ignore[arg-type]
        assert self.manager.discarded == over and self.store.overflowed - before == len(over)
        self.manager.discarded.clear()
        assert self.store.overflow() == [] and not self.manager.ops
        assert list(self.store._own) == own[-1:]
        for key in over:
            del self.held[key]

    @rule()
    def missing_load_changes_nothing(self) -> None:
        before = [buf.clone() for buf in self.storage.buffers]
        g, b = 0, self.ids[0][0]
        with pytest.raises(Exception, match="does not hold"):
            self.store.apply([TierOp("load", "host", g, 10**9, b)])
        assert all(torch.equal(a, c) for a, c in zip(before, self.storage.buffers, strict=True))

    @invariant()
    def slots_and_bytes_check_out(self) -> None:
        self.store.check_invariants()
        assert self.store.host_keys() == set(self.held)
        for key, data in self.held.items():
            assert torch.equal(self.store._bytes(key), data), key


run_settings = settings(
    max_examples=25,
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@pytest.mark.parametrize("kind", [LayoutKind.CROSS_LAYER, LayoutKind.PER_LAYER])
@pytest.mark.parametrize("strategy", ["pools", "uniform"])
def test_host_tier_state_machine(
    kind: LayoutKind, strategy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(host_runs, "FIRST_RUN_BYTES", 1500)  # runs of one block, then more
    machine = type("Machine", (HostTier,), {"kind": kind, "strategy": strategy})
    machine.TestCase.settings = run_settings
    machine.TestCase().runTest()


def test_check_invariants_catches_overlapping_slots() -> None:
    layout = build("pools", mixed_groups())
    storage = KVCacheStorage(layout)
    store = TierStore(storage, 1 << 16)
    b = owned_ids(layout, 0, 0)[0]
    store.apply([TierOp("store", "host", 0, 1, b), TierOp("store", "host", 0, 2, b)])
    store.check_invariants()
    offset, size = store._host[0, 1]
    store._host[0, 2] = (offset + 1, size)  # a corrupted slot table
    with pytest.raises(InvariantError, match="overlaps"):
        store.check_invariants()


def test_a_relocation_out_of_range_is_an_engine_error_and_copies_nothing() -> None:
    layout = build("pools", mixed_groups())
    storage = KVCacheStorage(layout)
    for buf in storage.buffers:
        buf.copy_(torch.arange(buf.numel()) % 253)
    before = [buf.clone() for buf in storage.buffers]
    store = TierStore(storage, 1 << 16)
    a, b = owned_ids(layout, 0, 0)[0], owned_ids(layout, 0, 1)[0]
    ops = [TierOp("relocate", "device", 0, 0, b, from_block=a)]
    ops.append(TierOp("relocate", "device", 0, 0, 10**6, from_block=b))
    with pytest.raises(EngineError, match=r"tier store: relocate: .*1000000"):
        store.apply(ops)
    assert all(torch.equal(x, y) for x, y in zip(before, storage.buffers, strict=True))
    assert store.relocated == 0


def test_entries_without_room_past_the_bound_are_dropped_oldest_first() -> None:
    """A small slot, a big one (two small ones' bytes) and a small one fill the buffer; both
    small ones are dropped, so a big block's bytes are free in two pieces: the next two big
    stores get tensors of their own (a load in the same operations reads the first), and as
    they hold more than the bound, ``sync`` drops the older from the manager's host tier (and
    runs that drop) and keeps the newer."""
    layout = build("pools", mixed_groups())
    storage = KVCacheStorage(layout)
    gen = torch.Generator().manual_seed(5)
    for buf in storage.buffers:
        buf.copy_(torch.randint(0, 256, buf.shape, generator=gen, dtype=torch.uint8))
    small, big = 0, 2
    s, b = (owned_ids(layout, g, 0) + owned_ids(layout, g, 1) for g in (small, big))
    size = layout.groups[small].block_bytes
    assert layout.groups[big].block_bytes == 2 * size
    store = TierStore(storage, 4 * size)
    assert store.overflow_limit == 4 * size // 64
    mgr = Manager()
    mgr.ops = [
        TierOp("store", "host", small, 1, s[0]),
        TierOp("store", "host", big, 2, b[0]),
        TierOp("store", "host", small, 3, s[1]),
    ]
    store.sync(mgr)  # type: ignore[arg-type]
    assert store.overflow() == [] and mgr.discarded == [] and store.overflowed == 0
    want = gather(storage.descriptor(big, [b[1]]), storage.buffers).clone()
    mgr.ops = [
        TierOp("drop", "host", small, 1, 0),
        TierOp("drop", "host", small, 3, 0),
        TierOp("store", "host", big, 4, b[1]),
        TierOp("load", "host", big, 4, b[2]),
        TierOp("store", "host", big, 5, b[3]),
    ]
    store.sync(mgr)  # type: ignore[arg-type]
    assert torch.equal(gather(storage.descriptor(big, [b[2]]), storage.buffers), want)
    assert mgr.discarded == [(big, 4)] and store.overflowed == 1
    assert store._host[big, 5][0] < 0 and not mgr.ops  # the drop ran in the same sync
    assert store.overflow() == [] and store.host_keys() == {(big, 2), (big, 5)}
    assert store.num_bytes() == 4 * size  # one entry past the buffer's bytes in use, no more
    store.check_invariants()


def test_entries_without_room_within_the_bound_stay() -> None:
    # a buffer of 64 big blocks' bytes bounds its overflow at one big block's: two small
    # entries that find no room stay in tensors of their own
    layout = build("pools", mixed_groups())
    storage = KVCacheStorage(layout)
    small, big = 0, 2
    size = layout.groups[small].block_bytes
    s = owned_ids(layout, small, 0) + owned_ids(layout, small, 1)
    store = TierStore(storage, 64 * 2 * size)
    store._slots.space.top = store._slots.space.limit  # type: ignore[union-attr]  # full
    mgr = Manager()
    mgr.ops = [TierOp("store", "host", small, h, s[h]) for h in (1, 2)]
    store.sync(mgr)  # type: ignore[arg-type]
    assert mgr.discarded == [] and store.overflow() == [] and len(store._own) == 2
    assert store.overflow_limit == layout.groups[big].block_bytes
