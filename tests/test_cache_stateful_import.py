"""Stateful hypothesis machines with imports (a disaggregated prefill's handover) among the
other calls: a waiting request is admitted whole as computed elsewhere, and random token
ranges of random groups are declared missing (:meth:`KVCacheManager.drop_unread`).  A
refused import changes nothing; an accepted one never lets a group cache a block holding a
token nobody wrote, until some step computes that block in full.  The base machine's checks
(invariants, hits against the oracle, the events' mirror, nothing cached unwritten) run after
every step too."""

from __future__ import annotations

from hypothesis import strategies as hst
from hypothesis.stateful import invariant, precondition, rule

from hybridkv.cache import Request
from hybridkv.cache.errors import UnwrittenTokensError
from test_cache_factories import cached_hashes
from test_cache_stateful import ArenaMachine, CacheMachine


class ImportMachine(CacheMachine):
    strategy = "uniform"

    def __init__(self) -> None:
        super().__init__()
        #: Per group, hashes of blocks an import left partly unwritten (no step wrote them).
        self.partial: dict[int, set[int]] = {}

    def _wrote(self, req: Request) -> None:
        super()._wrote(req)
        done = set(req.block_hashes[: req.num_computed_tokens // req.hash_block_size])
        for hashes in self.partial.values():
            hashes -= done

    @precondition(lambda self: self.waiting)
    @rule(which=hst.integers(0, 7), data=hst.data())
    def import_(self, which: int, data: hst.DataObject) -> None:
        mgr = self._m()
        req = self.waiting[which % len(self.waiting)]
        hit = mgr.get_computed_blocks(req)
        cached, n = hit.num_computed_tokens, req.num_tokens
        res = mgr.allocate_slots(
            req, n - cached, num_new_computed_tokens=cached, new_computed_blocks=hit
        )
        if res is None:
            return
        self.waiting.remove(req)
        req.num_computed_tokens = cached
        managers = mgr._coord.managers
        missing: dict[int, list[tuple[int, int]]] = {}
        for g in range(len(managers)):
            if data.draw(hst.booleans(), label=f"missing in group {g}"):
                a = data.draw(hst.integers(0, n - 1))
                missing[g] = [(a, data.draw(hst.integers(a + 1, n)))]
        before = mgr.snapshot()
        try:
            mgr.drop_unread(req.request_id, n, missing=missing)
        except UnwrittenTokensError:  # a token a later query reads, or a published block
            assert mgr.snapshot() == before
            mgr.free(req.request_id)  # what the scheduler does: only the hit is published
            return
        known = set(self.written)
        done = set(req.block_hashes[: n // req.hash_block_size])
        self.written.update(done)
        tables = mgr.get_block_ids(req.request_id)
        for g in range(len(managers)):
            ranges = missing.get(g, [])
            m = managers[g]
            bs, k = m.block_size, m.stride
            left: set[int] = set()  # this import's blocks of group g holding a missing token
            for j, block in enumerate(tables[g]):
                top = (j + 1) * k - 1
                lo, hi = max(j * bs, cached), min((j + 1) * bs, n)
                if not block or top >= len(req.block_hashes) or lo >= hi:
                    continue
                if any(a < hi and b > lo for a, b in ranges):
                    left.add(req.block_hashes[top])
            partial = self.partial.setdefault(g, set())
            partial -= done - left  # blocks it wrote in full, an earlier import's partial ones
            partial |= left - known
        req.num_computed_tokens = n
        self.running.append(req)

    @invariant()
    def consistent(self) -> None:
        super().consistent()
        if self.mgr is None:
            return
        for g, hashes in enumerate(cached_hashes(self.mgr)):
            assert not hashes & self.partial.get(g, set()), f"group {g} caches unwritten tokens"


class ImportArenaMachine(ImportMachine):
    strategy = "arena"


ImportMachine.TestCase.settings = ArenaMachine.TestCase.settings
ImportArenaMachine.TestCase.settings = ArenaMachine.TestCase.settings
TestImportUniform = ImportMachine.TestCase
TestImportArena = ImportArenaMachine.TestCase
