"""The result of planning: a :class:`Plan` and its parts, JSON round-trippable.

All byte figures are bytes of the budget; token figures are tokens; block figures are block
ids of one group (or chunks of the arena).  ``Plan.from_json(plan.to_json()) == plan``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from hybridkv.errors import HybridKVError, PlanError
from hybridkv.plan.accounting import Waste
from hybridkv.plan.layout import MemoryLayout, Strategy
from hybridkv.plan.options import PlanOptions
from hybridkv.specs import ModelSpec

__all__ = ["Capacity", "PhysicalNeed", "Plan"]


def _ints(values: Any) -> tuple[int, ...]:
    return tuple(int(v) for v in values)


@dataclass(frozen=True, kw_only=True)
class Capacity:
    """How many max-length requests fit, and in which blocks.

    ``blocks_per_request[g]``: peak blocks one request holds in group ``g``.
    ``pool_blocks[p]``: blocks of pool ``p`` including its null block (pool strategies).
    ``num_chunks``: arena chunks including the null chunk (0 for pool strategies);
    ``blocks_per_chunk[g]``: group ``g``'s blocks per chunk (arena only).
    ``blocks_in_use[g]`` / ``chunks_in_use[g]``: what the requests hold at capacity.
    """

    max_concurrent_requests: int
    max_resident_tokens: int
    blocks_per_request: tuple[int, ...]
    blocks_in_use: tuple[int, ...]
    pool_blocks: tuple[int, ...] = ()
    num_chunks: int = 0
    blocks_per_chunk: tuple[int, ...] = ()
    chunks_in_use: tuple[int, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "max_concurrent_requests": self.max_concurrent_requests,
            "max_resident_tokens": self.max_resident_tokens,
            "blocks_per_request": list(self.blocks_per_request),
            "blocks_in_use": list(self.blocks_in_use),
            "pool_blocks": list(self.pool_blocks),
            "num_chunks": self.num_chunks,
            "blocks_per_chunk": list(self.blocks_per_chunk),
            "chunks_in_use": list(self.chunks_in_use),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Capacity:
        return cls(
            max_concurrent_requests=int(data["max_concurrent_requests"]),
            max_resident_tokens=int(data["max_resident_tokens"]),
            blocks_per_request=_ints(data["blocks_per_request"]),
            blocks_in_use=_ints(data["blocks_in_use"]),
            pool_blocks=_ints(data.get("pool_blocks", ())),
            num_chunks=int(data.get("num_chunks", 0)),
            blocks_per_chunk=_ints(data.get("blocks_per_chunk", ())),
            chunks_in_use=_ints(data.get("chunks_in_use", ())),
        )


@dataclass(frozen=True, kw_only=True)
class PhysicalNeed:
    """Exact bytes ``requests`` max-length requests need at their last token, no rounding.

    ``per_layer[i]`` is ``requests * LayerSpec.resident_bytes(max_model_len)`` of layer ``i``.
    """

    requests: int
    per_layer: tuple[int, ...]

    @property
    def total(self) -> int:
        return sum(self.per_layer)

    @classmethod
    def of(cls, model: ModelSpec, seq_len: int, requests: int) -> PhysicalNeed:
        return cls(
            requests=requests,
            per_layer=tuple(requests * layer.resident_bytes(seq_len) for layer in model.layers),
        )

    def to_dict(self) -> dict[str, Any]:
        return {"requests": self.requests, "per_layer": list(self.per_layer), "total": self.total}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PhysicalNeed:
        return cls(requests=int(data["requests"]), per_layer=_ints(data["per_layer"]))


@dataclass(frozen=True, kw_only=True)
class Plan:
    """A capacity plan: a model, a budget, the chosen layout and what it holds.

    Ledger (exact): ``allocated_bytes + waste.total + free_bytes == memory_bytes``, where
    ``allocated_bytes`` is the real data space of the blocks held at capacity (>=
    ``physical_need.total``; the difference is block rounding) and ``free_bytes`` what is left
    but too little for one more request.  See :mod:`hybridkv.plan.accounting`.  ``notes`` say
    why the strategy chose what it did (padding, raised block sizes, a missed aim).
    """

    model: ModelSpec
    strategy: Strategy
    memory_bytes: int
    max_model_len: int
    options: PlanOptions
    layout: MemoryLayout
    capacity: Capacity
    waste: Waste
    allocated_bytes: int
    free_bytes: int
    physical_need: PhysicalNeed
    notes: tuple[str, ...] = ()

    @property
    def utilisation(self) -> float:
        """Physical need of the planned requests over the budget (0..1)."""
        return self.physical_need.total / self.memory_bytes

    @property
    def waste_fraction(self) -> float:
        return self.waste.total / self.memory_bytes

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict; ``utilisation`` and totals are included for readers, and ignored
        by :meth:`from_dict` (they are derived)."""
        return {
            "model": self.model.to_dict(),
            "strategy": self.strategy.value,
            "memory_bytes": self.memory_bytes,
            "max_model_len": self.max_model_len,
            "options": self.options.to_dict(),
            "layout": self.layout.to_dict(),
            "capacity": self.capacity.to_dict(),
            "waste": self.waste.to_dict(),
            "allocated_bytes": self.allocated_bytes,
            "free_bytes": self.free_bytes,
            "physical_need": self.physical_need.to_dict(),
            "notes": list(self.notes),
            "utilisation": self.utilisation,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        """Inverse of :meth:`to_dict`.  Raises :class:`PlanError` (or the
        :class:`~hybridkv.errors.SpecError` of a bad spec) on a missing or invalid field."""
        try:
            return cls._decode(data)
        except HybridKVError:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise PlanError(f"plan: invalid plan data ({type(exc).__name__}: {exc})") from None

    @classmethod
    def _decode(cls, data: dict[str, Any]) -> Plan:
        return cls(
            model=ModelSpec.from_dict(data["model"]),
            strategy=Strategy(data["strategy"]),
            memory_bytes=int(data["memory_bytes"]),
            max_model_len=int(data["max_model_len"]),
            options=PlanOptions.from_dict(data["options"]),
            layout=MemoryLayout.from_dict(data["layout"]),
            capacity=Capacity.from_dict(data["capacity"]),
            waste=Waste.from_dict(data["waste"]),
            allocated_bytes=int(data["allocated_bytes"]),
            free_bytes=int(data["free_bytes"]),
            physical_need=PhysicalNeed.from_dict(data["physical_need"]),
            notes=tuple(str(n) for n in data.get("notes", ())),
        )

    def to_json(self, *, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """Inverse of :meth:`to_json`; raises :class:`PlanError` on invalid JSON."""
        try:
            data = json.loads(text)
        except ValueError as exc:  # JSONDecodeError, or an integer too long to convert
            raise PlanError(f"plan: not valid JSON ({exc})") from None
        except RecursionError:
            raise PlanError("plan: JSON nested too deeply to read") from None
        if not isinstance(data, dict):
            raise PlanError(f"plan: expected a JSON object, got {type(data).__name__}")
        return cls.from_dict(data)
