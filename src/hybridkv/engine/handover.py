"""Handing a request from a prefill engine to a decode engine (disaggregated serving).

The prefill side adds the request with ``hold=True`` and ``max_tokens=1``: it computes the
prompt, samples the first token, and keeps the blocks.  :func:`export_request` then
describes it as a :class:`Handover`: prompt, sampled tokens (with their logits when kept),
block tables and the engine's :func:`~hybridkv.storage.connector.register`\\ ation.

The decode side's :func:`import_request` takes its own prefix hit, allocates slots for the
rest of the prompt, plans the transfer of exactly those tokens (and the recurrent state at
the prompt's end) from the prefill side's layout into its own
(:func:`~hybridkv.storage.transfer_plan.plan_transfer`), and has ``pull`` carry the plan out:
a local copy, or a receive over ``torch.distributed``
(:mod:`hybridkv.storage.transport`).  State checkpoints the allocation saves at the
prompt's end are copied from the received state, then the request joins the running set:
the next step computes the first sampled token.  When the pull fails, the request is freed
(the decode engine must publish blocks once computed, ``CacheConfig(publish="computed")``,
so nothing it was receiving is ever a prefix hit) and queued again to be recomputed (the
reason goes into ``reasons`` when the caller passes a dict).
Finally the prefill side :func:`release`\\ s its blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from hybridkv.cache import AllocationResult
from hybridkv.engine.completion import Completion, LiveRequest
from hybridkv.engine.errors import EngineError
from hybridkv.engine.llm_engine import LLMEngine
from hybridkv.engine.tp_shards import (
    Shard,
    TPSplitError,
    gather_from_shards,
    request_tables,
    scatter_to_shards,
    shard_caches,
)
from hybridkv.errors import HybridKVError
from hybridkv.storage import TransferError
from hybridkv.storage.connector import Registration, register_storage
from hybridkv.storage.transfer import copy_blocks
from hybridkv.storage.transfer_plan import TransferPlan, plan_transfer

__all__ = [
    "Handover",
    "export_request",
    "import_request",
    "release",
    "released_tokens",
    "shard_handover",
]


@dataclass(frozen=True, kw_only=True)
class Handover:
    """A prefilled request, as the decode side needs it (plain data: it pickles)."""

    request_id: str
    prompt: tuple[int, ...]
    token_ids: tuple[int, ...]
    logits: tuple[torch.Tensor, ...]
    tables: dict[int, list[int]]
    registration: Registration
    #: The per-rank caches it is held in, when the prefill side is a TP-N instance
    #: (:func:`shard_handover`): registration and block tables of each rank.
    shards: tuple[tuple[Registration, dict[int, list[int]]], ...] = ()

    @property
    def sources(self) -> tuple[tuple[Registration, dict[int, list[int]]], ...]:
        """Where the bytes come from: each rank's cache, or the one cache."""
        return self.shards or ((self.registration, self.tables),)


def export_request(engine: LLMEngine, request_id: str) -> Handover:
    """The :class:`Handover` of a finished request the engine holds (added with
    ``hold=True``).  Raises :class:`EngineError` when it is not held."""
    if request_id not in engine.scheduler.held:
        raise EngineError(f"handover: request {request_id!r} is not a finished, held request")
    done = engine.completions[request_id]
    tables = engine.manager.get_block_ids(request_id)
    return Handover(
        request_id=request_id,
        prompt=done.prompt_token_ids,
        token_ids=done.token_ids,
        logits=done.logits,
        tables={g: list(t) for g, t in enumerate(tables)},
        registration=register_storage(engine.storage, instance=engine.name),
    )


def shard_handover(engine: LLMEngine, handover: Handover, shards: Sequence[Shard]) -> Handover:
    """``handover`` as a TP-``len(shards)`` prefill instance holds it: its tokens and state
    copied into the rank caches ``shards`` (:func:`~hybridkv.engine.tp_shards.shard_caches`
    of the engine's layout, room for the prompt), which its bytes then come from.  Blocks a
    sliding window has dropped from ``handover.tables`` are null in every rank's tables."""
    n = len(handover.prompt)
    scatter_to_shards(engine.storage, handover.registration, handover.tables, shards, (0, n))
    return replace(
        handover,
        shards=tuple((s.registration, request_tables(s, handover.tables)) for s in shards),
    )


def release(engine: LLMEngine, request_id: str) -> None:
    """Free the blocks of a handed-over request on the prefill side."""
    engine.scheduler.release(request_id)


