"""What one layer stores: frozen, keyword-only cache specs.

A *cache spec* describes one cache a layer keeps, in units a planner and a block manager can
reason about without any tensor library:

* per-token kinds (:class:`FullAttentionSpec`, :class:`SlidingWindowSpec`,
  :class:`ChunkedLocalSpec`, :class:`MLASpec`) store ``bytes_per_token`` for every token they
  keep, and a block of ``block_size`` tokens takes ``block_size * bytes_per_token`` bytes;
* :class:`StateSpec` (Mamba1/2, gated DeltaNet, KDA, short conv) stores a fixed-size state per
  request, ``state_bytes`` whatever the sequence length; one block is one state slot;
* :class:`NoCacheSpec` stores nothing (MLP/MoE layers, layers reading another layer's KV).

Token positions are 0-based; spans are half-open ``range`` objects.  A sliding window of ``W``
lets the query at position ``q`` read keys ``q-W+1 .. q`` (``W`` keys, itself included), the
convention of Hugging Face transformers' sliding masks.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field, fields
from enum import StrEnum
from math import prod
from typing import Any, ClassVar

from hybridkv.errors import SpecError
from hybridkv.specs.dtypes import DType

__all__ = [
    "MAX_TOKENS",
    "WINDOW_KINDS",
    "AttentionSpec",
    "CacheKind",
    "CacheSpec",
    "ChunkedLocalSpec",
    "FullAttentionSpec",
    "MLASpec",
    "NoCacheReason",
    "NoCacheSpec",
    "SlidingWindowSpec",
    "StateMixer",
    "StateSpec",
    "StateTensor",
    "spec_from_dict",
]

#: Largest window, chunk or sequence length a spec accepts (16Mi tokens).
MAX_TOKENS = 1 << 24


class CacheKind(StrEnum):
    """The cache-management rule a spec follows; managers dispatch on it."""

    FULL = "full_attention"
    SLIDING = "sliding_window"
    CHUNKED = "chunked_local"
    MLA = "mla"
    STATE = "state"
    NONE = "none"


#: Kinds that keep only a window of recent tokens (their managers replace blocks that left it
#: with the null block).
WINDOW_KINDS = frozenset({CacheKind.SLIDING, CacheKind.CHUNKED})


class StateMixer(StrEnum):
    """The recurrent mixer that owns a :class:`StateSpec`."""

    MAMBA1 = "mamba1"
    MAMBA2 = "mamba2"
    GATED_DELTANET = "gated_deltanet"
    KDA = "kda"
    SHORT_CONV = "short_conv"


class NoCacheReason(StrEnum):
    """Why a layer stores nothing."""

    MLP = "mlp"
    KV_SHARED = "kv_shared"


def _positive(owner: str, name: str, value: object, *, upper: int | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise SpecError(f"{owner}.{name}: must be a positive integer, got {value!r}")
    if upper is not None and value > upper:
        raise SpecError(f"{owner}.{name}: {value} is larger than the maximum {upper}")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, kw_only=True)
class CacheSpec(ABC):
    """One cache a layer keeps.  Subclasses are frozen and hashable: equal specs group together."""

    kind: ClassVar[CacheKind]

    @property
    @abstractmethod
    def bytes_per_token(self) -> int:
        """Bytes stored per cached token (0 for state and no-cache kinds)."""

    @property
    def state_bytes(self) -> int:
        """Bytes of the fixed-size per-request state (0 for per-token kinds)."""
        return 0

    @property
    def prefix_closed(self) -> bool:
        """True when a cache hit of length ``n`` implies a hit of every shorter aligned length.

        Full attention and MLA keep every token, so their hits are prefix-closed.  A sliding
        window, a chunk or a state only covers the tokens near the hit point, so having the
        cache for ``n`` tokens says nothing about ``m < n``.
        """
        return False

    @property
    def stores_nothing(self) -> bool:
        """True for layers that allocate no cache at all."""
        return False

    def bytes_per_block(self, block_size: int) -> int:
        """Bytes of one block of ``block_size`` tokens (one state slot for state kinds)."""
        _positive(type(self).__name__, "block_size", block_size)
        return block_size * self.bytes_per_token + self.state_bytes

    @abstractmethod
    def kept_tokens(self, num_computed: int) -> tuple[range, ...]:
        """Token spans some future query (position >= ``num_computed``) may still read.

        Everything outside these spans can be released once ``num_computed`` tokens are in
        the cache.  State kinds return ``()``: they keep a state, not tokens.
        """

    @abstractmethod
    def visible_tokens(self, query_pos: int) -> tuple[range, ...]:
        """Token spans the query at ``query_pos`` reads (itself included)."""

    def resident_bytes(self, seq_len: int) -> int:
        """Exact bytes this cache needs while the last token of a ``seq_len`` sequence runs."""
        if seq_len <= 0:
            return 0
        tokens = sum(len(r) for r in self.visible_tokens(seq_len - 1))
        return tokens * self.bytes_per_token + self.state_bytes

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict; :func:`spec_from_dict` inverts it."""
        out: dict[str, Any] = {"kind": self.kind.value}
        for f in fields(self):
            out[f.name] = _encode(getattr(self, f.name))
        return out


