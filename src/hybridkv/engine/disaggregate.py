"""Disaggregated prefill and decode in two processes over ``torch.distributed``.

:func:`run_disaggregated` spawns a prefill process (rank 0) and a decode process (rank 1)
joined by a gloo process group (NCCL when the engines live on CUDA).  The prefill process
sends the prompt list first, then for each prompt: computes it with ``max_tokens=1`` and
``hold=True``, sends the :class:`~hybridkv.engine.handover.Handover`, receives the decode
side's :class:`~hybridkv.storage.transfer_plan.TransferPlan` (made against the decode
engine's own layout and prefix cache: only the tokens it lacks) and sends those bytes
(:mod:`hybridkv.storage.transport`), then releases the blocks.  The decode process imports
each request (:func:`~hybridkv.engine.handover.import_request`) and decodes it before the
next handover (one request at a time: a demonstration of the handover, not a scheduler
overlapping transfers with decoding), so later turns of a conversation hit what the
decode side computed for earlier ones.  If
the prefill process goes away or stalls past ``timeout`` seconds, the decode process stops
pulling and recomputes every request it has not received intact from its prompt: nothing
is decoded from partial data.  Every recomputed request's reason is kept
(:attr:`DisaggregatedResult.reasons`); a request the prefill process cannot hand over (its
caches do not split over ``prefill_tp``, say) is announced as such and recomputed, the rest
go on.  TP sizes that do not split a model's caches are refused before any process starts
(:func:`check_tp_sizes`).
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hybridkv.engine.errors import EngineError
from hybridkv.engine.handover import export_request, import_request, release, shard_handover
from hybridkv.engine.llm_engine import CacheConfig, Completion, LLMEngine
from hybridkv.engine.tp_shards import Shard, check_tp, shard_caches
from hybridkv.errors import HybridKVError
from hybridkv.specs import CacheSpec
from hybridkv.storage.transfer_plan import TransferPlan
from hybridkv.storage.transport import (
    free_port,
    recv_object,
    recv_plan,
    send_object,
    send_plan,
)

__all__ = ["DisaggregatedResult", "check_tp_sizes", "run_disaggregated"]


@dataclass
class DisaggregatedResult:
    """What the decode process produced: completions by request id, how many requests ran
    from transferred data and how many were recomputed, and the bytes pulled.  ``reasons``:
    why each recomputed request was (request id -> message; one entry per recomputed
    request); ``errors``: what broke the connection to the prefill process, when it did
    (after which every later request, and every later model, is recomputed or not run);
    ``refused``: requests the decode engine cannot serve at all (a prompt past its
    ``max_model_len``), each with its reason in ``reasons``, without a completion."""

    completions: dict[str, Completion]
    imported: int = 0
    recomputed: int = 0
    bytes_pulled: int = 0
    hit_tokens: int = 0
    refused: int = 0
    errors: list[str] = field(default_factory=list)
    reasons: dict[str, str] = field(default_factory=dict)


def check_tp_sizes(model: str, *, prefill_tp: int, decode_tp: int) -> None:
    """Raise :class:`~hybridkv.engine.tp_shards.TPSplitError` (``"prefill_tp: 3: ..."`` or
    ``"decode_tp: ..."``, naming the sizes that would do) unless both sizes split every
    cache of ``model`` the way the emulation splits them (KV heads, state tensors' axis 0).
    Reads the model's config only (the spec :func:`hybridkv.models.spec_from_config`
    derives, which equals what the engine probes); a config it cannot derive is not checked
    here (the prefill process then announces each request it cannot hand over, and the
    decode process records why it recomputed it)."""
    specs: list[CacheSpec] = []  # none: only the sizes' positivity is checked
    if (prefill_tp, decode_tp) != (1, 1):
        from hybridkv.engine.model_source import model_config
        from hybridkv.models import spec_from_config

        try:
            spec = spec_from_config(model_config(model).to_dict())
            specs = [c for layer in spec.layers for c in layer.caches]
        except HybridKVError:
            pass
    for field_name, tp in (("prefill_tp", prefill_tp), ("decode_tp", decode_tp)):
        check_tp(specs, tp, field=field_name, model=str(model))


def _prefill(engine: LLMEngine, prompts: list[list[int]], die_after: int | None, tp: int) -> None:
    send_object(prompts, 1)
    longest = max((len(p) for p in prompts), default=0)
    shards: list[Shard] = []
    refused = None  # why no request can be handed over
    if tp > 1:
        try:
            shards = shard_caches(engine.layout, tp, longest)
        except HybridKVError as exc:
            refused = f"the prefill instance cannot hold it at tp {tp}: {exc}"
    for i, prompt in enumerate(prompts):
        rid = f"r{i}"
        if refused is not None:
            send_object(("failed", refused), 1)
            continue
        try:
            engine.add_request(rid, prompt, max_tokens=1, hold=True)
        except HybridKVError as exc:  # announced: the decode side recomputes it, or refuses
            send_object(("failed", f"the prefill instance cannot serve it: {exc}"), 1)
            continue
        engine.run()
        try:
            handover = export_request(engine, rid)
            if shards:
                handover = shard_handover(engine, handover, shards)
        except HybridKVError as exc:  # announced, not a crash: the decode side recomputes it
            if rid in engine.scheduler.held:
                release(engine, rid)
            send_object(("failed", f"the prefill process could not hand it over: {exc}"), 1)
            continue
        send_object(handover, 1)
        sources = [s.storage.buffers for s in shards] or [engine.storage.buffers]
        while True:  # ("plan", source, plan) ... then ("done",)
            message = recv_object(1)
            if die_after is not None and i >= die_after:
                os._exit(0)  # a prefill instance lost in the middle of a handover
            if message[0] == "done":
                break
            send_plan(message[2], sources[message[1]], 1)
        release(engine, rid)


def _prefill_or_say(
    engine: LLMEngine, prompts: list[list[int]], die_after: int | None, tp: int
) -> bool:
    """:func:`_prefill`; False once it stopped on an error (the decode process out of reach:
    it stopped pulling after a transfer of its failed, say), said in one line on stderr: the
    decode process recomputes what it did not receive, and its result says why (found by
    review: the prefill process ended with a traceback)."""
    try:
        _prefill(engine, prompts, die_after, tp)
    except HybridKVError as exc:
        print(f"hybridkv: prefill process stopped: {exc}", file=sys.stderr)
        return False
    return True


def _decode(
    engine: LLMEngine, max_tokens: int, eos_token_ids: Sequence[int], tp: int
) -> DisaggregatedResult:
    result = DisaggregatedResult(completions={})
    prompts: list[list[int]] = recv_object(0)
    lost = ""  # why the prefill process is out of reach, once it is

    def recompute(rid: str, prompt: list[int], reason: str) -> None:
        try:
            engine.add_request(rid, prompt, max_tokens=max_tokens, eos_token_ids=eos_token_ids)
        except HybridKVError as exc:  # a prompt this engine cannot serve
            result.refused += 1
            result.reasons[rid] = f"the decode instance cannot serve it: {exc}"
            return
        result.recomputed += 1
        result.reasons[rid] = reason

    for i, prompt in enumerate(prompts):
        rid = f"r{i}"
        if lost:
            recompute(rid, prompt, lost)
            continue
        pulled: list[int] = []
        failed: list[BaseException] = []

        def pull(
            plan: TransferPlan,
            source: int,
            buffers: Sequence[torch.Tensor],
            pulled: list[int] = pulled,
            failed: list[BaseException] = failed,
        ) -> None:
            pulled.append(plan.total_bytes)
            try:
                send_object(("plan", source, plan), 0)
                recv_plan(plan, buffers, 0)
            except BaseException as exc:
                failed.append(exc)
                raise

        try:
            handover = recv_object(0)
        except HybridKVError as exc:
            result.errors.append(str(exc))
            lost = f"not handed over: the prefill process was lost at request {rid}"
            recompute(rid, prompt, str(exc))
            continue
        if isinstance(handover, tuple) and handover[0] == "failed":  # announced, not sent
            recompute(rid, prompt, handover[1])
            continue
        try:
            ok = import_request(
                engine,
                handover,
                max_tokens=max_tokens,
                eos_token_ids=eos_token_ids,
                pull=pull,
                decode_tp=tp,
                reasons=result.reasons,
            )
        except HybridKVError as exc:  # this engine cannot serve the prompt at all
            # (found by review: it ended the decode process, and the caller waited for it)
            result.refused += 1
            result.reasons[rid] = f"the decode instance cannot serve it: {exc}"
            if failed:
                result.errors.append(f"request {rid}: transfer failed, refused")
                lost = f"not handed over: the transfer of request {rid} failed"
                continue
        else:
            engine.run()  # decoded before the next handover: later turns hit what it computed
            if ok:
                result.imported += 1
                result.bytes_pulled += sum(pulled)
            else:
                result.recomputed += 1
                if failed:  # a pull failed: the peer is gone or stalled, the stream out of step
                    result.errors.append(f"request {rid}: transfer failed, recomputed")
                    lost = f"not handed over: the transfer of request {rid} failed"
                    continue
        try:
            send_object(("done",), 0)
        except HybridKVError as exc:
            result.errors.append(str(exc))
            lost = f"not handed over: the prefill process was lost after request {rid}"
    engine.run()
    result.completions = dict(engine.completions)
    result.hit_tokens = sum(c.num_cached_tokens for c in result.completions.values())
    return result


def _worker(
    rank: int,
    port: int,
    models: list[str],
    prompts: list[list[int]],
    max_tokens: int,
    eos_token_ids: tuple[int, ...],
    caches: tuple[CacheConfig, CacheConfig],
    timeout: float,
    die_after: int | None,
    seed: int,
    tps: tuple[int, int],
    box: Any,
) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=timeout)
    )
    results: dict[str, DisaggregatedResult] = {}
    for model in models:
        engine = LLMEngine(model, cache=caches[rank], keep_logits=True, seed=seed)
        if rank == 0:
            if not _prefill_or_say(engine, prompts, die_after, tps[0]):
                break
            continue
        results[model] = result = _decode(engine, max_tokens, eos_token_ids, tps[1])
        if result.errors:  # the peer is gone: the models after this one run nowhere
            break
    if rank == 0:
        dist.destroy_process_group()
        return
    # Plain pickle bytes: torch's queue reduction would pass tensors (the logits) as shared
    # memory handles, which die with this process.
    box.put(pickle.dumps(results))
    box.close()
    box.join_thread()  # the result is in the pipe before the process ends
    os._exit(0)  # the process group may be broken (a lost peer): skip its teardown


def _result(box: Any, decode: Any, wait_s: float) -> bytes:
    """The decode process's pickled result from ``box``, waiting at most ``wait_s`` seconds;
    raises :class:`EngineError` as soon as that process has ended without one (found by
    review: the caller waited out the whole timeout, then got a bare ``queue.Empty``)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            data: bytes = box.get(timeout=min(1.0, max(0.01, deadline - time.monotonic())))
            return data
        except queue.Empty:
            if decode.exitcode is not None:
                try:  # its last put may land just after it ended
                    late: bytes = box.get(timeout=1.0)
                    return late
                except queue.Empty:
                    pass
                raise EngineError(
                    f"disaggregated: the decode process ended (exit code {decode.exitcode}) "
                    "without a result; its error is printed above"
                ) from None
            if time.monotonic() >= deadline:
                raise EngineError(
                    f"disaggregated: no result from the decode process within {wait_s:.0f} s"
                ) from None


