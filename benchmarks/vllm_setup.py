"""Build vLLM 0.33's own ``KVCacheManager`` on CPU, as vLLM's engine core builds it.

:func:`build_vllm_manager` takes the model as plain data (:class:`GroupDesc` per layer kind)
and returns a :class:`VllmSetup`: the manager plus the sizes vLLM resolved.  Importing this
module never imports vLLM (standard library only); :func:`build_vllm_manager` does and raises
:class:`VllmUnavailable` when it cannot, and :func:`vllm_available` says whether it can.
:mod:`vllm_driver` re-exports these names.
"""

from __future__ import annotations

import importlib.util
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

__all__ = [
    "DEFAULT_RETENTION",
    "GroupDesc",
    "VllmSetup",
    "VllmUnavailable",
    "build_vllm_manager",
    "check_retention_interval",
    "retention_interval_error",
    "vllm_available",
]


class VllmUnavailable(RuntimeError):
    """vLLM (or a package its import chain needs) cannot be imported in this interpreter."""


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


#: ``retention_interval`` of :func:`build_vllm_manager` that leaves vLLM's own default
#: (``CacheConfig.prefix_cache_retention_interval`` = 0 in vLLM 0.33: sliding-window blocks and
#: Mamba states are kept only at the prompt's end and shared-prefix junctions).
DEFAULT_RETENTION = "default"


def retention_interval_error(
    retention_interval: int | None, scheduler_block_size: int, kinds: Sequence[str]
) -> str | None:
    """Why vLLM 0.33 refuses ``prefix_cache_retention_interval`` (None: it accepts it), by
    the rule of ``kv_cache_coordinator._validate_prefix_cache_retention_interval``: None
    (dense) always passes; an int must be >= 0 and a multiple of the scheduler block size,
    and a positive one needs a sliding-window or Mamba group (``kinds``: GroupDesc kinds)."""
    if retention_interval is None:
        return None
    if not any(k in ("sliding", "mamba") for k in kinds):
        if retention_interval == 0:
            return None
        return (
            f"prefix_cache_retention_interval={retention_interval}: this model has no "
            "sliding-window or Mamba group, so vLLM refuses any interval but 0 or None"
        )
    if retention_interval < 0 or retention_interval % scheduler_block_size:
        return (
            f"prefix_cache_retention_interval={retention_interval}: vLLM needs a "
            f"non-negative multiple of its scheduler block size ({scheduler_block_size})"
        )
    return None


def _resolve(
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
    retention_interval: int | str | None = DEFAULT_RETENTION,
) -> SimpleNamespace:
    """The vLLM config and KV cache config :func:`build_vllm_manager` builds its manager from
    (no manager yet, so no block pool: cheap), with the retention interval checked."""
    v = _import_vllm()
    descs = [GroupDesc.from_any(g) for g in groups]
    if (memory_bytes is None) == (num_blocks is None):
        raise ValueError(f"{memory_bytes=}, {num_blocks=}: give exactly one of them")
    if not descs or len({d.block_size for d in descs}) != 1:
        raise ValueError(f"block_size={[d.block_size for d in descs]}: need one shared size")
    if retention_interval != DEFAULT_RETENTION and not (
        retention_interval is None
        or (isinstance(retention_interval, int) and not isinstance(retention_interval, bool))
    ):
        raise ValueError(
            f"retention_interval={retention_interval!r}: must be {DEFAULT_RETENTION!r}, "
            "None or an int"
        )
    specs, block = _layer_specs(v, descs, kernel_block_alignment)
    has_mamba = any(d.kind == "mamba" for d in descs)
    retention = (
        {}
        if retention_interval == DEFAULT_RETENTION
        else {"prefix_cache_retention_interval": retention_interval}
    )
    cfg = v.config.VllmConfig(
        cache_config=v.config.CacheConfig(
            block_size=block,
            enable_prefix_caching=True,
            prefix_caching_hash_algo=hash_algo,
            mamba_cache_mode="align" if has_mamba else "none",
            mamba_block_size=block if has_mamba else None,
            prefix_match_unit=prefix_match_unit,
            **retention,
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
    # vLLM checks it in the manager's constructor; checked here first, with the same rule,
    # so that a bad value is one clear line before any manager (or run) exists
    error = retention_interval_error(
        cfg.cache_config.prefix_cache_retention_interval, sched_bs, [d.kind for d in descs]
    )
    if error is not None:
        raise ValueError(error)
    return SimpleNamespace(
        v=v,
        cfg=cfg,
        kv_cfg=kv_cfg,
        sched_bs=sched_bs,
        hash_bs=hash_bs,
        per_block=per_block,
        has_mamba=has_mamba,
        hash_algo=hash_algo,
        max_model_len=max_model_len,
    )


def check_retention_interval(
    groups: Sequence[GroupDesc | Mapping[str, Any]],
    retention_interval: int | str | None,
    **sizing: Any,
) -> int:
    """Raise ValueError (one line) when vLLM would refuse ``retention_interval`` for this
    model; else return its scheduler block size.  ``sizing``: :func:`_resolve`'s keywords
    (memory_bytes, max_model_len, ...).  Builds no manager."""
    return int(_resolve(groups, retention_interval=retention_interval, **sizing).sched_bs)


def build_vllm_manager(
    groups: Sequence[GroupDesc | Mapping[str, Any]], **options: Any
) -> VllmSetup:
    """A vLLM ``KVCacheManager`` with prefix caching, built as vLLM's engine core builds it.

    ``options``: :func:`_resolve`'s keywords.  Exactly one of ``memory_bytes`` or
    ``num_blocks`` (``num_gpu_blocks_override``, null block included) sizes the pool.
    Grouping, page unification, padding layers, bytes per block, num_blocks and the scheduler
    / hash block sizes come from vLLM's own functions; see :func:`_layer_specs` for the one
    rule replicated.  ``retention_interval``: ``CacheConfig.prefix_cache_retention_interval``
    (:data:`DEFAULT_RETENTION`: vLLM's default, not passed; None: dense; an int: see
    :func:`retention_interval_error`).  Raises VllmUnavailable, or ValueError naming a bad
    argument."""
    r = _resolve(groups, **options)
    v, cfg, kv_cfg, sched_bs, hash_bs = r.v, r.cfg, r.kv_cfg, r.sched_bs, r.hash_bs
    kv_cfg.hash_block_size = hash_bs
    cfg.cache_config.num_gpu_blocks = kv_cfg.num_blocks
    hash_fn = v.get_hash_fn_by_name(r.hash_algo)
    v.utils.init_none_hash(hash_fn)
    manager = v.KVCacheManager(
        kv_cfg,
        max_model_len=r.max_model_len,
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
        bytes_per_block=r.per_block,
        num_blocks=kv_cfg.num_blocks,
        mamba_align=r.has_mamba,
        partial_hash_hits=manager.coordinator.enable_partial_hash_hits,
        groups=summary,
    )
