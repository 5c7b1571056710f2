"""Drive vLLM 0.33's own ``KVCacheManager`` on CPU: the reference hybridkv is compared against.

Run it with the separate vLLM virtualenv described in ``docs/vllm.md`` (never hybridkv's venv)::

    /tmp/vllmenv/bin/python benchmarks/vllm_driver.py --out results/vllm_driver.json
    /tmp/vllmenv/bin/python benchmarks/vllm_driver.py --workload branching --cross-check
    /tmp/vllmenv/bin/python benchmarks/vllm_driver.py --trace PATH --requests 300

Per configuration (full+swa, full+mamba, full+swa+mamba at equal memory) it prints the token
hit rate, preemptions, peak blocks/bytes and per-call manager times, and writes everything to
JSON.  ``--cross-check`` replays the same workload through vLLM's real ``Scheduler`` and
reports whether hits, steps and preemptions are identical to :func:`run_minimal_scheduler`.

Importing this module never imports vLLM; :func:`build_vllm_manager` does and raises
:class:`VllmUnavailable` when it cannot, so other benchmark scripts can skip cleanly.  The
workloads come from :mod:`hybridkv.workloads` (standard library only, imported from this
checkout's ``src/``: vLLM's interpreter needs no hybridkv install), and
:func:`run_minimal_scheduler` is plain Python: a hybridkv adapter with the
:class:`ManagerAdapter` methods is driven by the very same loop.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, os.environ.get("HYBRIDKV_SRC", str(Path(__file__).resolve().parents[1] / "src")))

from hybridkv.workloads import (
    BranchingConfig,
    ConversationConfig,
    StepRequest,
    WorkloadError,
    arrival_order,
    branching_workload,
    conversation_workload,
    ideal_hit_tokens,
    load_mooncake_trace,
    step_requests,
)

# Re-exported: other benchmark scripts use these as ``vllm_driver.X``.
from vllm_sched import (
    OPS,
    ManagerAdapter,
    SimRequest,
    _Arrivals,
    op_stats,
    run_minimal_scheduler,
)

__all__ = [
    "OPS",
    "GroupDesc",
    "ManagerAdapter",
    "SimRequest",
    "VllmManagerAdapter",
    "VllmSetup",
    "VllmUnavailable",
    "build_vllm_manager",
    "op_stats",
    "run_minimal_scheduler",
    "run_real_scheduler",
    "vllm_available",
]


class VllmUnavailable(RuntimeError):
    """vLLM (or a package its import chain needs) cannot be imported in this interpreter."""


# ------------------------------------------------------------------------------- vLLM set-up
@dataclass(frozen=True, kw_only=True)
class GroupDesc:
    """Layers of one kind, described with plain data (sizes in tokens and bytes).

    ``kind`` is "full", "sliding" (needs ``window``), "mla" (one latent of ``head_dim`` per
    token, ``num_kv_heads`` 1) or "mamba" (needs ``mamba_shapes`` and one
    ``mamba_dtype_bytes`` entry per shape).  Attention page = 2*block*heads*head_dim*bytes
    (MLA: block*head_dim*bytes)."""

    kind: str
    num_layers: int
    num_kv_heads: int = 8
    head_dim: int = 128
    dtype_bytes: int = 2
    window: int = 0
    mamba_shapes: tuple[tuple[int, ...], ...] = ()
    mamba_dtype_bytes: tuple[int, ...] = ()
    block_size: int = 16

    @classmethod
    def from_any(cls, value: GroupDesc | Mapping[str, Any]) -> GroupDesc:
        d = value if isinstance(value, GroupDesc) else cls(**dict(value))
        if d.kind not in ("full", "sliding", "mla", "mamba"):
            raise ValueError(f"kind={d.kind!r}: must be 'full', 'sliding', 'mla' or 'mamba'")
        if d.kind == "sliding" and d.window <= 0:
            raise ValueError(f"window={d.window}: a sliding group needs a window > 0")
        if d.kind == "mamba" and (
            not d.mamba_shapes or len(d.mamba_shapes) != len(d.mamba_dtype_bytes)
        ):
            raise ValueError(f"mamba_dtype_bytes={d.mamba_dtype_bytes}: need one per shape")
        return d

    @property
    def attn_bytes_per_token(self) -> int:
        kv = 1 if self.kind == "mla" else 2
        return kv * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def state_bytes(self) -> int:
        pairs = zip(self.mamba_shapes, self.mamba_dtype_bytes, strict=True)
        return sum(math.prod(shape) * nbytes for shape, nbytes in pairs)


@dataclass(frozen=True, kw_only=True)
class VllmSetup:
    """What :func:`build_vllm_manager` made: the manager plus the sizes vLLM resolved."""

    manager: Any
    kv_cache_config: Any
    vllm_config: Any
    block_hasher: Callable[[Any], list[Any]]
    vllm: SimpleNamespace
    scheduler_block_size: int
    hash_block_size: int
    bytes_per_block: int
    num_blocks: int
    mamba_align: bool
    partial_hash_hits: bool
    groups: list[dict[str, Any]]


def vllm_available() -> bool:
    """True when vLLM's KV cache manager can be imported in this interpreter."""
    try:
        _import_vllm()
    except VllmUnavailable:
        return False
    return True