def _encode(value: object) -> Any:
    if isinstance(value, StrEnum):
        return value.value
    if isinstance(value, StateTensor):
        return {"name": value.name, "shape": list(value.shape), "dtype": value.dtype.value}
    if isinstance(value, tuple):
        return [_encode(v) for v in value]
    return value


@dataclass(frozen=True, kw_only=True)
class AttentionSpec(CacheSpec):
    """Fields shared by the softmax-attention kinds that store K and V per token.

    ``head_dim`` is the K head size, ``v_head_dim`` the V head size (defaults to ``head_dim``;
    they differ in e.g. MLA-expanded or some research models).  ``learned_sinks`` marks
    per-head sink logits (gpt-oss ``s_aux``): they change the softmax, not what is stored.
    """

    num_kv_heads: int
    head_dim: int
    dtype: DType
    v_head_dim: int | None = None
    learned_sinks: bool = False

    def __post_init__(self) -> None:
        name = type(self).__name__
        _positive(name, "num_kv_heads", self.num_kv_heads)
        _positive(name, "head_dim", self.head_dim)
        if self.v_head_dim is not None:
            _positive(name, "v_head_dim", self.v_head_dim)
        if not isinstance(self.dtype, DType):
            object.__setattr__(self, "dtype", DType.parse(self.dtype, field=f"{name}.dtype"))

    @property
    def v_dim(self) -> int:
        """The V head size actually stored."""
        return self.head_dim if self.v_head_dim is None else self.v_head_dim

    @property
    def bytes_per_token(self) -> int:
        return self.num_kv_heads * (self.head_dim + self.v_dim) * self.dtype.itemsize


@dataclass(frozen=True, kw_only=True)
class FullAttentionSpec(AttentionSpec):
    """Causal attention over every earlier token (MHA, GQA, MQA)."""

    kind: ClassVar[CacheKind] = CacheKind.FULL

    @property
    def prefix_closed(self) -> bool:
        return True

    def kept_tokens(self, num_computed: int) -> tuple[range, ...]:
        return (range(0, max(0, num_computed)),)

    def visible_tokens(self, query_pos: int) -> tuple[range, ...]:
        return (range(0, query_pos + 1),)


