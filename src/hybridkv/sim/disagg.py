"""Disaggregated prefill/decode, simulated: a prefill instance and a decode instance, each
with its own cache manager, scheduler and clock, joined by a link.

A request arrives at the prefill instance, which computes its prompt and samples the first
token (``max_tokens=1``, its blocks held).  Its KV and recurrent state then cross the link:
only what the decode instance's own prefix cache lacks (its hit is looked up when the
handover starts), ``bytes / link_bandwidth + link_latency_s`` seconds, after which the
decode instance admits it into its running set
(:meth:`~hybridkv.scheduler.Scheduler.import_computed`) and decodes; the prefill instance
frees the blocks once the transfer is done.  A decode cache too full to take a request
keeps it waiting at the link (the prefill side keeps holding it).  The two instances step
in time order, each charged by the same cost model as :func:`~hybridkv.sim.simulate`.

TTFT is the first token's time on the prefill instance; TPOT the decode instance's time per
later token; the transfer adds to neither directly (it delays the second token).
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hybridkv.cache import KVCacheManager
from hybridkv.scheduler import Scheduler
from hybridkv.sim.cost import ACCELERATORS, ModelProfile, StepCostModel
from hybridkv.sim.simulator import SimConfig, SimulationError, plan_for, scheduler_for
from hybridkv.specs import CacheKind, ModelSpec
from hybridkv.workloads import Workload, WorkloadRequest

__all__ = ["PDResult", "simulate_pd"]


@dataclass
class PDResult:
    """What a disaggregated run measured (see :meth:`summary`)."""

    workload: str
    num_requests: int
    finished: int
    prompt_tokens: int
    prefill_hit_tokens: int
    decode_hit_tokens: int
    transferred_bytes: int
    transfer_s: list[float] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)
    sim_time_s: float = 0.0
    wall_time_s: float = 0.0
    prefill_steps: int = 0
    decode_steps: int = 0
    #: Blocks the two instances' compaction moved (charged at device bandwidth).
    moved_blocks: int = 0
    link_waits: int = 0
    #: Running requests each instance preempted for room (freed, recomputed later).
    prefill_preemptions: int = 0
    decode_preemptions: int = 0
    #: Requests no instance could take (a prompt of ``max_model_len`` tokens or more); they
    #: count as misses in the hit rates, as in :func:`~hybridkv.sim.simulator.simulate`.
    rejected: int = 0
    #: The longest rejected prompt (0 when none was).
    longest_rejected: int = 0
    #: Admitted requests whose outputs were cut at the decode instance's ``max_model_len``.
    truncated: int = 0

    def summary(self) -> dict[str, Any]:
        # None where nothing was measured (no request got a first token, or none a second)
        def mean(values: list[float]) -> float | None:
            return sum(values) / len(values) if values else None

        def p99(values: list[float]) -> float | None:
            s = sorted(values)
            return s[min(len(s) - 1, int(0.99 * len(s)))] if s else None

        p = self.prompt_tokens or 1
        return {
            "mode": "prefill/decode",
            "workload": self.workload,
            "requests": self.num_requests,
            "finished": self.finished,
            "rejected": self.rejected,
            "truncated": self.truncated,
            "prompt_tokens": self.prompt_tokens,
            "prefill_hit_rate": self.prefill_hit_tokens / p,
            "decode_hit_rate": self.decode_hit_tokens / p,
            "transferred_bytes": self.transferred_bytes,
            "transfer_mean_s": mean(self.transfer_s),
            "transfer_p99_s": p99(self.transfer_s),
            "ttft_mean_s": mean(self.ttft_s),
            "ttft_p99_s": p99(self.ttft_s),
            "tpot_mean_s": mean(self.tpot_s),
            "sim_time_s": self.sim_time_s,
            "prefill_steps": self.prefill_steps,
            "moved_blocks": self.moved_blocks,
            "decode_steps": self.decode_steps,
            "link_waits": self.link_waits,
            "prefill_preemptions": self.prefill_preemptions,
            "decode_preemptions": self.decode_preemptions,
            "wall_time_s": self.wall_time_s,
        }


def _instance(model: ModelSpec, config: SimConfig, publish: str) -> Scheduler:
    plan = plan_for(model, config)
    mgr = KVCacheManager(
        plan.layout,
        hasher=config.hasher,
        max_model_len=config.max_model_len,
        publish=publish,
        window_retention=config.window_retention,
        checkpoint_admission=config.checkpoint_admission,
        tier_admission=config.tier_admission,
        second_chance=config.second_chance,
        window_chances=config.window_chances,
        eviction=config.eviction,
        dead_tails=config.dead_tails,
        checkpoint_life=config.checkpoint_life,
        checkpoint_when_full=config.checkpoint_when_full,
    )
    return scheduler_for(mgr, config)


def _block_bytes(sched: Scheduler) -> list[int]:
    return [g.block_bytes for g in sched.manager.layout.groups]


def _transfer_bytes(sched: Scheduler, tables: tuple[list[int], ...], hit: int, n: int) -> int:
    """Bytes of a request's prompt from token ``hit`` on (the blocks its token groups hold
    there in the decode side's ``tables``: none where a sliding window has already dropped
    them, which nothing would read) and its recurrent state (one slot per state group), in the
    decode layout."""
    total = 0
    for g, table in zip(sched.manager.layout.groups, tables, strict=True):
        if g.spec.kind is CacheKind.STATE:
            total += g.block_bytes
        elif n > hit:
            held = table[hit // g.block_size : math.ceil(n / g.block_size)]
            total += sum(1 for b in held if b) * g.block_bytes  # 0: the null block
    return total


def _prefill_step(
    pre: Scheduler,
    cost: StepCostModel,
    by_id: dict[str, WorkloadRequest],
    res: PDResult,
    arrival: dict[str, float],
    first: dict[str, float],
    link: list[tuple[float, str]],
    now: float,
) -> float | None:
    """One prefill step at time ``now``; returns its end time (None: nothing fits now).
    Requests whose first token it samples go onto the link (or finish, when one token is
    all)."""
    out = pre.schedule()
    if out.is_empty:
        return None
    res.prefill_steps += 1
    for item in out.scheduled:  # a request's hit counts once: not again after a preemption
        if (
            item.num_cached_tokens
            and item.start == item.num_cached_tokens
            and pre.seqs[item.request_id].num_preemptions == 0
        ):
            res.prefill_hit_tokens += item.num_cached_tokens
    now += cost.step_seconds([(s.start, s.num_new_tokens) for s in out.scheduled])
    if out.moves:  # compaction's copies, before the pass
        res.moved_blocks += len(out.moves)
        now += cost.moves_seconds(out.moves, _block_bytes(pre))
    sampled = {
        i.request_id: by_id[i.request_id].output_token_ids[0] for i in out.scheduled if i.samples
    }
    for o in pre.update(out, sampled):
        first[o.request_id] = now
        res.ttft_s.append(now - arrival[o.request_id])
        if by_id[o.request_id].output_len <= 1:  # done: nothing to decode
            pre.release(o.request_id)
            res.finished += 1
            continue
        heapq.heappush(link, (now, o.request_id))
    return now


def simulate_pd(
    model: ModelSpec,
    profile: ModelProfile,
    workload: Workload,
    prefill: SimConfig,
    decode: SimConfig,
    *,
    link_bandwidth: float = 50e9,
    link_latency_s: float = 20e-6,
    progress: Callable[[int, int], None] | None = None,
) -> PDResult:
    """Replay ``workload`` through a prefill instance (``prefill``) and a decode instance
    (``decode``) joined by a link of ``link_bandwidth`` bytes/s (see the module doc).
    Raises :class:`SimulationError` for a request no instance can ever take."""
    wall0 = time.perf_counter()
    pre = _instance(model, prefill, prefill.publish)
    dec = _instance(model, decode, "computed")
    pre_cost = StepCostModel(model, profile, ACCELERATORS[prefill.accelerator])
    dec_cost = StepCostModel(model, profile, ACCELERATORS[decode.accelerator])
    limit = min(prefill.max_model_len, decode.max_model_len)
    reqs = [r for r in workload.requests if r.prompt_len < limit]
    by_id: dict[str, WorkloadRequest] = {r.request_id: r for r in reqs}
    res = PDResult(
        workload=workload.name,
        num_requests=len(workload.requests),
        finished=0,
        prompt_tokens=sum(r.prompt_len for r in workload.requests),
        prefill_hit_tokens=0,
        decode_hit_tokens=0,
        transferred_bytes=0,
        rejected=len(workload.requests) - len(reqs),
        longest_rejected=max(
            (r.prompt_len for r in workload.requests if r.prompt_len >= limit), default=0
        ),
        truncated=sum(r.prompt_len + r.output_len > decode.max_model_len for r in reqs),
    )
    # ``use_arrivals`` off: every request is there at time 0, as in simulate()
    arrive = [r.arrival_ms / 1000.0 if prefill.use_arrivals else 0.0 for r in reqs]
    arrival = {r.request_id: t for r, t in zip(reqs, arrive, strict=True)}
    first: dict[str, float] = {}
    link: list[tuple[float, str]] = []  # (ready time, request id) after prefill
    link_free = 0.0
    waiting_link: list[str] = []
    t_pre = t_dec = 0.0
    idx = 0
    inf = float("inf")
    while idx < len(reqs) or pre.has_unfinished() or dec.has_unfinished() or link or waiting_link:
        # the instance whose next event comes first goes: its clock if it has work, else the
        # time of its next input (an arrival; a handover leaving the prefill instance)
        pre_next = t_pre if pre.has_unfinished() else (arrive[idx] if idx < len(reqs) else inf)
        dec_next = t_dec if dec.has_unfinished() or waiting_link else (link[0][0] if link else inf)
        if pre_next == inf and dec_next == inf:
            raise SimulationError("prefill/decode: requests remain but nothing can run")
        if pre_next <= dec_next:
            t_pre = max(t_pre, pre_next)
            while idx < len(reqs) and arrive[idx] <= t_pre:
                r = reqs[idx]
                idx += 1
                pre.add_request(r.request_id, r.prompt_token_ids, max_tokens=1, hold=True)
            if pre.has_unfinished():
                end = _prefill_step(pre, pre_cost, by_id, res, arrival, first, link, t_pre)
                if end is not None:
                    t_pre = end
                elif pre.held and dec_next < inf:  # its cache holds handovers: wait for them
                    t_pre = dec_next + 1e-9
                else:
                    raise SimulationError("prefill instance: nothing schedulable; raise its memory")
            continue
        t_dec = max(t_dec, dec_next)
        while link and link[0][0] <= t_dec:
            waiting_link.append(heapq.heappop(link)[1])
        still: list[str] = []
        for rid in waiting_link:
            r = by_id[rid]
            moved: list[int] = []

            def fill(
                tables: tuple[list[int], ...],
                hit: int,
                _res: Any,
                r: WorkloadRequest = r,
                m: list[int] = moved,
            ) -> None:
                m.append(_transfer_bytes(dec, tables, hit, r.prompt_len))
                m.append(hit)

            max_tokens = max(1, min(r.output_len, decode.max_model_len - r.prompt_len))
            first_token = r.output_token_ids[:1]
            if dec.import_finish(len(r.prompt_token_ids), first_token, max_tokens=max_tokens):
                # its first token already finishes it on the decode side (its max_model_len
                # leaves room for no other): nothing to decode, nothing crosses the link
                # (import_computed refuses it)
                pre.release(rid)
                res.finished += 1
                if progress is not None:
                    progress(res.finished, len(reqs))
                continue
            seq = dec.import_computed(
                rid, r.prompt_token_ids, first_token, max_tokens=max_tokens, fill=fill
            )
            if seq is None:
                still.append(rid)
                res.link_waits += 1
                continue
            nbytes, hit = moved
            start = max(t_dec, link_free)
            took = nbytes / link_bandwidth + link_latency_s
            link_free = start + took
            t_dec = max(t_dec, link_free)  # the decode step after it reads the data
            res.transfer_s.append(took)
            res.transferred_bytes += nbytes
            res.decode_hit_tokens += hit
            pre.release(rid)
        if still and not dec.has_unfinished():
            raise SimulationError(
                f"decode instance: request {still[0]!r} does not fit its empty cache; raise "
                "its memory"
            )
        waiting_link = still
        if not dec.has_unfinished():
            continue
        out = dec.schedule()
        if out.is_empty:
            raise SimulationError("decode instance: nothing schedulable; raise its memory")
        res.decode_steps += 1
        t_dec += dec_cost.step_seconds([(s.start, s.num_new_tokens) for s in out.scheduled])
        if out.moves:
            res.moved_blocks += len(out.moves)
            t_dec += dec_cost.moves_seconds(out.moves, _block_bytes(dec))
        sampled = {}
        for i in out.scheduled:
            if i.samples:
                seq = dec.seqs[i.request_id]
                sampled[i.request_id] = by_id[i.request_id].output_token_ids[seq.num_output_tokens]
        for o in dec.update(out, sampled):
            if o.finished:
                res.finished += 1
                if o.num_output_tokens > 1:
                    res.tpot_s.append((t_dec - first[o.request_id]) / (o.num_output_tokens - 1))
                if progress is not None:
                    progress(res.finished, len(reqs))
    res.sim_time_s = max(t_pre, t_dec)
    res.wall_time_s = time.perf_counter() - wall0
    res.prefill_preemptions = pre.num_preemptions
    res.decode_preemptions = dec.num_preemptions
    return res