def _import_vllm() -> SimpleNamespace:
    if importlib.util.find_spec("vllm") is None:  # fast path: skip importing torch
        raise VllmUnavailable("vllm is not installed in this interpreter (see docs/vllm.md)")
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # VllmConfig cannot infer a device else
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    try:
        import torch
        import vllm.config as config
        import vllm.v1.core.kv_cache_planning as planning
        import vllm.v1.core.kv_cache_utils as utils
        import vllm.v1.kv_cache_interface as iface
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_config_builder import get_kv_cache_config_builder
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.request import Request, RequestStatus
        from vllm.version import __version__
    except Exception as exc:  # ImportError, or a dependency failing at import time
        raise VllmUnavailable(f"cannot import vLLM's KV cache manager: {exc!r}") from exc
    return SimpleNamespace(
        torch=torch,
        config=config,
        planning=planning,
        utils=utils,
        iface=iface,
        SamplingParams=SamplingParams,
        get_hash_fn_by_name=get_hash_fn_by_name,
        get_kv_cache_config_builder=get_kv_cache_config_builder,
        KVCacheManager=KVCacheManager,
        Request=Request,
        RequestStatus=RequestStatus,
        version=__version__,
    )


def _layer_specs(v: SimpleNamespace, descs: list[GroupDesc], align: int) -> tuple[dict, int]:
    """Per-layer vLLM specs.  With attention and Mamba layers, the block grows and the Mamba
    page is padded as ``Platform._align_hybrid_block_size`` does (replicated: it needs a real
    model and GPU attention backends): smallest multiple of max(align, block) whose attention
    page covers the largest state, then the state padded to exactly that page."""
    block = descs[0].block_size
    mambas = [d for d in descs if d.kind == "mamba"]
    attns = [d for d in descs if d.kind != "mamba"]
    padded = None
    if mambas and attns:
        per_tok = max(d.attn_bytes_per_token for d in attns)
        state = max(d.state_bytes for d in mambas)
        step = max(align, block)
        block = max(block, step * -(-state // (step * per_tok)))
        padded = block * per_tok if block * per_tok != state else None
    dtypes = {1: v.torch.uint8, 2: v.torch.bfloat16, 4: v.torch.float32}
    specs: dict[str, Any] = {}
    for d in descs:
        for _ in range(d.num_layers):
            name = f"model.layers.{len(specs)}.{d.kind}"
            if d.kind == "mamba":
                specs[name] = v.iface.MambaSpec(
                    shapes=d.mamba_shapes,
                    dtypes=tuple(dtypes[b] for b in d.mamba_dtype_bytes),
                    block_size=block,
                    page_size_padded=padded,
                    mamba_cache_mode="align",
                )
                continue
            kw = {"block_size": block, "num_kv_heads": d.num_kv_heads, "head_size": d.head_dim}
            if d.kind == "full":
                specs[name] = v.iface.FullAttentionSpec(dtype=dtypes[d.dtype_bytes], **kw)
            elif d.kind == "mla":
                specs[name] = v.iface.MLAAttentionSpec(dtype=dtypes[d.dtype_bytes], **kw)
            else:
                specs[name] = v.iface.SlidingWindowSpec(
                    dtype=dtypes[d.dtype_bytes], sliding_window=d.window, **kw
                )
    return specs, block


def build_vllm_manager(
    groups: Sequence[GroupDesc | Mapping[str, Any]],
    *,
    memory_bytes: int | None = None,
    num_blocks: int | None = None,
    max_model_len: int = 16_384,
    token_budget: int = 8_192,
    max_num_seqs: int = 256,
    hash_algo: str = "sha256",
    prefix_match_unit: int | None = None,
    kernel_block_alignment: int = 16,
) -> VllmSetup:
    """A vLLM ``KVCacheManager`` with prefix caching, built as vLLM's engine core builds it.

    Exactly one of ``memory_bytes`` or ``num_blocks`` (``num_gpu_blocks_override``, null block
    included) sizes the pool.  Grouping, page unification, padding layers, bytes per block,
    num_blocks and the scheduler / hash block sizes come from vLLM's own functions; see
    :func:`_layer_specs` for the one rule replicated.  Raises VllmUnavailable, or ValueError
    naming a bad argument."""
    v = _import_vllm()
    descs = [GroupDesc.from_any(g) for g in groups]
    if (memory_bytes is None) == (num_blocks is None):
        raise ValueError(f"{memory_bytes=}, {num_blocks=}: give exactly one of them")
    if not descs or len({d.block_size for d in descs}) != 1:
        raise ValueError(f"block_size={[d.block_size for d in descs]}: need one shared size")
    specs, block = _layer_specs(v, descs, kernel_block_alignment)
    has_mamba = any(d.kind == "mamba" for d in descs)
    cfg = v.config.VllmConfig(
        cache_config=v.config.CacheConfig(
            block_size=block,
            enable_prefix_caching=True,
            prefix_caching_hash_algo=hash_algo,
            mamba_cache_mode="align" if has_mamba else "none",
            mamba_block_size=block if has_mamba else None,
            prefix_match_unit=prefix_match_unit,
        ),
        scheduler_config=v.config.SchedulerConfig(
            max_num_batched_tokens=token_budget,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            is_encoder_decoder=False,
        ),
    )
    cfg.cache_config.kv_cache_layout = "NHD"  # what GPU attention backends resolve to
    builder = v.get_kv_cache_config_builder(cfg)
    kv_groups = v.planning.get_kv_cache_groups(cfg, specs)
    per_block = v.planning._pool_bytes_per_block_from_builder(builder, cfg, kv_groups)
    n_blocks = num_blocks if num_blocks is not None else int(memory_bytes or 0) // per_block
    kv_cfg = builder.get_kv_cache_config_from_groups(cfg, kv_groups, n_blocks)
    sched_bs, hash_bs = v.utils.resolve_kv_cache_block_sizes(kv_cfg, cfg)
    kv_cfg.hash_block_size = hash_bs
    cfg.cache_config.num_gpu_blocks = kv_cfg.num_blocks
    hash_fn = v.get_hash_fn_by_name(hash_algo)
    v.utils.init_none_hash(hash_fn)
    manager = v.KVCacheManager(
        kv_cfg,
        max_model_len=max_model_len,
        scheduler_block_size=sched_bs,
        hash_block_size=hash_bs,
        max_in_flight_tokens=cfg.max_in_flight_tokens,
        enable_caching=True,
    )
    summary = [
        {
            "spec": type(g.kv_cache_spec).__name__,
            "layers": len(g.layer_names),
            "block_size": g.kv_cache_spec.block_size,
            "page_bytes_per_layer": g.kv_cache_spec.page_size_bytes,
        }
        for g in kv_cfg.kv_cache_groups
    ]
    return VllmSetup(
        manager=manager,
        kv_cache_config=kv_cfg,
        vllm_config=cfg,
        block_hasher=v.utils.get_request_block_hasher(hash_bs, hash_fn),
        vllm=v,
        scheduler_block_size=sched_bs,
        hash_block_size=hash_bs,
        bytes_per_block=per_block,
        num_blocks=kv_cfg.num_blocks,
        mamba_align=has_mamba,
        partial_hash_hits=manager.coordinator.enable_partial_hash_hits,
        groups=summary,
    )


# ------------------------------------------------------------------------------ the adapter
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


# ------------------------------------------------------------------------------------ main
ATTN = {"num_kv_heads": 8, "head_dim": 128, "dtype_bytes": 2}  # 4 KiB per token per layer
MAMBA_STATES = {  # per layer: (state shapes, dtype bytes)
    "small": (((3, 1024), (8, 64, 16)), (2, 4)),  # 38,912 B: fits a 16-token attention page
    "realistic": (((3, 10240), (128, 64, 128)), (2, 4)),  # Mamba2 of a ~8B hybrid: 4.26 MB
}


def config_groups(name: str, block_size: int, mamba_state: str, layers: int = 4) -> list[GroupDesc]:
    """The benchmark model of one configuration ("full+swa", ...): ``layers`` layers per kind,
    so vLLM makes exactly one KV cache group per kind."""
    shapes, nbytes = MAMBA_STATES[mamba_state]
    common = {"num_layers": layers, "block_size": block_size}
    kinds = {
        "full": GroupDesc(kind="full", **common, **ATTN),
        "swa": GroupDesc(kind="sliding", window=128, **common, **ATTN),
        "mamba": GroupDesc(kind="mamba", mamba_shapes=shapes, mamba_dtype_bytes=nbytes, **common),
    }
    return [kinds[k] for k in name.split("+")]


def _run_config(name: str, args: argparse.Namespace, workload: list[StepRequest]) -> dict:
    """Run one configuration ``args.repeats`` times on fresh managers: metrics of the first
    run, timings as the median over runs of each statistic plus the best (lowest) mean, since
    the machine is shared and other processes inflate single runs."""
    runs, stats = [], []
    for rep in range(args.repeats):
        setup = build_vllm_manager(
            config_groups(name, args.block_size, args.mamba_state),
            memory_bytes=args.memory_bytes,
            num_blocks=None if args.memory_bytes else args.num_blocks,
            max_model_len=args.max_model_len,
            token_budget=args.token_budget,
            max_num_seqs=args.max_num_seqs,
            hash_algo=args.hash_algo,
            prefix_match_unit=args.prefix_match_unit,
        )
        adapter = VllmManagerAdapter(setup, junction_split=not args.no_junction_split)
        tag = f"[{name} #{rep}]"
        gc.collect()
        if not args.keep_gc:  # as benchmarks/bench_manager.py: no collector pauses in timings
            gc.disable()
        try:
            runs.append(
                run_minimal_scheduler(
                    adapter,
                    workload,
                    args.token_budget,
                    max_num_seqs=args.max_num_seqs,
                    max_model_len=args.max_model_len,
                    progress=lambda p, tag=tag: print(" ", tag, p, file=sys.stderr, flush=True),
                    progress_every=args.progress_every,
                )
            )
        finally:
            gc.enable()
        stats.append(op_stats(adapter.timings, adapter.cpu_ns))
    m = runs[0]
    grain = setup.hash_block_size if setup.partial_hash_hits else setup.scheduler_block_size
    if any((r["hit_tokens"], r["steps"]) != (m["hit_tokens"], m["steps"]) for r in runs):
        raise RuntimeError(f"{name}: repeated runs disagree, the driver is not deterministic")
    m["ops"] = {
        op: {k: statistics.median(s[op][k] for s in stats) for k in stats[0][op]}
        | {"best_mean_us": min(s[op]["mean_us"] for s in stats)}
        for op in OPS
    }
    m["wall_s"] = statistics.median(r["wall_s"] for r in runs)
    m.update(
        groups=setup.groups,
        scheduler_block_size=setup.scheduler_block_size,
        hash_block_size=setup.hash_block_size,
        bytes_per_block=setup.bytes_per_block,
        num_blocks=setup.num_blocks,
        partial_hash_hits=setup.partial_hash_hits,
        ideal_hit_rate=ideal_hit_tokens(arrival_order(workload), grain)
        / max(1, sum(len(r.prompt_token_ids) for r in workload)),
    )
    if args.cross_check:
        real = run_real_scheduler(setup, workload, max_model_len=args.max_model_len)
        keys = ("hit_tokens", "steps", "preemptions")
        m["real_scheduler"] = real | {"match": all(real[k] == m[k] for k in keys)}
    return m


def _summary_line(name: str, m: Mapping[str, Any]) -> str:
    op = m["ops"]
    us = {
        k: "{mean_us:.1f} (best {best_mean_us:.1f}, cpu {cpu_mean_us:.1f})".format(**op[k])
        for k in OPS
    }
    real = m.get("real_scheduler")
    return (
        f"{name:15s} hit {m['token_hit_rate']:6.1%} (ideal {m['ideal_hit_rate']:5.1%}) "
        f"preempt {m['preemptions']:3d} steps {m['steps']:5d} peak {m['peak_used_blocks']:5d} "
        f"blk {m['peak_used_bytes'] / 2**30:5.2f} GiB | block {m['scheduler_block_size']}/"
        f"{m['hash_block_size']} | us/call: allocate_slots {us['allocate_slots']} "
        f"p99 {op['allocate_slots']['p99_us']:.1f}, get_computed_blocks "
        f"{us['get_computed_blocks']}, free {us['free']} | wall {m['wall_s']:.1f} s"
        + (
            f" | real Scheduler: hit {real['token_hit_rate']:.1%} match={real['match']}"
            if real
            else ""
        )
    )


def _make_workload(args: argparse.Namespace) -> tuple[list[StepRequest], dict[str, Any]]:
    """The requests ``args`` ask for, from :mod:`hybridkv.workloads`: the Mooncake trace
    (``--trace``: prompts up to ``max_model_len - 1`` tokens, ``--requests`` of them) or a
    synthetic multi-turn mix (``--workload``)."""
    if args.trace is not None:
        trace = load_mooncake_trace(
            args.trace, limit=args.requests, max_prompt_tokens=args.max_model_len - 1
        )
        desc = {"trace": str(args.trace), "ms_per_step": args.ms_per_step, "skipped": trace.skipped}
        return step_requests(trace, ms_per_step=args.ms_per_step), desc
    if args.workload == "conversations":
        conv = ConversationConfig(
            num_requests=args.requests,
            seed=args.seed,
            followup_prob=args.followup_prob,
            arrival_gap_steps=4.0 if args.arrival_gap is None else args.arrival_gap,
        )
        return conversation_workload(conv), {"conversations": asdict(conv)}
    branch = BranchingConfig(
        num_requests=args.requests,
        seed=args.seed,
        followup_prob=args.followup_prob,
        arrival_gap_steps=1.0 if args.arrival_gap is None else args.arrival_gap,
    )
    return branching_workload(branch), {"branching": asdict(branch)}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    arg = ap.add_argument
    arg("--out", type=Path, default=Path("results/vllm_driver.json"))
    arg("--configs", default="full+swa,full+mamba,full+swa+mamba")
    arg("--seed", type=int, default=0)
    arg("--requests", type=int, default=200)
    arg("--num-blocks", type=int, default=6000, help="pool size, null block included")
    arg("--memory-bytes", type=int, default=None, help="size the pool in bytes instead")
    arg("--block-size", type=int, default=16)
    arg("--token-budget", type=int, default=8192)
    arg("--max-num-seqs", type=int, default=256)
    arg("--max-model-len", type=int, default=16_384)
    arg("--hash-algo", default="sha256", choices=["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"])
    arg("--mamba-state", default="small", choices=sorted(MAMBA_STATES))
    arg("--prefix-match-unit", type=int, default=None, help="vLLM's finer hash block (tokens)")
    arg(
        "--workload",
        default="conversations",
        choices=["conversations", "branching"],
        help="synthetic mix from hybridkv.workloads.multiturn (conversations: as bench_manager)",
    )
    arg(
        "--arrival-gap",
        type=float,
        default=None,
        help="synthetic: mean steps between arrivals (default 4 conversations, 1 branching)",
    )
    arg("--followup-prob", type=float, default=0.3, help="synthetic: share of multi-turn re-sends")
    arg("--trace", type=Path, default=None, help="Mooncake trace instead of the synthetic load")
    arg("--ms-per-step", type=float, default=50.0, help="trace: timestamp ms per step")
    arg("--repeats", type=int, default=3, help="timing runs per configuration")
    arg("--no-junction-split", action="store_true", help="ablation: no Mamba junction splits")
    arg("--keep-gc", action="store_true", help="leave Python's cyclic GC on while timing")
    arg("--cross-check", action="store_true", help="also run vLLM's real Scheduler")
    arg("--progress-every", type=int, default=0, help="print progress every N steps")
    args = ap.parse_args(argv)
    if not vllm_available():
        print("vLLM is not importable in this interpreter; see docs/vllm.md", file=sys.stderr)
        return 2
    try:
        workload, wl = _make_workload(args)
    except WorkloadError as exc:
        print(f"vllm_driver: {exc}", file=sys.stderr)
        return 2
    wl.update(
        requests=len(workload),
        prompt_tokens=sum(len(r.prompt_token_ids) for r in workload),
        followups=sum(r.parent_id is not None for r in workload),
    )
    print(
        f"workload: {wl['requests']} requests, {wl['prompt_tokens']} prompt tokens, "
        f"{wl['followups']} follow-ups; {args.hash_algo}, {args.repeats} repeats",
        flush=True,
    )
    results = {}
    for name in args.configs.split(","):
        m = results[name] = _run_config(name, args, workload)
        print(_summary_line(name, m), flush=True)
    doc = {
        "vllm_version": _import_vllm().version,
        "args": {k: str(a) for k, a in vars(args).items()},
        "workload": wl,
        "loadavg": os.getloadavg(),
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