@dataclass(frozen=True, kw_only=True)
class SlidingWindowSpec(AttentionSpec):
    """Attention over the last ``window`` tokens, plus the first ``sink_tokens`` tokens.

    ``sink_tokens`` are StreamingLLM-style attention sinks: tokens kept forever at the start.
    """

    kind: ClassVar[CacheKind] = CacheKind.SLIDING
    window: int
    sink_tokens: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        _positive(type(self).__name__, "window", self.window, upper=MAX_TOKENS)
        if not isinstance(self.sink_tokens, int) or not 0 <= self.sink_tokens <= MAX_TOKENS:
            raise SpecError(
                f"SlidingWindowSpec.sink_tokens: must be an integer in [0, {MAX_TOKENS}], "
                f"got {self.sink_tokens!r}"
            )

    def _spans(self, start: int, end: int) -> tuple[range, ...]:
        sinks = min(self.sink_tokens, end)
        if sinks <= 0:
            return (range(max(0, start), end),)
        if start <= sinks:
            return (range(0, end),)
        return (range(0, sinks), range(start, end))

    def kept_tokens(self, num_computed: int) -> tuple[range, ...]:
        n = max(0, num_computed)
        return self._spans(n - self.window + 1, n)

    def visible_tokens(self, query_pos: int) -> tuple[range, ...]:
        return self._spans(query_pos - self.window + 1, query_pos + 1)