def released_tokens(
    handover: Handover, own: Registration, num_tokens: int
) -> dict[int, list[tuple[int, int]]]:
    """Per group of ``own`` (the decode side's registration), the ranges of tokens
    ``[0, num_tokens)`` the prefill side no longer holds: its sliding-window or local-chunk
    blocks that a null entry of its tables shows released."""
    out: dict[int, list[tuple[int, int]]] = {}
    seen: set[tuple[int, int, int]] = set()
    for i, (reg, tables) in enumerate(handover.sources):
        for d in own.segments:
            s = reg.segment(d.key)
            if d.token_axis is None or s is None or (i, s.group_id, d.group_id) in seen:
                continue
            seen.add((i, s.group_id, d.group_id))
            bs, table = s.block_size, tables.get(s.group_id, ())
            gaps = out.setdefault(d.group_id, [])
            for j, b in enumerate(table[: -(-num_tokens // bs)]):
                if not b:
                    gaps.append((j * bs, min((j + 1) * bs, num_tokens)))
    return {g: r for g, r in out.items() if r}


def import_request(
    engine: LLMEngine,
    handover: Handover,
    *,
    max_tokens: int,
    pull: Callable[[TransferPlan, int, Sequence[torch.Tensor]], None],
    eos_token_ids: Sequence[int] = (),
    decode_tp: int = 1,
    reasons: dict[str, str] | None = None,
) -> bool:
    """Continue ``handover`` on ``engine`` (the decode side), generating up to
    ``max_tokens`` tokens in all (the prefill side's count).  ``pull(plan, source,
    buffers)`` must write the bytes of ``plan`` from ``handover.sources[source]`` into
    ``buffers`` or raise.  ``decode_tp > 1``: the decode side is a TP-``decode_tp``
    instance, emulated (:mod:`hybridkv.engine.tp_shards`): every source is pulled into each
    rank's cache, then the ranks are assembled into the engine's.  Returns True when the
    request runs from the transferred data; False when it was queued to be recomputed
    instead (the cache could not take it now, or planning or the pull raised a
    :class:`HybridKVError` or ``OSError``); then, when ``reasons`` is given,
    ``reasons[request_id]`` says why.
    """
    if engine.cache_config.publish != "computed":
        raise EngineError(
            "handover: the decode engine must publish blocks once computed "
            "(CacheConfig(publish='computed')), so a failed transfer is never a prefix hit"
        )
    rid = handover.request_id
    prompt = handover.prompt
    # A prompt this engine cannot serve (its max_model_len may be the smaller) is refused
    # before anything is pulled (found by review: the recompute fallback raised it instead,
    # after the import had failed on it).
    engine.check_prompt(rid, prompt)
    # The prefill side's token ends it (an EOS, max_tokens, or this side's max_model_len:
    # import_computed refuses those, found by review): nothing to decode or pull.
    done = engine.scheduler.import_finish(
        len(prompt), handover.token_ids, max_tokens=max_tokens, eos_token_ids=eos_token_ids
    )
    if done is not None:
        if rid in engine._live or rid in engine.scheduler.seqs:
            raise EngineError(f"handover: request {rid!r} is already queued")
        engine.completions[rid] = Completion(
            request_id=rid,
            prompt_token_ids=tuple(prompt),
            token_ids=tuple(handover.token_ids),
            finish_reason=done,
            num_cached_tokens=0,
            num_preemptions=0,
            logits=tuple(handover.logits) if engine.keep_logits else (),
        )
        engine._counts["prompt"] += len(prompt)
        engine._counts["gen"] += len(handover.token_ids)
        return True
    own = register_storage(engine.storage, instance=engine.name)
    storage = engine.storage

    def fill(tables: tuple[list[int], ...], hit: int, res: AllocationResult) -> None:
        if engine._tier_store is not None:  # tier loads of the decode side's own hit
            engine._tier_store.sync(engine.manager)
        mine = {g: list(t) for g, t in enumerate(tables)}
        span = (hit, len(prompt))

        def planned(i: int, dst: Registration, dst_tables: dict[int, list[int]]) -> TransferPlan:
            reg, src_tables = handover.sources[i]
            try:
                return plan_transfer(
                    reg, src_tables, dst, dst_tables, tokens=span, unsplit=i == 0, skip=missing
                )
            except TransferError as exc:
                raise TransferError(f"no transfer plan from the prefill side: {exc}") from exc

        if decode_tp == 1:
            for i in range(len(handover.sources)):
                plan = planned(i, own, mine)
                if plan.num_runs or i == 0:
                    pull(plan, i, storage.buffers)
        else:
            try:
                ranks = shard_caches(engine.layout, decode_tp, len(prompt))
            except TPSplitError as exc:
                raise TPSplitError(
                    f"the decode instance cannot hold it at tp {decode_tp}: {exc}"
                ) from exc
            for rank in ranks:
                rank_tables = request_tables(rank, mine)  # not the blocks a window dropped
                for i in range(len(handover.sources)):
                    plan = planned(i, rank.registration, rank_tables)
                    if plan.num_runs:
                        pull(plan, i, rank.storage.buffers)
            gather_from_shards(ranks, storage, own, mine, span)
        for c in res.copies_after:  # checkpoints the allocation saves at the prompt's end
            src = storage.descriptor(c.group_id, [c.src])
            dst = storage.descriptor(c.group_id, [c.dst])
            copy_blocks(src, storage.buffers, dst, storage.buffers)

    reason = (
        "the decode side could not take it now (max_num_seqs requests running, no room in "
        "its cache, or its own prefix hit still loading from a lower tier)"
    )
    try:
        # Window tokens the prefill side released: when its blocks are smaller, this side's
        # first kept block starts before them; they are left unwritten, never published.
        missing = released_tokens(handover, own, len(prompt))
        seq = engine.scheduler.import_computed(
            rid,
            prompt,
            handover.token_ids,
            max_tokens=max_tokens,
            eos_token_ids=eos_token_ids,
            fill=fill,
            missing=missing,
        )
    except (HybridKVError, OSError) as exc:
        seq = None
        reason = str(exc) or type(exc).__name__
    if seq is None:  # recompute it from the prompt here
        if reasons is not None:
            reasons[rid] = reason
        engine.add_request(rid, prompt, max_tokens=max_tokens, eos_token_ids=eos_token_ids)
        return False
    live = LiveRequest(seq, prompt, tokens=list(handover.token_ids))
    if engine.keep_logits:
        live.logits.extend(handover.logits)
    engine._live[rid] = live
    engine._counts["prompt"] += len(prompt)
    engine._tracker.record_import(rid, len(prompt), seq.num_cached_tokens)
    return True
