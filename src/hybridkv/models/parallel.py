"""Tensor-parallel sharding rules: what one rank holds of a head or channel dimension.

The rules follow Megatron-style tensor parallelism as engines apply it to caches:

* **KV heads** (:func:`kv_heads_per_rank`): ``num_kv_heads // tp`` when ``tp`` divides the head
  count; when there are fewer KV heads than ranks and ``tp`` is a multiple of the head count,
  every rank holds one (replicated) head; any other ``tp`` is an error.  Example: 8 KV heads,
  tp=2 -> 4 per rank; tp=16 -> 1 per rank (each head on 2 ranks); tp=3 -> ConfigError.
* **Split dimensions** (:func:`split_exact`): Mamba heads, Mamba / delta-rule intermediate
  channels, linear-attention heads and short-conv channels are divided by ``tp`` and must be
  divisible.  Example: 128 Mamba heads, tp=4 -> 32 per rank; tp=3 -> ConfigError.
* **Mamba2 groups** (:func:`split_or_replicate`): ``n_groups // tp`` when divisible, otherwise
  every rank keeps all ``n_groups`` (replicated).  Example: n_groups=8, tp=4 -> 2;
  n_groups=1, tp=4 -> 1.
* **MLA latent**: replicated on every rank (never split), see :mod:`hybridkv.models.mla`.
"""

from __future__ import annotations

from hybridkv.errors import ConfigError

__all__ = ["kv_heads_per_rank", "split_exact", "split_or_replicate"]


def kv_heads_per_rank(num_kv_heads: int, tp: int, *, field: str, model_type: str) -> int:
    """KV heads one rank stores (see the module docstring).  Raises :class:`ConfigError`."""
    if num_kv_heads % tp == 0:
        return num_kv_heads // tp
    if tp % num_kv_heads == 0:
        return 1
    raise ConfigError(
        f"{model_type}: tp_size={tp} cannot shard {field}={num_kv_heads}; use a tp_size that "
        f"divides {num_kv_heads} or is a multiple of it"
    )


def split_exact(value: int, tp: int, *, field: str, model_type: str) -> int:
    """``value // tp``; raises :class:`ConfigError` naming ``field`` unless ``tp`` divides it."""
    if value % tp:
        raise ConfigError(
            f"{model_type}: tp_size={tp} does not divide {field}={value}; use a tp_size that "
            f"divides {value}"
        )
    return value // tp


def split_or_replicate(value: int, tp: int) -> int:
    """``value // tp`` when ``tp`` divides ``value``, else ``value`` (replicated on each rank)."""
    return value // tp if value % tp == 0 else value
