"""The engine: scheduler, cache manager, storage and model runner behind one ``step()``.

:class:`LLMEngine` wires the whole stack for one causal LM::

    model --probe--> ModelSpec --make_plan--> MemoryLayout --> KVCacheStorage (bytes)
                                                          \\-> KVCacheManager (block ids)
    Scheduler(manager) --ScheduledRequest--> StepBatch --ModelRunner--> logits --argmax-->
    Scheduler.update --> RequestOutput (streamed)

One :meth:`LLMEngine.step`:

1. ``Scheduler.schedule()`` picks the step's requests (running ones first, then admissions
   with their prefix hits), allocates their slots and may preempt (recompute later);
2. every :class:`~hybridkv.scheduler.ScheduledRequest` becomes a
   :class:`~hybridkv.engine.batch.RequestStep` from its block tables and the state zeroing /
   copies its allocation ordered (:func:`~hybridkv.engine.manager_bridge.step_from_tables`);
3. :meth:`ModelRunner.execute` runs them all in one step (one packed forward pass, or one per
   bucket of equal shapes for recurrent models);
4. greedy sampling: the argmax of the last logits of every request whose step reaches the end
   of its known tokens (``samples``);
5. ``Scheduler.update`` appends the tokens, finishes requests (length, EOS, max length) and
   frees their blocks; the step returns the streamed :class:`~hybridkv.scheduler.RequestOutput`.

State copies and preemption: the runner performs, per request, ``zero_before`` and
``copies_before`` before any forward pass of the step and ``copies_after`` after every pass
wrote its states, which is the order :mod:`hybridkv.cache.kinds.state` prescribes.  Requests of
one step never share a slot they write (the runner checks), a checkpoint a hit restores from is
referenced until the restoring step is planned, and a preempted request is not in the step that
preempted it (the scheduler admits nothing in such a step), so no order *between* requests
matters.  A re-admitted request restarts from its hit (a checkpoint restored into a fresh
running slot) or from zero (``zero_before``); tokens it had already generated are recomputed as
a prefill, and each output token is sampled exactly once.

Example (a tiny built-in hybrid model, random weights)::

    >>> from hybridkv.engine import CacheConfig, LLMEngine
    >>> engine = LLMEngine("lfm3", cache=CacheConfig(block_size=4, state_block_size=8))
    >>> [len(c.token_ids) for c in engine.generate([[1, 2, 3], [4, 5]], max_tokens=4)]
    [4, 4]
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from hybridkv.cache import KVCacheManager
from hybridkv.cache.tiers import tier_hit_tokens
from hybridkv.engine.batch import StepBatch
from hybridkv.engine.cache_config import (
    DEFAULT_MAX_MODEL_LEN,
    DEFAULT_MEMORY_BYTES,
    CacheConfig,
    plan_cache,
    preflight_plan,
)
from hybridkv.engine.completion import Completion, LiveRequest
from hybridkv.engine.device import resolve_device
from hybridkv.engine.engine_args import (
    check_engine_args,
    check_eos,
    check_max_tokens,
    check_positions,
    check_speculation,
    resumes_no_prefill,
    token_tuple,
)
from hybridkv.engine.engine_counts import COUNTERS, engine_stats
from hybridkv.engine.errors import (
    BindingError,
    EngineError,
    PromptError,
)
from hybridkv.engine.manager_bridge import step_from_tables
from hybridkv.engine.metrics import CacheTracker, EngineStats
from hybridkv.engine.model_source import (
    config_vocab_size,
    default_max_model_len,
    model_config,
    prompt_problem,
)
from hybridkv.engine.models import load_model
from hybridkv.engine.probe import probe_model, probe_model_spec, with_attention_sinks
from hybridkv.engine.runner import ModelRunner
from hybridkv.engine.speculative import (
    SpeculativeConfig,
    accept_greedy,
    checked_draft,
    no_drafts,
)
from hybridkv.engine.tier_setup import fingerprint, open_tiers, tier_specs, weights_digest
from hybridkv.engine.views import StorageViews
from hybridkv.errors import InvariantError
from hybridkv.plan import Plan
from hybridkv.scheduler import (
    FinishReason,
    RequestOutput,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)
from hybridkv.specs import ModelSpec
from hybridkv.storage import KVCacheStorage

__all__ = [
    "DEFAULT_MAX_MODEL_LEN",
    "DEFAULT_MEMORY_BYTES",
    "CacheConfig",
    "Completion",
    "LLMEngine",
    "config_vocab_size",
    "default_max_model_len",
    "model_config",
    "prompt_problem",
]

logger = logging.getLogger(__name__)


class LLMEngine:
    """Continuous-batching greedy generation over hybridkv's paged hybrid cache.

    ``model``: a tiny built-in model name (:data:`~hybridkv.engine.models.TINY_MODELS`), a
    checkpoint directory (``config.json`` + safetensors; its architecture must be one
    :mod:`hybridkv.models` maps, checked before any weight is loaded), or a loaded transformers
    causal LM (used in place: it is switched to the paged attention implementation, so take a
    :func:`~hybridkv.engine.models.reference_copy` first if you need the original).  Names and
    directories are loaded with ``dtype`` and ``seed`` and moved to ``device``; a given model
    stays where it is and the cache follows it.

    The plan comes from what the model really caches (:func:`probe_model_spec`).  For a name or
    a directory, the same plan is first made from the config alone (:func:`model_config`,
    :func:`hybridkv.models.spec_from_config`), so a bad device, an unmapped architecture or a
    budget that holds no request raises before any weight is loaded.
    ``scheduler`` defaults to :class:`SchedulerConfig` (``collect_block_ids`` is forced on: the
    runner needs the tables).  ``keep_logits`` keeps every sampled token's logits in its
    :class:`Completion`.  Finished requests accumulate in :attr:`completions` (request id ->
    :class:`Completion`) until the caller removes them.

    Raises :class:`~hybridkv.engine.errors.DeviceError` (a device this torch does not have),
    :class:`~hybridkv.engine.errors.ModelSourceError` (unknown name, no config),
    :class:`~hybridkv.errors.UnsupportedModelTypeError` (architecture not mapped),
    :class:`~hybridkv.errors.PlanError` (budget too small, bad sizes) and
    :class:`~hybridkv.engine.errors.BindingError` (layout does not fit the model).
    """

    def __init__(
        self,
        model: str | Path | torch.nn.Module,
        *,
        cache: CacheConfig | None = None,
        scheduler: SchedulerConfig | None = None,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
        keep_logits: bool = False,
        speculative: SpeculativeConfig | None = None,
    ) -> None:
        check_engine_args(model, cache, scheduler, seed, speculative)
        self.cache_config = cache = cache or CacheConfig()
        self._closed = False  # close() ran on an engine with tiers: no more steps
        device = resolve_device(device)
        if isinstance(model, torch.nn.Module):
            net: Any = model
            name = str(getattr(net.config, "name_or_path", "") or net.config.model_type)
            check_positions(name, net.config, cache.max_model_len)
        else:
            name = str(model)
            config = model_config(model)
            check_positions(name, config, cache.max_model_len)
            max_len = cache.max_model_len or default_max_model_len(config)
            derived = preflight_plan(config, dtype, max_len, cache)
            if speculative is not None and derived is not None and resumes_no_prefill(derived):
                raise no_drafts(name)
            net = load_model(model, seed=seed, dtype=dtype).to(device)
        self.name = name
        probe = with_attention_sinks(probe_model(net), cache.attention_sinks)
        self.spec: ModelSpec = probe_model_spec(probe, name=name)
        self.max_model_len = cache.max_model_len or default_max_model_len(net.config)
        if cache.attention_sinks >= self.max_model_len:
            raise BindingError(
                f"attention_sinks: {cache.attention_sinks} sink tokens cover every position of "
                f"max_model_len {self.max_model_len}, so no sliding-window block could ever "
                f"leave the window; give fewer than {self.max_model_len}"
            )
        self.plan: Plan = plan_cache(self.spec, self.max_model_len, cache)
        self.layout = self.plan.layout
        device = next(net.parameters()).device
        self.storage = KVCacheStorage(self.layout, device=device)
        self.runner = ModelRunner(net, self.layout, StorageViews(self.storage), probe=probe)
        self.model = net
        self.manager = KVCacheManager(
            self.layout,
            max_model_len=self.max_model_len,
            publish=cache.publish,
            group_hit_stats=True,  # EngineStats.group_hit_tokens
            tiers=tier_specs(cache.host_memory_bytes, cache.disk_memory_bytes),
            tier_ops=True,
            tier_write_through=cache.write_through,
            protect_share=cache.protect_share,
        )
        sched = scheduler or SchedulerConfig()
        if not sched.collect_block_ids:
            sched = replace(sched, collect_block_ids=True)
        if speculative is not None:  # before the tiers open: a refusal leaves no lock held
            check_speculation(name, self.spec, sched.whole_prefill)
        self._tier_store = open_tiers(
            self.storage,
            self.manager,
            host_bytes=cache.host_memory_bytes,
            disk_dir=cache.disk_cache_dir,
            disk_bytes=cache.disk_memory_bytes,
            fingerprint=fingerprint(
                name,
                dtype,
                self.layout,
                self.manager.hasher.name,
                weights=weights_digest(net) if cache.disk_cache_dir else None,
                attention_sinks=cache.attention_sinks,
                # what a payload's bytes mean: the storage's layout kind and page order
                storage_kind=self.storage.kind.value,
                page_order=self.storage.placement.page_order.value,
            ),
        )
        try:
            self._finish_init(name, sched, speculative, keep_logits)
        except BaseException:
            if self._tier_store is not None:  # the disk directory's lock goes with it
                self._tier_store.close()
            raise

    def _finish_init(
        self,
        name: str,
        sched: SchedulerConfig,
        speculative: SpeculativeConfig | None,
        keep_logits: bool,
    ) -> None:
        """The rest of :meth:`__init__`, once the tiers are open (closed if this raises)."""
        if resumes_no_prefill(self.spec) and not sched.whole_prefill:
            # transformers' Mamba1 scan starts every pass from a zero state: no prefix hits
            logger.info("%s: whole-prompt prefill, no prefix hits (Mamba1 state)", name)
            sched = replace(sched, whole_prefill=True)
        self.speculative = speculative
        store = self._tier_store
        self.scheduler = Scheduler(
            self.manager,
            sched,
            max_model_len=self.max_model_len,
            hit_check=(
                functools.partial(store.check_hit, self.manager)
                if store is not None and store.disk is not None
                else None
            ),
        )
        self.vocab_size = config_vocab_size(self.model.config)
        self.keep_logits = keep_logits
        self.completions: dict[str, Completion] = {}
        self._live: dict[str, LiveRequest] = {}
        self._tracker = CacheTracker(self.layout)
        self._counts = dict.fromkeys(COUNTERS, 0)
        self._block_sizes = [g.block_size for g in self.layout.groups]
        self._seconds = 0.0
        self._model_seconds = 0.0
        self._next_id = 0

    # ----------------------------------------------------------------- requests

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        *,
        max_tokens: int,
        eos_token_ids: Sequence[int] = (),
        hold: bool = False,
        protect_as: str | None = None,
    ) -> None:
        """Queue a request.  Raises :class:`PromptError` for a prompt :meth:`check_prompt`
        refuses or ``max_tokens < 1``, and :class:`~hybridkv.scheduler.SchedulerError` for a
        duplicate id.  Nothing is queued when it raises.  ``hold``: keep its blocks when it
        finishes (a handover to a decode engine reads them: :mod:`hybridkv.engine.handover`).
        ``protect_as``: the client will send a request that continues this one (the next
        turn of a chat): once it finishes, its prefix is protected in the host and disk tiers
        under that session name (replacing the session's earlier prefix) until
        :meth:`unprotect` (:mod:`hybridkv.cache.tier_sessions`)."""
        prompt = self.check_prompt(request_id, prompt_token_ids)
        check_max_tokens(request_id, max_tokens)
        eos = check_eos(request_id, eos_token_ids, self.vocab_size)
        if protect_as is not None and self._tier_store is None:
            raise PromptError(
                f"request {request_id!r}: protect_as={protect_as!r} keeps a prefix in the host "
                "and disk tiers, and this engine has none (CacheConfig host_memory_bytes or "
                "disk_cache_dir)"
            )
        seq = self.scheduler.add_request(
            request_id,
            prompt,
            max_tokens=max_tokens,
            eos_token_ids=eos,
            hold=hold,
            protect_as=protect_as,
        )
        self._live[request_id] = LiveRequest(seq, prompt)
        self._counts["prompt"] += len(prompt)

    def abort_request(self, request_id: str) -> None:
        """Stop a waiting or running request between steps: its blocks are freed
        (:meth:`Scheduler.abort_request`) and its :class:`Completion` holds the tokens
        generated so far, with ``finish_reason`` :attr:`~hybridkv.scheduler.FinishReason.ABORT`.
        A finished request kept with ``hold=True`` is released (its completion stays as it
        finished).  Raises :class:`~hybridkv.scheduler.SchedulerError`, changing nothing, for
        an id that names no waiting, running or held request."""
        live = self._live.get(request_id) if isinstance(request_id, str) else None
        self.scheduler.abort_request(request_id)
        if live is None:  # a held request, released
            return
        self._complete(request_id, FinishReason.ABORT)

    def check_prompt(self, request_id: str, prompt_token_ids: Sequence[int]) -> tuple[int, ...]:
        """The prompt as a tuple, if the engine can serve it.  Raises :class:`PromptError`
        naming ``request_id`` for a prompt that is not a sequence of Python ints, an empty
        prompt, a token id outside ``[0, vocab_size)``, or ``max_model_len`` tokens or more
        (one output token must fit).  Reads only."""
        prompt = token_tuple(request_id, prompt_token_ids, "the prompt must be")
        problem = prompt_problem(
            prompt, vocab_size=self.vocab_size, max_model_len=self.max_model_len
        )
        if problem is not None:
            raise PromptError(f"request {request_id!r}: {problem}")
        return prompt

    def unprotect(self, session: str) -> bool:
        """End a session ``add_request(protect_as=)`` started (its entries are evicted
        first from then on); returns whether the session existed."""
        return self.manager.unprotect(session)

    def has_unfinished(self) -> bool:
        """True while a request is waiting or running."""
        return self.scheduler.has_unfinished()

    # ----------------------------------------------------------------- stepping

    def step(self) -> list[RequestOutput]:
        """Run one scheduler step through the model (see the module docstring) and return the
        tokens it produced, one :class:`RequestOutput` per sampling request.

        Mutates the scheduler, the manager, the cache storage and :attr:`completions`.  Raises
        :class:`EngineError` when requests remain but none can be scheduled.  If the runner
        raises, the step's allocations stay made: the engine cannot continue.
        """
        if self._closed:  # its tiers are gone: a step would run without them
            raise EngineError(
                "step: the engine is closed (close() let go of its host and disk tiers); make "
                "a new LLMEngine"
            )
        start = time.perf_counter()
        running = {s.request_id for s in self.scheduler.running}
        out = self._schedule()
        store = self._tier_store
        while (
            out.is_empty
            and not out.preempted
            and store is not None
            and (self.scheduler.num_loading)
        ):
            store.wait()  # nothing else to run: wait for a waiting request's disk reads
            out = self._schedule()
        if out.is_empty:
            if not out.preempted and self.scheduler.has_unfinished():
                raise EngineError(
                    f"step: {len(self.scheduler.waiting)} waiting requests but nothing could "
                    "be scheduled (token budget or cache too small, or blocks kept by "
                    "finished hold=True requests: release them)"
                )
            self._seconds += time.perf_counter() - start
            return []
        if self._tier_store is not None:  # evicted blocks out, hits back in, before the pass
            self._tier_store.sync(self.manager)
            sizes = self._block_sizes
            counted = self._tracker.counted  # a re-admission's loads are not counted again
            for item in out.scheduled:
                if item.allocation.loads and item.request_id not in counted:
                    by_tier = tier_hit_tokens(item.allocation.loads, sizes)
                    self._counts["host"] += by_tier["host"]
                    self._counts["disk"] += by_tier["disk"]
        admitted = [i.request_id for i in out.scheduled if i.request_id not in running]
        self._tracker.record_step(
            out,
            admitted,
            {rid: self._live[rid].seq.request.num_tokens for rid in admitted},
        )
        self._tracker.record_holdings(self.manager, [s.request_id for s in self.scheduler.running])
        batch = StepBatch(
            requests=tuple(
                step_from_tables(
                    self.layout,
                    item.block_ids,
                    request_id=item.request_id,
                    token_ids=item.token_ids + item.draft_token_ids,
                    num_computed=item.start,
                    result=item.allocation,
                    num_logits=1 + len(item.draft_token_ids),
                )
                for item in out.scheduled
            )
        )
        model_start = time.perf_counter()
        result = self.runner.execute(batch)
        sampled: dict[str, int | tuple[int, ...]] = {}
        kept: dict[str, int] = {}
        c = self._counts
        for item in out.scheduled:
            rid = item.request_id
            if not item.samples:
                continue
            if not item.draft_token_ids:
                sampled[rid] = int(result.logits[rid].argmax())
                continue
            greedy = result.position_logits[rid].argmax(dim=-1).tolist()
            tokens = accept_greedy(item.draft_token_ids, greedy)
            sampled[rid] = tokens
            kept[rid] = len(tokens)
            c["drafted"] += len(item.draft_token_ids)
            c["accepted"] += len(tokens) - 1
        if kept:
            rewinds = self.runner.rewind(kept)
            c["rewinds"] += rewinds
            c["passes"] += rewinds
        self._model_seconds += time.perf_counter() - model_start
        outputs = self.scheduler.update(out, sampled)
        if self._tier_store is not None and self.cache_config.write_through is not None:
            self._tier_store.sync(self.manager)  # what the step published
        for o in outputs:
            rows = result.position_logits.get(o.request_id)
            if rows is None:
                self._record(o, result.logits[o.request_id][None])
            else:
                self._record(o, rows[: len(o.new_token_ids)])
        c["steps"] += 1
        c["passes"] += result.num_passes
        c["batch"] = max(c["batch"], len(out.scheduled))
        c["step_tokens"] = max(c["step_tokens"], batch.num_tokens)
        c["computed"] += batch.num_tokens
        c["gen"] += sum(len(o.new_token_ids) for o in outputs)
        self._seconds += time.perf_counter() - start
        return outputs

    def _propose(self) -> dict[str, Sequence[int]] | None:
        """Draft tokens for every running request whose next step is a decode step."""
        spec = self.speculative
        if spec is None:
            return None
        drafts: dict[str, Sequence[int]] = {}
        for seq in self.scheduler.running:
            room = min(spec.num_draft_tokens, self.scheduler.draft_room(seq))
            if room > 0:
                req = seq.request
                draft = spec.proposer.propose(req.request_id, req.token_ids, room)
                if draft:
                    drafts[req.request_id] = checked_draft(draft, room, self.vocab_size)
        return drafts

    def _record(self, output: RequestOutput, logits: torch.Tensor) -> None:
        """Append ``output``'s tokens (``logits[i]``: the logits of token ``i``)."""
        live = self._live[output.request_id]
        live.tokens.extend(output.new_token_ids)
        if self.keep_logits:
            for row in logits:
                live.logits.append(row.detach().cpu().clone())  # not a view of the batch
        if not output.finished or output.finish_reason is None:
            return
        self._complete(output.request_id, output.finish_reason)

    def _complete(self, request_id: str, reason: FinishReason) -> None:
        """Record the completion of live request ``request_id`` and forget it."""
        live = self._live.pop(request_id)
        self.completions[request_id] = Completion(
            request_id=request_id,
            prompt_token_ids=live.prompt,
            token_ids=tuple(live.tokens),
            finish_reason=reason,
            num_cached_tokens=live.seq.num_cached_tokens,
            num_preemptions=live.seq.num_preemptions,
            logits=tuple(live.logits),
        )
        self._tracker.forget(request_id)

    def run(self) -> None:
        """Step until no request is waiting or running."""
        while self.scheduler.has_unfinished():
            self.step()

    def generate(
        self,
        prompts: Sequence[Sequence[int]] | Mapping[str, Sequence[int]],
        max_tokens: int,
        eos_token_ids: Sequence[int] = (),
    ) -> list[Completion]:
        """Add ``prompts`` (a list gets ids ``req-0``, ``req-1``, ...; a mapping names them),
        run every queued request to completion, and return these prompts' completions in
        order.  Raises like :meth:`add_request` (requests added before the failing one stay
        queued) and :meth:`step`."""
        if isinstance(prompts, Mapping):
            named = dict(prompts)
        else:
            named = {}
            for p in prompts:
                named[f"req-{self._next_id}"] = p
                self._next_id += 1
        for rid, p in named.items():
            self.add_request(rid, p, max_tokens=max_tokens, eos_token_ids=eos_token_ids)
        self.run()
        return [self.completions[rid] for rid in named]

    # ----------------------------------------------------------------- reporting

    def close(self) -> None:
        """Write everything cached (device blocks, host entries) to the disk tier, so the
        next engine on its directory finds it, and let go of the directory (its lock, its
        files); with requests unfinished only what is already on disk stays.  A step
        afterwards raises :class:`EngineError`.  Idempotent; a no-op without tiers."""
        store, self._tier_store = self._tier_store, None
        if store is None:
            return
        self._closed = True
        try:
            if store.disk is not None and not self.scheduler.has_unfinished():
                self.manager.persist_to_tier("disk")
                store.sync(self.manager)
        finally:  # the directory's lock and the threads go back even when persisting raised
            store.close()

    def check_invariants(self) -> None:
        """The manager's bookkeeping (its tiers included), the storage's placement and the
        tier store's host slots, which must hold bytes for exactly the host entries the
        manager counts (raises :class:`~hybridkv.errors.InvariantError`)."""
        self.manager.check_invariants()
        self.storage.check_invariants()
        store = self._tier_store
        if store is None:
            return
        store.check_invariants()
        host = self.manager.tier_stats().get("host")
        held = len(store.host_keys())
        if host is not None and host["blocks"] != held:
            raise InvariantError(
                f"engine: the manager counts {host['blocks']} host blocks, the tier store "
                f"holds {held}"
            )

    def _schedule(self) -> SchedulerOutput:
        """The scheduler's next step, with compaction's block moves copied at once: before
        anything reads or writes those blocks, even when the step then runs nothing.  With
        lower tiers the moves are ``relocate`` operations of the tier stream, run in order
        with the stores and loads recorded around them."""
        out = self.scheduler.schedule(self._propose())
        if out.moves:
            if self._tier_store is not None:
                self._tier_store.sync(self.manager)
            else:
                self.storage.move_blocks(out.moves)
            self._counts["moved"] += len(out.moves)
        return out

    def stats(self) -> EngineStats:
        """Counters since the engine was built (see :class:`EngineStats`)."""
        return engine_stats(
            self.layout,
            self._counts,
            self._tracker,
            self.manager,
            preemptions=self.scheduler.num_preemptions,
            seconds=self._seconds,
            model_seconds=self._model_seconds,
        )
