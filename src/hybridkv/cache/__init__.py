"""Cache-manager runtime: block pools, per-kind managers, the hybrid coordinator.  No torch.

Entry point: :class:`KVCacheManager` (``hybridkv.cache.manager``).  Layers, bottom to top:

* :mod:`~hybridkv.cache.hashing`, :mod:`~hybridkv.cache.request`: chained block hashes at the
  layout's finest block size, extended as tokens are appended;
* :mod:`~hybridkv.cache.pool_base`, :mod:`~hybridkv.cache.pool_shared`,
  :mod:`~hybridkv.cache.pool_arena`: block pools for the ``uniform``, ``pools`` and ``arena``
  strategies (ref counts, LRU of cached free blocks, per-group hash maps);
* :mod:`~hybridkv.cache.kinds`: one manager per cache kind (full/MLA, sliding window, chunked
  local, recurrent state);
* :mod:`~hybridkv.cache.coordinator`: fixed-point hits and atomic allocation across groups;
* :mod:`~hybridkv.cache.manager`: the facade, with validation, statistics and KV events.

The manager, pools, coordinator and hashing can be compiled with mypyc
(``HYBRIDKV_COMPILE=1 pip install --no-build-isolation .``; :func:`compiled` says whether
they were).
"""

from __future__ import annotations

from hybridkv.cache.admission import (
    CHECKPOINT_ADMISSION,
    CHECKPOINT_REASONS,
    CHECKPOINT_WHEN_FULL,
    TIER_ADMISSION,
)
from hybridkv.cache.coordinator import PUBLISH_MODES, WINDOW_RETENTION
from hybridkv.cache.errors import (
    DuplicateRequestError,
    FinishedRequestError,
    LayoutMismatchError,
    RequestLengthError,
    StaleComputedBlocksError,
    UnknownRequestError,
)
from hybridkv.cache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from hybridkv.cache.hashing import (
    BlockHasher,
    BuiltinHasher,
    HasherError,
    Sha256Hasher,
    Xxh3Hasher,
    make_hasher,
)
from hybridkv.cache.manager import KVCacheManager
from hybridkv.cache.policies import CHECKPOINT_LIFE
from hybridkv.cache.request import MultiModalItem, Request
from hybridkv.cache.stats import PrefixCacheStats
from hybridkv.cache.tier_sessions import DEFAULT_PROTECT_SHARE
from hybridkv.cache.tiers import TIER_NAMES, TierSpec
from hybridkv.cache.types import (
    AllocationResult,
    BlockHash,
    BlockId,
    BlockMove,
    ComputedBlocks,
    StateCopy,
    StateSlot,
    TierLoad,
)

__all__ = [
    "CHECKPOINT_ADMISSION",
    "CHECKPOINT_LIFE",
    "CHECKPOINT_REASONS",
    "CHECKPOINT_WHEN_FULL",
    "DEFAULT_PROTECT_SHARE",
    "PUBLISH_MODES",
    "TIER_ADMISSION",
    "TIER_NAMES",
    "WINDOW_RETENTION",
    "AllBlocksCleared",
    "AllocationResult",
    "BlockHash",
    "BlockHasher",
    "BlockId",
    "BlockMove",
    "BlockRemoved",
    "BlockStored",
    "BuiltinHasher",
    "ComputedBlocks",
    "DuplicateRequestError",
    "FinishedRequestError",
    "HasherError",
    "KVCacheManager",
    "KVEvent",
    "LayoutMismatchError",
    "MultiModalItem",
    "PrefixCacheStats",
    "Request",
    "RequestLengthError",
    "Sha256Hasher",
    "StaleComputedBlocksError",
    "StateCopy",
    "StateSlot",
    "TierLoad",
    "TierSpec",
    "UnknownRequestError",
    "Xxh3Hasher",
    "compiled",
    "make_hasher",
]


def compiled() -> bool:
    """Whether the bookkeeping runs the optional compiled build (mypyc, see setup.py)."""
    from hybridkv.cache import coordinator

    return not str(coordinator.__file__).endswith(".py")
