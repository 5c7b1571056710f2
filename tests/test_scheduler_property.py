"""Property tests of the scheduler's admission policies over random workloads and layouts.

Every step is checked: the manager's invariants hold, and under ``reserve`` a request admitted
with its prompt reserved never takes a prefix-closed block for a later prompt chunk.  Every
request finishes with exactly its ``max_tokens`` outputs."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hst

from hybridkv.cache import KVCacheManager
from hybridkv.scheduler import Scheduler, SchedulerConfig, SchedulerError
from test_cache_factories import full, groups, layout_for, spec_items, state, swa

BASE = list(range(1000, 1064))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    strategy=hst.sampled_from(["uniform", "pools", "arena", "arena_one", "arena_bounded"]),
    extra=hst.lists(spec_items(), max_size=2),
    capacity=hst.integers(14, 40),
    admission=hst.sampled_from(["reserve", "greedy"]),
    requests=hst.lists(
        hst.tuples(hst.integers(0, 24), hst.integers(1, 20), hst.integers(1, 6)),
        min_size=1,
        max_size=6,
    ),
    budget=hst.integers(4, 16),
)
def test_admission_policies_keep_the_cache_consistent(
    strategy: str,
    extra: list[tuple[object, int]],
    capacity: int,
    admission: str,
    requests: list[tuple[int, int, int]],
    budget: int,
) -> None:
    gs = groups((full(), 4), (swa(6), 2), (state(), 4), *extra)  # type: ignore[arg-type]
    mgr = KVCacheManager(layout_for(strategy, gs, capacity))
    sched = Scheduler(
        mgr, SchedulerConfig(token_budget=budget, admission=admission), max_model_len=128
    )
    wanted = {}
    for i, (shared, own, max_tokens) in enumerate(requests):
        rid = f"r{i}"
        prompt = [*BASE[:shared], *range(i * 100, i * 100 + own)]
        sched.add_request(rid, prompt, max_tokens=max_tokens)
        wanted[rid] = max_tokens
    closed = [g for g, m in enumerate(mgr._coord.managers) if m.prefix_closed]
    produced: dict[str, int] = {}
    reserved: set[str] = set()  # admitted with the prompt reserved, not preempted since
    for _ in range(600):
        if not sched.has_unfinished():
            break
        try:
            out = sched.schedule()
        except SchedulerError:  # a request this small cache cannot hold even alone
            return
        for rid in out.preempted:
            reserved.discard(rid)
        for item in out.scheduled:
            seq = sched.seqs[item.request_id]
            prompt = seq.request.num_prompt_tokens
            res = item.allocation
            if item.request_id in reserved and item.start < prompt:
                assert all(res.new_block_ids[g] == () for g in closed), item
            fresh = item.num_cached_tokens == item.start  # an admission (running: start > 0)
            if admission == "reserve" and fresh and not seq.no_reserve:
                reserved.add(item.request_id)  # its whole prompt is reserved
        results = sched.update(out, {s.request_id: 7 for s in out.scheduled if s.samples})
        for r in results:
            produced[r.request_id] = produced.get(r.request_id, 0) + len(r.new_token_ids)
        mgr.check_invariants()
    assert not sched.has_unfinished()
    assert produced == wanted
