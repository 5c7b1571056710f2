"""The tier store and the manager agree at every point the engine looks: a disk copy a
schedule has only decided to write is not read as missing, and the host tier's bound on
entries without room drops the host copy alone, within the same sync (both found by review)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from hybridkv.cache import KVCacheManager, Request, TierSpec
from hybridkv.cache.tiers import TierStack
from hybridkv.engine.tier_store import TierStore
from hybridkv.storage import KVCacheStorage
from hybridkv.storage.disk_slots import DiskSlots
from test_cache_factories import admit, full, groups, layout_for, tokens
from test_storage_factories import build, mixed_groups, owned_ids


def _run(mgr: KVCacheManager, store: TierStore, rid: str, prompt: list[int]) -> None:
    """Admit, compute and free ``rid``, syncing as the engine does."""
    req = mgr.make_request(rid, prompt)
    _, res = admit(mgr, req)
    assert res is not None
    req.num_computed_tokens = req.num_tokens
    store.sync(mgr)
    mgr.free(rid)
    store.sync(mgr)


def _checked(store: TierStore, mgr: KVCacheManager, req: Request) -> int:
    hit = mgr.get_computed_blocks(req)
    for _ in range(1000):
        checked = store.check_hit(mgr, req, hit)
        if checked is not None:
            return checked.num_computed_tokens
        store.wait()
    raise AssertionError("check_hit never settled")


@pytest.mark.parametrize("readers", [0, 2])
def test_a_hit_on_a_copy_moved_to_disk_in_the_same_schedule_is_kept(
    tmp_path: Path, readers: int
) -> None:
    # One block X in a one-block host tier; an admission evicts b's blocks into the host,
    # which moves X down to disk (a `move` not yet run).  A request checked later in the same
    # schedule hits X on disk: its copy is written first, then read, not counted bad.
    layout = layout_for("pools", groups((full(), 4)), 4)
    size = layout.groups[0].block_bytes
    mgr = KVCacheManager(
        layout,
        hasher="builtin",
        tiers=(TierSpec("host", size), TierSpec("disk", 8 * size)),
        tier_ops=True,
    )
    slots = DiskSlots(tmp_path, 8 * size, {"test": 1}, [size])
    store = TierStore(KVCacheStorage(layout), size, slots, readers=readers)
    _run(mgr, store, "a", tokens(5))  # X: a's first block
    _run(mgr, store, "b", tokens(13, 100))  # evicts X to the host
    assert mgr.tier_stats()["host"]["blocks"] == 1 and mgr.tier_stats()["disk"]["blocks"] == 0
    c = mgr.make_request("c", tokens(13, 200))
    assert admit(mgr, c)[1] is not None  # X goes down to disk: an operation, not yet run
    d = mgr.make_request("d", tokens(5))
    hit = mgr.get_computed_blocks(d)
    assert [t for _, _, t in mgr.tier_blocks(d, hit)] == ["disk"]
    assert _checked(store, mgr, d) == 4
    assert store.bad_reads == 0 and mgr.tier_stats()["disk"]["discarded"] == 0
    store.close()


class _Manager:
    """The calls :meth:`TierStore.sync` makes of a manager, on a real :class:`TierStack`."""

    def __init__(self, stack: TierStack) -> None:
        self.stack = stack

    def take_tier_ops(self):  # type: ignore[no-untyped-def]
        return self.stack.take_ops()

    def drop_tier_copy(self, tier: str, group_id: int, block_hash: int) -> bool:
        return self.stack.drop_copy(tier, group_id, block_hash)


def test_the_overflow_bound_drops_the_host_copy_only_and_at_once(tmp_path: Path) -> None:
    # Seeded streams of device evictions of three block sizes into a small host tier over a
    # disk tier, until a sync bounds host entries without room in the buffer whose block is
    # also on disk.  The disk copy stays, nothing counts as discarded, and the manager and
    # the store hold the same host entries when the sync returns.
    layout = build("pools", mixed_groups())
    sizes = [g.block_bytes for g in layout.groups]
    ids = {g: owned_ids(layout, g, 0) for g in range(len(sizes))}
    for seed in range(40):
        rnd = random.Random(seed)
        host = rnd.choice([2048, 2560, 3072, 4096])
        stack = TierStack(
            [TierSpec("host", host), TierSpec("disk", 1 << 20)], sizes, record_ops=True
        )
        slots = DiskSlots(tmp_path / str(seed), 1 << 20, {"seed": seed}, sizes)
        store = TierStore(KVCacheStorage(layout), host, slots, readers=0)
        mgr = _Manager(stack)
        for _ in range(80):
            g, h = rnd.choice([5, 0, 2]), rnd.randrange(30)
            stack.evicted(g, [h], [ids[g][h % len(ids[g])]])
            store.apply(stack.take_ops())
            over = store.overflow()
            on_disk = [k for k in over if k[1] in stack.named("disk").keys[k[0]]]
            if not on_disk:
                continue
            before = stack.stats()
            store.sync(mgr)  # type: ignore[arg-type]
            after = stack.stats()
            assert all(k[1] in stack.named("disk").keys[k[0]] for k in on_disk)
            assert all(k[1] not in stack.named("host").keys[k[0]] for k in over)
            assert after["disk"]["blocks"] == before["disk"]["blocks"]
            assert after["disk"]["discarded"] == after["host"]["discarded"] == 0
            assert after["host"]["dropped"] == before["host"]["dropped"] + len(over)
            assert store.overflowed == len(over)
            assert after["host"]["blocks"] == len(store.host_keys())  # no drop left pending
            stack.check_invariants()
            store.check_invariants()
            store.close()
            return
        store.close()
    raise AssertionError("no seed bounded a host entry that is also on disk")
