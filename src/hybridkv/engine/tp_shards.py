"""Tensor-parallel *sharded-cache emulation* for handovers between instances of other TP sizes.

transformers runs a model whole, so an engine here computes at TP 1.  To move requests the
way a TP-``N`` instance would hold them, :func:`shard_caches` builds the ``N`` per-rank
caches of an engine's layout: every attention group keeps ``1/N`` of the KV heads (rank
``r`` the heads :func:`~hybridkv.storage.connector.tp_shard` gives it), every state tensor
``1/N`` of its axis 0 (hybridkv's contiguous split), MLA latents whole; one pool per group,
private to the rank.  :func:`scatter_to_shards` copies a request from the engine's cache into
the shards (what a TP-``N`` prefill instance would hold after its prefill), and
:func:`gather_from_shards` the other way (what a TP-``N`` decode instance's ranks would hold,
assembled for the engine that computes).  Every copy is a
:func:`~hybridkv.storage.transfer_plan.plan_transfer` plan, so the bytes that cross between
instances are exactly those of the per-rank caches a TP-``N`` instance would register.
What is emulated: the computation (not split), and the head split of state tensors (real
models split some states by interleaved channel groups).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from hybridkv.engine.errors import EngineError
from hybridkv.plan import GroupPlan, MemoryLayout, PoolPlan, Strategy
from hybridkv.specs import AttentionSpec, CacheSpec, StateSpec
from hybridkv.storage import KVCacheStorage
from hybridkv.storage.connector import Registration, register_storage, tp_shard
from hybridkv.storage.transfer_plan import plan_transfer

__all__ = ["Shard", "gather_from_shards", "scatter_to_shards", "shard_caches"]


@dataclass
class Shard:
    """One rank's cache: its storage, registration, and the block table of each group for
    a request of up to ``capacity`` tokens (blocks ``1..``; a state group's slot 1)."""

    storage: KVCacheStorage
    registration: Registration
    tables: dict[int, list[int]]


def _shard_spec(spec: CacheSpec, tp: int, rank: int, where: str) -> CacheSpec:
    if isinstance(spec, AttentionSpec):
        heads = spec.num_kv_heads
        if heads % tp:
            raise EngineError(
                f"{where}: {heads} KV heads do not split over tp {tp} (the emulation needs "
                "a multiple; replicated heads are planned, not emulated)"
            )
        return replace(spec, num_kv_heads=tp_shard(heads, tp, rank)[1])
    if isinstance(spec, StateSpec):
        tensors = []
        for t in spec.tensors:
            if t.shape[0] % tp:
                raise EngineError(
                    f"{where}: state tensor {t.name!r} {t.shape} does not split over tp {tp} "
                    "along axis 0"
                )
            tensors.append(replace(t, shape=(t.shape[0] // tp, *t.shape[1:])))
        return replace(spec, tensors=tuple(tensors))
    return spec  # MLA: every rank holds the whole latent


def shard_caches(layout: MemoryLayout, tp: int, capacity: int) -> list[Shard]:
    """The ``tp`` rank caches of ``layout``'s groups, each with room for one request of
    ``capacity`` tokens.  Raises :class:`EngineError` for a group that does not split."""
    shards = []
    for rank in range(tp):
        groups = []
        for g in layout.groups:
            spec = _shard_spec(g.spec, tp, rank, f"group {g.group_id}")
            groups.append(
                GroupPlan(
                    group_id=g.group_id,
                    spec=spec,
                    members=g.members,
                    block_size=g.block_size,
                    kernel_block_size=g.block_size,
                    page_bytes=spec.bytes_per_block(g.block_size),
                )
            )
        blocks = {
            g.group_id: 1 if g.spec.kind.value == "state" else -(-capacity // g.block_size)
            for g in groups
        }
        pools = tuple(
            PoolPlan(
                pool_id=g.group_id,
                group_ids=(g.group_id,),
                block_bytes=g.block_bytes,
                num_blocks=blocks[g.group_id] + 1,
            )
            for g in groups
        )
        rank_layout = MemoryLayout(strategy=Strategy.POOLS, groups=tuple(groups), pools=pools)
        storage = KVCacheStorage(rank_layout)  # host memory: they stand for other machines
        shards.append(
            Shard(
                storage=storage,
                registration=register_storage(
                    storage, instance=f"tp{tp}-rank{rank}", tp_rank=rank, tp_size=tp
                ),
                tables={gid: list(range(1, n + 1)) for gid, n in blocks.items()},
            )
        )
    return shards


def scatter_to_shards(
    storage: KVCacheStorage,
    registration: Registration,
    tables: Mapping[int, Sequence[int]],
    shards: Sequence[Shard],
    tokens: tuple[int, int],
) -> None:
    """Copy tokens ``tokens`` (and the state) of a request from ``storage`` into every
    shard."""
    for shard in shards:
        plan_transfer(registration, tables, shard.registration, shard.tables, tokens=tokens).copy(
            storage.buffers, shard.storage.buffers
        )


def gather_from_shards(
    shards: Sequence[Shard],
    storage: KVCacheStorage,
    registration: Registration,
    tables: Mapping[int, Sequence[int]],
    tokens: tuple[int, int],
) -> None:
    """Assemble tokens ``tokens`` (and the state) of a request from every shard into
    ``storage``."""
    for shard in shards:
        plan_transfer(shard.registration, shard.tables, registration, tables, tokens=tokens).copy(
            shard.storage.buffers, storage.buffers
        )