def run_disaggregated(
    models: list[str],
    prompts: list[list[int]],
    *,
    max_tokens: int,
    eos_token_ids: Sequence[int] = (),
    prefill_cache: CacheConfig,
    decode_cache: CacheConfig,
    timeout: float = 60.0,
    die_after: int | None = None,
    seed: int = 0,
    prefill_tp: int = 1,
    decode_tp: int = 1,
) -> dict[str, DisaggregatedResult]:
    """Serve ``prompts`` (request ids ``r0``, ``r1``, ...) on each model of ``models`` in
    turn with a prefill process and a decode process (see the module doc); returns the
    decode side's result per model.  ``decode_cache`` must publish blocks once computed;
    ``eos_token_ids`` end a request early (the prefill side's first token included).
    ``die_after``: the prefill process exits after sending that request's handover (a test
    of a lost peer); ``seed``: of the built-in models' random weights; ``prefill_tp`` /
    ``decode_tp``: the two instances' tensor-parallel sizes, as a sharded-cache emulation
    (:mod:`hybridkv.engine.tp_shards`: the bytes move between per-rank caches, the model
    computes whole).  Raises :class:`~hybridkv.engine.tp_shards.TPSplitError` before any
    process starts when a size does not split a model's caches (:func:`check_tp_sizes`),
    and :class:`EngineError` once the decode process has ended without a result, or none
    came within ``timeout`` plus 60 s per model."""
    for model in models:
        check_tp_sizes(model, prefill_tp=prefill_tp, decode_tp=decode_tp)
    ctx = mp.get_context("spawn")
    box = ctx.Queue()
    port = free_port()
    caches = (prefill_cache, decode_cache)
    tps = (prefill_tp, decode_tp)
    eos = tuple(eos_token_ids)
    args = (
        port,
        list(models),
        prompts,
        max_tokens,
        eos,
        caches,
        timeout,
        die_after,
        seed,
        tps,
        box,
    )
    procs = [ctx.Process(target=_worker, args=(rank, *args)) for rank in range(2)]
    for p in procs:
        p.start()
    try:
        results: dict[str, DisaggregatedResult] = pickle.loads(
            _result(box, procs[1], timeout + 60 * len(models))
        )
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return results