@dataclass(frozen=True, kw_only=True)
class ChunkedLocalSpec(AttentionSpec):
    """Attention within aligned chunks of ``chunk_size`` tokens (Llama 4 local layers)."""

    kind: ClassVar[CacheKind] = CacheKind.CHUNKED
    chunk_size: int

    def __post_init__(self) -> None:
        super().__post_init__()
        _positive(type(self).__name__, "chunk_size", self.chunk_size, upper=MAX_TOKENS)

    def kept_tokens(self, num_computed: int) -> tuple[range, ...]:
        n = max(0, num_computed)
        return (range(n // self.chunk_size * self.chunk_size, n),)

    def visible_tokens(self, query_pos: int) -> tuple[range, ...]:
        return (range(query_pos // self.chunk_size * self.chunk_size, query_pos + 1),)


@dataclass(frozen=True, kw_only=True)
class MLASpec(CacheSpec):
    """Multi-head latent attention: one ``kv_lora_rank + qk_rope_head_dim`` vector per token."""

    kind: ClassVar[CacheKind] = CacheKind.MLA
    kv_lora_rank: int
    qk_rope_head_dim: int
    dtype: DType

    def __post_init__(self) -> None:
        _positive("MLASpec", "kv_lora_rank", self.kv_lora_rank)
        _positive("MLASpec", "qk_rope_head_dim", self.qk_rope_head_dim)
        if not isinstance(self.dtype, DType):
            object.__setattr__(self, "dtype", DType.parse(self.dtype, field="MLASpec.dtype"))

    @property
    def latent_dim(self) -> int:
        """Elements stored per token."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def bytes_per_token(self) -> int:
        return self.latent_dim * self.dtype.itemsize

    @property
    def prefix_closed(self) -> bool:
        return True

    def kept_tokens(self, num_computed: int) -> tuple[range, ...]:
        return (range(0, max(0, num_computed)),)

    def visible_tokens(self, query_pos: int) -> tuple[range, ...]:
        return (range(0, query_pos + 1),)


@dataclass(frozen=True, kw_only=True)
class StateTensor:
    """One named recurrent-state tensor of a layer, per request (no batch dimension)."""

    name: str
    shape: tuple[int, ...]
    dtype: DType

    def __post_init__(self) -> None:
        if not self.name:
            raise SpecError("StateTensor.name: must be a non-empty string")
        shape = tuple(self.shape)
        if not shape or any(not isinstance(d, int) or d <= 0 for d in shape):
            raise SpecError(
                f"StateTensor.shape: {self.name!r} needs positive integer dims, got {self.shape!r}"
            )
        object.__setattr__(self, "shape", shape)
        if not isinstance(self.dtype, DType):
            dtype = DType.parse(self.dtype, field=f"StateTensor({self.name}).dtype")
            object.__setattr__(self, "dtype", dtype)

    @property
    def nbytes(self) -> int:
        return prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True, kw_only=True)
class StateSpec(CacheSpec):
    """A fixed-size recurrent state per request: named tensors with their own shapes and dtypes.

    The state after token ``t`` summarises every token up to ``t``; a prefix hit needs the
    state checkpointed exactly at the hit point, so hits are not prefix-closed.
    """

    kind: ClassVar[CacheKind] = CacheKind.STATE
    mixer: StateMixer
    tensors: tuple[StateTensor, ...] = field(default=())

    def __post_init__(self) -> None:
        if not isinstance(self.mixer, StateMixer):
            try:
                object.__setattr__(self, "mixer", StateMixer(self.mixer))
            except ValueError:
                valid = ", ".join(m.value for m in StateMixer)
                raise SpecError(
                    f"StateSpec.mixer: unknown mixer {self.mixer!r}; valid: {valid}"
                ) from None
        tensors = tuple(self.tensors)
        if not tensors:
            raise SpecError("StateSpec.tensors: a state spec needs at least one tensor")
        names = [t.name for t in tensors]
        if len(set(names)) != len(names):
            raise SpecError(f"StateSpec.tensors: duplicate tensor names in {names}")
        object.__setattr__(self, "tensors", tensors)

    @property
    def bytes_per_token(self) -> int:
        return 0

    @property
    def state_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def kept_tokens(self, num_computed: int) -> tuple[range, ...]:
        return ()

    def visible_tokens(self, query_pos: int) -> tuple[range, ...]:
        return ()


@dataclass(frozen=True, kw_only=True)
class NoCacheSpec(CacheSpec):
    """A layer that stores nothing: an MLP/MoE-only layer, or one reading another layer's KV.

    ``source_layer`` names the layer whose cache a KV-shared layer reads.
    """

    kind: ClassVar[CacheKind] = CacheKind.NONE
    reason: NoCacheReason = NoCacheReason.MLP
    source_layer: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.reason, NoCacheReason):
            try:
                object.__setattr__(self, "reason", NoCacheReason(self.reason))
            except ValueError:
                valid = ", ".join(r.value for r in NoCacheReason)
                raise SpecError(
                    f"NoCacheSpec.reason: unknown reason {self.reason!r}; valid: {valid}"
                ) from None
        if self.reason is NoCacheReason.KV_SHARED and (
            not isinstance(self.source_layer, int) or self.source_layer < 0
        ):
            raise SpecError(
                "NoCacheSpec.source_layer: a kv_shared layer needs the index (>= 0) of the "
                f"layer it reads, got {self.source_layer!r}"
            )

    @property
    def bytes_per_token(self) -> int:
        return 0

    @property
    def prefix_closed(self) -> bool:
        return True

    @property
    def stores_nothing(self) -> bool:
        return True

    def bytes_per_block(self, block_size: int) -> int:
        return 0

    def kept_tokens(self, num_computed: int) -> tuple[range, ...]:
        return ()

    def visible_tokens(self, query_pos: int) -> tuple[range, ...]:
        return ()


_REGISTRY: dict[str, type[CacheSpec]] = {
    cls.kind.value: cls
    for cls in (
        FullAttentionSpec,
        SlidingWindowSpec,
        ChunkedLocalSpec,
        MLASpec,
        StateSpec,
        NoCacheSpec,
    )
}


def spec_from_dict(data: dict[str, Any]) -> CacheSpec:
    """Rebuild a spec from :meth:`CacheSpec.to_dict` output.  Raises :class:`SpecError`."""
    kind = data.get("kind")
    cls = _REGISTRY.get(str(kind))
    if cls is None:
        raise SpecError(f"spec.kind: unknown kind {kind!r}; valid: {', '.join(_REGISTRY)}")
    kwargs = {k: v for k, v in data.items() if k != "kind"}
    if cls is StateSpec:
        kwargs["tensors"] = tuple(
            StateTensor(name=t["name"], shape=tuple(t["shape"]), dtype=DType(t["dtype"]))
            for t in kwargs.get("tensors", ())
        )
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise SpecError(f"spec: bad fields for kind {kind!r}: {exc}") from None
