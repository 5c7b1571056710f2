"""The bytes of the lower cache tiers for :class:`~hybridkv.engine.llm_engine.LLMEngine`.

The manager decides (:mod:`hybridkv.cache.tiers`); :class:`TierStore` carries out its
:class:`~hybridkv.cache.tiers.TierOp` stream, in order, before each step's model pass:

* ``store``: the device evicted a cached block to reuse it; its bytes are still intact (no
  step has written the block since), so they are gathered through the storage's transfer
  descriptor (:func:`hybridkv.storage.transfer.gather`: one copy per coalesced byte range,
  one for a cross-layer page-size group) into a host tensor;
* ``load``: a hit reads an entry back: scattered into the fresh device block the manager
  allocated for it, before the step reads that block;
* ``move`` / ``drop`` / ``clear``: a tier evicted an entry down, or out.

Host entries are CPU tensors (pinned when the cache lives on CUDA), one per block: the tier's
byte capacity bounds their total, as the manager accounts it.  A disk tier is not stored by
the engine yet (the manager and simulator model it).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from hybridkv.cache.tiers import TierOp
from hybridkv.engine.errors import EngineError
from hybridkv.storage import KVCacheStorage
from hybridkv.storage.transfer import gather, scatter

__all__ = ["TierStore"]


class TierStore:
    """Tier entries ``(group, hash) -> packed block bytes`` over one engine's storage."""

    def __init__(self, storage: KVCacheStorage) -> None:
        self.storage = storage
        self.entries: dict[str, dict[tuple[int, int], torch.Tensor]] = {"host": {}}
        self._pin = storage.device.type == "cuda"
        #: Blocks copied device -> tier and tier -> device so far.
        self.stored = self.loaded = 0

    def apply(self, ops: Iterable[TierOp]) -> None:
        """Run ``ops`` in order.  Raises :class:`EngineError` for a tier the engine does not
        store or an entry it does not hold (a bookkeeping bug: nothing is read)."""
        storage = self.storage
        for op in ops:
            if op.op == "clear":
                for entries in self.entries.values():
                    entries.clear()
                continue
            entries = self._tier(op.tier)
            key = (op.group_id, op.block_hash)
            if op.op == "store":
                desc = storage.descriptor(op.group_id, [op.block])
                out = torch.empty(desc.total_bytes, dtype=torch.uint8, pin_memory=self._pin)
                entries[key] = gather(desc, storage.buffers, out)
                self.stored += 1
            elif op.op == "load":
                packed = self._entry(entries, key, op)
                desc = storage.descriptor(op.group_id, [op.block])
                scatter(desc, storage.buffers, packed.to(storage.device))
                self.loaded += 1
            elif op.op == "drop":
                self._entry(entries, key, op)
                del entries[key]
            elif op.op == "move":
                self._tier(op.dest)[key] = entries.pop(key)
            else:
                raise EngineError(f"tier store: unknown operation {op.op!r}")

    def _tier(self, name: str) -> dict[tuple[int, int], torch.Tensor]:
        entries = self.entries.get(name)
        if entries is None:
            raise EngineError(
                f"tier store: the engine stores no {name!r} tier (it has: "
                f"{', '.join(self.entries)})"
            )
        return entries

    def _entry(
        self, entries: dict[tuple[int, int], torch.Tensor], key: tuple[int, int], op: TierOp
    ) -> torch.Tensor:
        found = entries.get(key)
        if found is None:
            raise EngineError(
                f"tier store: {op.op} of group {op.group_id} hash {op.block_hash:#x}, which the "
                f"{op.tier} tier does not hold"
            )
        return found

    def num_bytes(self) -> int:
        """Bytes the entries hold."""
        return sum(t.numel() for entries in self.entries.values() for t in entries.values())
