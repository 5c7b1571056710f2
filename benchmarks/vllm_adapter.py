"""Run workloads on a manager :func:`vllm_setup.build_vllm_manager` built.

:class:`VllmManagerAdapter` is the :class:`vllm_sched.ManagerAdapter` over vLLM's
``KVCacheManager`` that :func:`vllm_sched.run_minimal_scheduler` drives, timing every call;
:func:`run_real_scheduler` is the cross-check, the same workload through vLLM's own
``Scheduler``.  Importing this module never imports vLLM: :func:`run_real_scheduler` does,
and the adapter uses the modules its :class:`vllm_setup.VllmSetup` carries.
:mod:`vllm_driver` re-exports these names.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, os.environ.get("HYBRIDKV_SRC", str(Path(__file__).resolve().parents[1] / "src")))

from hybridkv.workloads import StepRequest

from vllm_sched import OPS, SimRequest, _Arrivals
from vllm_setup import VllmSetup

__all__ = ["VllmManagerAdapter", "run_real_scheduler"]


class VllmManagerAdapter:
    """:class:`ManagerAdapter` over vLLM's ``KVCacheManager``.  Each manager call, and the
    request block hasher (as "hash"), is timed with ``perf_counter_ns`` into ``timings``."""

    def __init__(self, setup: VllmSetup, *, junction_split: bool = True) -> None:
        self.setup, self.manager = setup, setup.manager
        self.junction_split = junction_split  # False: hide the junction (ablation only)
        self.scheduler_block_size = setup.scheduler_block_size
        self.hash_block_size = setup.hash_block_size
        self.mamba_align = setup.mamba_align
        self.partial_hash_hits = setup.partial_hash_hits
        self.bytes_per_block = setup.bytes_per_block
        self.timings: dict[str, list[int]] = {op: [] for op in OPS}  # wall ns per call
        self.cpu_ns: dict[str, int] = dict.fromkeys(OPS, 0)  # thread CPU ns, all calls
        self._reqs: dict[str, Any] = {}
        self._pending: dict[str, tuple[Any, int]] = {}
        st = setup.vllm.RequestStatus
        self._status = {"waiting": st.WAITING, "running": st.RUNNING, "preempted": st.PREEMPTED}

    def _sync(self, req: SimRequest) -> Any:
        vreq = self._reqs[req.request_id]
        vreq.num_computed_tokens = req.num_computed_tokens
        vreq.status = self._status.get(req.status, vreq.status)
        vreq.num_preemptions = req.num_preemptions
        return vreq

    def _timed(self, op: str, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        c0 = time.thread_time_ns()
        t0 = time.perf_counter_ns()
        result = fn(*args, **kw)
        t1 = time.perf_counter_ns()
        self.cpu_ns[op] += time.thread_time_ns() - c0
        self.timings[op].append(t1 - t0)
        return result

    def add_request(self, req: SimRequest) -> None:
        v = self.setup.vllm
        self._reqs[req.request_id] = self._timed(
            "hash",
            v.Request,
            request_id=req.request_id,
            prompt_token_ids=list(req.prompt_token_ids),
            sampling_params=v.SamplingParams(max_tokens=req.max_tokens),
            pooling_params=None,
            block_hasher=self.setup.block_hasher,
        )

    def new_step(self) -> None:
        self.manager.new_step_starts()  # forgets the Mamba states cached in the last step

    def end_step(self) -> None:
        def drain() -> None:  # what Scheduler.schedule() does after allocating, sync mode
            self.manager.take_boundary_state_offloads()
            self.manager.take_new_block_ids()
            copies, retained = self.manager.take_kv_cache_block_copies()
            if copies:
                self.manager.block_pool.free_blocks(retained)

        self._timed("end_step", drain)

    def lookup(self, req: SimRequest) -> int:
        vreq = self._sync(req)
        blocks, hit, junction = self._timed(
            "get_computed_blocks", self.manager.get_computed_blocks, vreq
        )
        self._pending[req.request_id] = (blocks, hit)
        junction = junction if self.junction_split else 0
        req.shared_prefix_boundary = vreq.shared_prefix_boundary = junction
        return int(hit)

    def allocate(
        self, req: SimRequest, num_new_tokens: int, num_lookahead_tokens: int = 0, **kw: Any
    ) -> bool:
        """``kw``: ``full_sequence_must_fit`` and ``has_scheduled_reqs`` of allocate_slots."""
        vreq = self._sync(req)
        blocks, hit = self._pending.get(req.request_id, (None, 0))
        new = self._timed(
            "allocate_slots",
            self.manager.allocate_slots,
            vreq,
            num_new_tokens,
            num_new_computed_tokens=hit,
            new_computed_blocks=blocks,
            num_lookahead_tokens=num_lookahead_tokens,
            **kw,
        )
        if new is not None:
            self._pending.pop(req.request_id, None)
        return new is not None

    def append_token(self, req: SimRequest, token_id: int) -> None:
        self._timed("hash", self._reqs[req.request_id].append_output_token_ids, token_id)

    def free(self, req: SimRequest) -> None:
        self._timed("free", self.manager.free, self._sync(req))
        self._pending.pop(req.request_id, None)
        if req.status in ("finished", "rejected"):
            del self._reqs[req.request_id]

    def usage(self) -> float:
        return float(self.manager.usage)

    def num_used_blocks(self) -> int:
        pool = self.manager.block_pool
        return int(pool.num_gpu_blocks - 1 - pool.get_num_free_blocks())


def run_real_scheduler(
    setup: VllmSetup, requests: Sequence[StepRequest], *, max_model_len: int = 16_384
) -> dict[str, Any]:
    """Cross-check: the same workload through vLLM's own ``Scheduler`` (fed the workload's
    output tokens by a fake model runner) over a fresh manager with ``setup``'s KV cache
    config.  Needs ``einops`` (ModelConfig inspects a tiny local Llama config.json; nothing is
    downloaded)."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.structured_output import StructuredOutputManager

    v, cfg = setup.vllm, setup.vllm_config
    llama = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 1024,
        "intermediate_size": 2048,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "num_hidden_layers": 2,
        "vocab_size": 200_000,
        "max_position_embeddings": max_model_len,
    }
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(llama))
        cfg.model_config = v.config.ModelConfig(
            model=tmp, skip_tokenizer_init=True, max_model_len=max_model_len
        )
    sched = Scheduler(
        cfg,
        setup.kv_cache_config,
        StructuredOutputManager(cfg),
        block_size=setup.scheduler_block_size,
        hash_block_size=setup.hash_block_size,
    )
    arrivals, reqs, first_hit = _Arrivals(requests), {}, {}
    by_id = {w.request_id: w for w in requests}
    step = preemptions = 0
    while arrivals.pending() or sched.has_unfinished_requests():
        for w in arrivals.ready(step):
            reqs[w.request_id] = v.Request(
                request_id=w.request_id,
                prompt_token_ids=list(w.prompt_token_ids),
                sampling_params=v.SamplingParams(max_tokens=w.output_len),
                pooling_params=None,
                block_hasher=setup.block_hasher,
            )
            sched.add_request(reqs[w.request_id])
        if not sched.has_unfinished_requests():
            step = arrivals.skip_idle(step)
            continue
        out = sched.schedule()
        first_hit.update(
            {
                n.req_id: n.num_computed_tokens
                for n in out.scheduled_new_reqs
                if n.req_id not in first_hit
            }
        )
        preemptions += len(out.preempted_req_ids or ())
        ids = list(out.num_scheduled_tokens)
        sampled = [
            [by_id[r].output_token_ids[reqs[r].num_output_tokens]]
            if reqs[r].num_computed_tokens >= reqs[r].num_tokens
            else []
            for r in ids
        ]
        sched.update_from_output(
            out,
            ModelRunnerOutput(
                req_ids=ids,
                req_id_to_index={r: k for k, r in enumerate(ids)},
                sampled_token_ids=sampled,
            ),
        )
        for r in ids:
            if reqs[r].is_finished() and r not in arrivals.ended_at:
                arrivals.ended_at[r] = step
        step += 1
    prompt_tokens = sum(len(w.prompt_token_ids) for w in requests)
    hit = sum(first_hit.values())
    return {
        "hit_tokens": hit,
        "token_hit_rate": hit / prompt_tokens,
        "steps": step,
        "preemptions": preemptions,
        "finished": len(arrivals.ended_at),
    }
