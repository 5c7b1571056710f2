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
Blocks a sliding window has dropped (null entries of the request's tables on the engine's side)
are null in every rank's tables too: no rank holds them, none are copied.
What is emulated: the computation (not split), and the head split of state tensors (real
models split some states by interleaved channel groups).

:func:`tp_split_problem` and :func:`valid_tp_sizes` say, from cache specs alone (no storage),
whether a TP size splits a model's caches; :func:`check_tp` raises :class:`TPSplitError`,
naming the sizes that do, so a caller can refuse a size before any process or cache exists.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from hybridkv.engine.errors import EngineError
from hybridkv.plan import GroupPlan, MemoryLayout, PoolPlan, Strategy
from hybridkv.specs import AttentionSpec, CacheSpec, StateSpec
from hybridkv.storage import KVCacheStorage
from hybridkv.storage.connector import Registration, register_storage, tp_shard
from hybridkv.storage.transfer_plan import plan_transfer

__all__ = [
    "Shard",
    "TPSplitError",
    "check_tp",
    "gather_from_shards",
    "request_tables",
    "scatter_to_shards",
    "shard_caches",
    "tp_split_problem",
    "valid_tp_sizes",
]


class TPSplitError(EngineError):
    """A tensor-parallel size that does not split a model's caches (or is not positive)."""


@dataclass
class Shard:
    """One rank's cache: its storage, registration, and the block table of each group for
    a request of up to ``capacity`` tokens (blocks ``1..``; a state group's slot 1)."""

    storage: KVCacheStorage
    registration: Registration
    tables: dict[int, list[int]]


def _split_sizes(spec: CacheSpec) -> list[int]:
    """The sizes of ``spec`` a TP size must divide: the KV heads of an attention spec, axis 0
    of each state tensor; none for MLA (the latent is whole on every rank)."""
    if isinstance(spec, AttentionSpec):
        return [spec.num_kv_heads]
    if isinstance(spec, StateSpec):
        return [t.shape[0] for t in spec.tensors]
    return []


def tp_split_problem(spec: CacheSpec, tp: int) -> str | None:
    """Why ``spec`` does not split over ``tp`` ranks the way :func:`shard_caches` splits it
    (the first size ``tp`` does not divide, as text), or None when it does."""
    if isinstance(spec, AttentionSpec) and spec.num_kv_heads % tp:
        return f"{spec.num_kv_heads} KV heads do not split over tp {tp}"
    if isinstance(spec, StateSpec):
        for t in spec.tensors:
            if t.shape[0] % tp:
                return f"state tensor {t.name!r} {t.shape} does not split over tp {tp} along axis 0"
    return None


def valid_tp_sizes(specs: Iterable[CacheSpec]) -> list[int] | None:
    """Every TP size that splits all of ``specs`` (the divisors of their sizes' greatest
    common divisor), ascending; None when every size does (MLA latents only)."""
    common = 0
    for spec in specs:
        for size in _split_sizes(spec):
            common = math.gcd(common, size)
    if common == 0:
        return None
    return [d for d in range(1, common + 1) if common % d == 0]


def check_tp(specs: Iterable[CacheSpec], tp: int, *, field: str = "tp", model: str = "") -> None:
    """Raise :class:`TPSplitError` unless ``tp`` is a positive integer that splits every spec
    of ``specs`` as :func:`shard_caches` splits them.  The message reads ``"<field>: <tp>:
    <model>'s <what does not split>; valid for <model>: <the sizes that do>"``."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise TPSplitError(f"{field}: must be a positive integer, got {tp!r}")
    specs = list(specs)
    problem = next((p for p in (tp_split_problem(s, tp) for s in specs) if p is not None), None)
    if problem is None:
        return
    valid = ", ".join(map(str, valid_tp_sizes(specs) or [1]))
    if model:
        raise TPSplitError(f"{field}: {tp}: {model}'s {problem}; valid for {model}: {valid}")
    raise TPSplitError(f"{field}: {tp}: {problem}; valid: {valid}")


def _shard_spec(spec: CacheSpec, tp: int, rank: int, where: str) -> CacheSpec:
    problem = tp_split_problem(spec, tp)
    if problem is not None:
        extra = (
            " (the emulation needs a multiple; replicated heads are planned, not emulated)"
            if isinstance(spec, AttentionSpec)
            else ""
        )
        raise TPSplitError(f"{where}: {problem}{extra}")
    if isinstance(spec, AttentionSpec):
        return replace(spec, num_kv_heads=tp_shard(spec.num_kv_heads, tp, rank)[1])
    if isinstance(spec, StateSpec):
        tensors = tuple(replace(t, shape=(t.shape[0] // tp, *t.shape[1:])) for t in spec.tensors)
        return replace(spec, tensors=tensors)
    return spec  # MLA: every rank holds the whole latent


def shard_caches(layout: MemoryLayout, tp: int, capacity: int) -> list[Shard]:
    """The ``tp`` rank caches of ``layout``'s groups, each with room for one request of
    ``capacity`` tokens.  Raises :class:`TPSplitError` (an :class:`EngineError`) for a group
    that does not split (:func:`check_tp` says so from the specs alone)."""
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


def request_tables(shard: Shard, like: Mapping[int, Sequence[int]]) -> dict[int, list[int]]:
    """``shard``'s block tables for one request whose tables in the engine's cache are
    ``like``: null (0) wherever ``like`` is, since blocks a sliding window has dropped are
    held by no rank (the same block size on both, so the entries match one to one)."""
    out = {}
    for gid, table in shard.tables.items():
        theirs = like.get(gid, ())
        out[gid] = [0 if j < len(theirs) and theirs[j] == 0 else b for j, b in enumerate(table)]
    return out


def scatter_to_shards(
    storage: KVCacheStorage,
    registration: Registration,
    tables: Mapping[int, Sequence[int]],
    shards: Sequence[Shard],
    tokens: tuple[int, int],
) -> None:
    """Copy tokens ``tokens`` (and the state) of a request from ``storage`` into every
    shard (into :func:`request_tables` of ``tables``: not the blocks ``tables`` lacks)."""
    for shard in shards:
        plan_transfer(
            registration, tables, shard.registration, request_tables(shard, tables), tokens=tokens
        ).copy(storage.buffers, shard.storage.buffers)


def gather_from_shards(
    shards: Sequence[Shard],
    storage: KVCacheStorage,
    registration: Registration,
    tables: Mapping[int, Sequence[int]],
    tokens: tuple[int, int],
) -> None:
    """Assemble tokens ``tokens`` (and the state) of a request from every shard into
    ``storage`` (from :func:`request_tables` of ``tables``)."""
    for shard in shards:
        plan_transfer(
            shard.registration, request_tables(shard, tables), registration, tables, tokens=tokens
        ).copy(shard.storage.buffers, storage.buffers)
