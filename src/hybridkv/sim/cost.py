"""A step-time cost model: how long one engine step takes on a named accelerator.

The model is a roofline estimate, per step::

    flops = 2 * active_params / tp * new_tokens                  (linear layers)
          + sum over requests, attention entries and new queries of
            4 * q_heads / tp * qk_dim * keys_visible_to_the_query  (QK^T and PV)
    bytes = active_weight_bytes / tp                             (weights read once per step)
          + sum over requests of the cache bytes its queries read (windows and states counted
            by each layer's own rule) + the new tokens' cache bytes written
    time  = max(flops / (peak_flops * mfu), bytes / (hbm_bandwidth * bw_efficiency),
                loads, stores)
          + step_overhead
    loads = host bytes read back / host_bandwidth + disk bytes / disk_bandwidth
            (+ disk_latency when the step reads the disk)
    stores = bytes the lower tiers took from the device since the last step / host_bandwidth

Lower-tier loads and stores run on copy engines of their own, one per direction of the
host link, and overlap the step's compute: a step waits for them only when they take longer
(a simplification: a real engine would run the other requests meanwhile).  Stores count the
device's evictions written back and write-through copies (a disk tier's too: they cross the
link to host memory first); moves between tiers and disk writes (a writer thread's, behind
the step) are not charged.

Everything is per tensor-parallel rank (``ModelSpec.tp_size``, whose cache bytes are one
rank's already): query heads, weights and linear FLOPs are divided by the TP size (MLA's
latent cache is replicated on every rank, its query heads are not); the all-reduces between
ranks are not charged.  A query at position ``p`` sees ``p + 1`` keys under full attention,
``min(p + 1, window)`` under a sliding window and ``p mod chunk + 1`` under chunked local
attention (summed exactly over a step's queries).

State layers cost a constant per token (their state is read and written once per step, and
their per-token work is in ``active_params``).  The numbers are estimates for comparing
strategies and workloads, not a promise about a particular engine.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridkv.cache import BlockMove
from hybridkv.errors import ConfigError, UnknownModelError, brief_repr
from hybridkv.specs import CacheKind, MLASpec, ModelSpec

__all__ = ["ACCELERATORS", "Accelerator", "ModelProfile", "StepCostModel", "load_model_config"]


@dataclass(frozen=True, kw_only=True)
class Accelerator:
    """Peak numbers of one accelerator (dense bf16 FLOP/s, HBM bytes/s)."""

    name: str
    peak_flops: float
    hbm_bandwidth: float
    mfu: float = 0.5
    bw_efficiency: float = 0.8
    step_overhead_s: float = 0.0005
    #: Host memory <-> device bytes/s (PCIe 5.0 x16 measured ~55 GB/s; 4.0: ~25 GB/s).
    host_bandwidth: float = 50e9
    #: Disk (local NVMe) read bytes/s and per-step access latency.
    disk_bandwidth: float = 6e9
    disk_latency_s: float = 0.0001


ACCELERATORS: dict[str, Accelerator] = {
    "h100": Accelerator(name="H100 SXM", peak_flops=989e12, hbm_bandwidth=3.35e12),
    "h200": Accelerator(name="H200 SXM", peak_flops=989e12, hbm_bandwidth=4.8e12),
    "a100": Accelerator(
        name="A100 SXM 80GB", peak_flops=312e12, hbm_bandwidth=2.04e12, host_bandwidth=24e9
    ),
}


def load_model_config(model: str | os.PathLike[str]) -> dict[str, Any]:
    """The HF config dict of a catalog name or a config path / directory (a ``str`` or an
    :class:`os.PathLike`; its text config).  Raises :class:`UnknownModelError` for a model
    that is none of these, or of another type."""
    from hybridkv.models import catalog_config, catalog_names

    if isinstance(model, os.PathLike):
        model = os.fspath(model)
    if not isinstance(model, str):
        raise UnknownModelError(
            f"model: expected a catalog name or a path to a config.json (a str or "
            f"os.PathLike), got {brief_repr(model)}"
        )
    names = {n.lower() for n in catalog_names()}
    if model.lower() in names:
        cfg = catalog_config(model)
    else:
        from hybridkv.models.hub_cache import hub_config_path

        path = Path(model)
        if path.is_dir():
            path = path / "config.json"
        elif not path.is_file():
            path = hub_config_path(model) or path
        try:
            cfg = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            from hybridkv.models.catalog import catalog_entry

            cfg = catalog_config(catalog_entry(model).name)
    text = cfg.get("text_config")
    return dict(text) if isinstance(text, dict) else dict(cfg)


def _int(cfg: dict[str, Any], *names: str, default: int = 0) -> int:
    for name in names:
        value = cfg.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return default


@dataclass(frozen=True, kw_only=True)
class ModelProfile:
    """What the cost model needs beyond the cache specs: active parameters and query heads."""

    active_params: float
    q_heads: int
    weight_bytes_per_param: float = 2.0

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> ModelProfile:
        """Estimate active parameters per token from a HF config dict.

        Attention projections, dense or routed MLPs (``num_experts_per_tok`` experts plus
        shared ones), Mamba-style in/out projections for layers without attention, and the LM
        head.  Raises :class:`ConfigError` for a ``cfg`` that is not a mapping or lacks
        ``hidden_size``.
        """
        if not isinstance(cfg, Mapping):
            raise ConfigError(
                f"config: expected a Hugging Face config dict (load_model_config returns one), "
                f"got {brief_repr(cfg)}"
            )
        h = _int(cfg, "hidden_size", "d_model")
        if not h:
            raise ConfigError("config: missing field 'hidden_size' needed by the cost model")
        layers = _int(cfg, "num_hidden_layers", "n_layer", default=1)
        nq = _int(cfg, "num_attention_heads", "n_head", default=max(1, h // 128))
        nkv = _int(cfg, "num_key_value_heads", default=nq)
        hd = _int(cfg, "head_dim", default=max(1, h // nq))
        attn = h * hd * (2 * nq + 2 * nkv)
        inter = _int(cfg, "intermediate_size", "d_inner", default=4 * h)
        moe_inter = _int(cfg, "moe_intermediate_size", "expert_intermediate_size", default=inter)
        k = _int(cfg, "num_experts_per_tok", "experts_per_token", "moe_topk", default=0)
        shared = _int(cfg, "n_shared_experts", "num_shared_experts", default=0)
        mlp = 3 * h * (moe_inter * (k + shared) if k else inter)
        vocab = _int(cfg, "vocab_size", default=32000)
        active = layers * (attn + mlp) + h * vocab
        return cls(active_params=float(active), q_heads=nq)


class StepCostModel:
    """Seconds per step for a model on an accelerator; see the module docstring."""

    def __init__(self, model: ModelSpec, profile: ModelProfile, accel: Accelerator) -> None:
        self.model = model
        self.profile = profile
        self.accel = accel
        self._tp = max(1, model.tp_size)
        self._state_bytes = 0
        # (window: >0 sliding, <0 chunk size, 0 full; q-heads * qk dim; bytes per token) -> layers
        counts: dict[tuple[int, int, int], int] = {}
        for _, _, spec in model.entries():
            if spec.kind is CacheKind.STATE:
                self._state_bytes += spec.state_bytes
                continue
            window = 0
            if spec.kind is CacheKind.SLIDING:
                window = int(getattr(spec, "window", 0))
            elif spec.kind is CacheKind.CHUNKED:
                window = -int(getattr(spec, "chunk_size", 0))
            # one rank's query heads (rounded up: a rank holds at least one)
            heads = -(-profile.q_heads // self._tp)
            if isinstance(spec, MLASpec):
                qk = spec.latent_dim * heads
            else:
                qk = int(getattr(spec, "head_dim", 64)) * heads
            key = (window, qk, spec.bytes_per_token)
            counts[key] = counts.get(key, 0) + 1
        self._attn = [(w, qk, bpt, n) for (w, qk, bpt), n in counts.items()]

    def load_seconds(self, host_bytes: int, disk_bytes: int) -> float:
        """Time to read ``host_bytes`` from host memory and ``disk_bytes`` from disk."""
        a = self.accel
        t = host_bytes / a.host_bandwidth
        if disk_bytes:
            t += disk_bytes / a.disk_bandwidth + a.disk_latency_s
        return t

    def store_seconds(self, device_bytes: int) -> float:
        """Time to copy ``device_bytes`` from the device to host memory (tier stores)."""
        return device_bytes / self.accel.host_bandwidth

    def copy_seconds(self, num_bytes: int) -> float:
        """Time to copy ``num_bytes`` within device memory (read and write)."""
        a = self.accel
        return 2 * num_bytes / (a.hbm_bandwidth * a.bw_efficiency)

    def moves_seconds(self, moves: Sequence[BlockMove], block_bytes: Sequence[int]) -> float:
        """Time to copy compaction's block ``moves`` (groups' ``block_bytes``) before a
        step's pass."""
        return self.copy_seconds(sum(block_bytes[m.group_id] for m in moves))

    def step_seconds(self, items: list[tuple[int, int]], load_s: float = 0.0) -> float:
        """Time of a step computing, per request, ``(start, num_new_tokens)``, whose lower-tier
        copies take ``load_s`` (overlapped with the step: the longer of its loads and its
        stores, :meth:`load_seconds` and :meth:`store_seconds`)."""
        if not items:
            return 0.0
        new_total = 0
        flops = 0.0
        kv_bytes = 0.0
        for start, new in items:
            new_total += new
            end = start + new
            for window, qk, bpt, n in self._attn:
                if window > 0:
                    keys = _window_keys(end, window) - _window_keys(start, window)
                    read = end - max(0, start - window + 1)
                elif window < 0:
                    chunk = -window
                    keys = _chunk_keys(end, chunk) - _chunk_keys(start, chunk)
                    read = end - start // chunk * chunk
                else:
                    keys = (end * (end + 1) - start * (start + 1)) // 2
                    read = end
                flops += 4.0 * qk * keys * n
                kv_bytes += (read + new) * bpt * n
            kv_bytes += 2 * self._state_bytes
        p = self.profile
        flops += 2.0 * p.active_params / self._tp * new_total
        weight_bytes = p.active_params * p.weight_bytes_per_param / self._tp
        a = self.accel
        compute = flops / (a.peak_flops * a.mfu)
        memory = (weight_bytes + kv_bytes) / (a.hbm_bandwidth * a.bw_efficiency)
        return max(compute, memory, load_s) + a.step_overhead_s


def _window_keys(n: int, window: int) -> int:
    """Keys the queries at positions ``0 .. n-1`` see under a sliding ``window``, summed."""
    if n <= window:
        return n * (n + 1) // 2
    return window * (window + 1) // 2 + (n - window) * window


def _chunk_keys(n: int, chunk: int) -> int:
    """Keys the queries at positions ``0 .. n-1`` see under chunked local attention (a query
    sees its own chunk up to itself), summed."""
    whole, rest = divmod(n, chunk)
    return whole * (chunk * (chunk + 1) // 2) + rest * (rest + 1) // 2
