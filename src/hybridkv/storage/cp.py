"""Context parallelism: which rank holds which of a request's tokens, and where.  No torch.

Under context parallelism (CP) a request's KV is spread over ``cp_size`` ranks, each with
its own cache and block table holding only its *local* tokens, in order.  Two shardings:

* ``contiguous``: the request's ``n`` tokens in ``cp_size`` consecutive runs of
  ``ceil(n / cp_size)`` tokens (rank ``r`` holds ``[r*c, (r+1)*c)``; the last may be short),
  what ring attention over a prefill uses;
* ``round_robin``: runs of ``interleave`` tokens dealt to the ranks in turn (token ``t`` on
  rank ``(t // interleave) % cp_size``), what decode-context parallelism uses so that every
  rank's share grows evenly as tokens are appended; ``interleave = block_size`` deals whole
  blocks.

:class:`CPSlotMapper` answers both directions: the rank and local position of a global
token, the global tokens of a rank, and the *slot mapping* (``block * block_size +
offset``, what attention kernels write through) of a rank's local tokens given its block
table.  :meth:`CPSlotMapper.token_map` pairs a rank's local positions with global ones, the
``tokens`` argument :func:`hybridkv.storage.transfer_plan.plan_transfer` takes to move a
cp-sharded cache into an unsharded one (or back).

Example: 10 tokens over 2 ranks, round robin by 2: rank 0 holds tokens 0 1 4 5 8 9, rank 1
holds 2 3 6 7; with blocks of 4 and rank 1's table ``[7, 3]`` its slots are 28 29 30 31.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hybridkv.errors import StorageError, as_integer, brief_repr
from hybridkv.plan import NULL_BLOCK_ID

__all__ = ["CP_MODES", "CPSlotMapper"]

#: The shardings :class:`CPSlotMapper` knows.
CP_MODES = ("contiguous", "round_robin")


class CPSlotMapper:
    """Token placement of one request of ``num_tokens`` tokens over ``cp_size`` ranks.

    Raises :class:`StorageError` for a non-positive size, an unknown ``mode`` or a negative
    token count.
    """

    def __init__(
        self, num_tokens: int, cp_size: int, *, mode: str = "round_robin", interleave: int = 1
    ) -> None:
        if cp_size < 1 or interleave < 1:
            raise StorageError(f"cp_size / interleave: must be >= 1, got {cp_size} / {interleave}")
        if mode not in CP_MODES:
            raise StorageError(f"mode: unknown sharding {mode!r}; valid: {', '.join(CP_MODES)}")
        if num_tokens < 0:
            raise StorageError(f"num_tokens: must be >= 0, got {num_tokens}")
        self.num_tokens = num_tokens
        self.cp_size = cp_size
        self.mode = mode
        self.interleave = interleave
        #: Tokens per rank in contiguous mode.
        self.chunk = -(-num_tokens // cp_size) if num_tokens else 0

    def locate(self, tokens: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(rank, local position)`` of each global token."""
        t = np.asarray(tokens, dtype=np.int64)
        if t.size and (t.min() < 0 or t.max() >= self.num_tokens):
            raise StorageError(f"tokens: positions must lie in [0, {self.num_tokens})")
        if self.mode == "contiguous":
            return t // self.chunk, t % self.chunk
        k, span = self.interleave, self.interleave * self.cp_size
        return (t // k) % self.cp_size, (t // span) * k + t % k

    def global_tokens(self, rank: int) -> np.ndarray:
        """The global positions rank ``rank`` holds, in its local order."""
        if not 0 <= rank < self.cp_size:
            raise StorageError(f"rank: {rank} is not a rank of cp_size {self.cp_size}")
        t = np.arange(self.num_tokens, dtype=np.int64)
        ranks, local = self.locate(t)
        mine = t[ranks == rank]
        ordered: np.ndarray = mine[np.argsort(local[ranks == rank], kind="stable")]
        return ordered

    def num_local(self, rank: int) -> int:
        """How many tokens rank ``rank`` holds."""
        return int(self.global_tokens(rank).size)

    def slot_mapping(self, rank: int, table: Sequence[int], block_size: int) -> np.ndarray:
        """The slot (``block * block_size + offset``) of each of rank ``rank``'s local tokens
        in its block ``table``.  Raises :class:`StorageError` when ``block_size`` is not a
        positive integer, the table is not a 1-D sequence of integers, is too short, or names
        the null block 0 or a negative id where a local token lives (a kernel would write the
        token there)."""
        size = as_integer(block_size)
        if size is None or size < 1:
            raise StorageError(f"block_size: need a positive integer, got {brief_repr(block_size)}")
        n = self.num_local(rank)
        need = -(-n // size)
        arr = np.asarray(table)
        if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
            raise StorageError(
                f"table: need a 1-D sequence of integer block ids, got {brief_repr(table)}"
            )
        if len(arr) < need:
            raise StorageError(
                f"table: rank {rank} holds {n} tokens, {need} blocks of {size}; the "
                f"table has {len(arr)}"
            )
        used = arr[:need].astype(np.int64)
        if np.any(used <= NULL_BLOCK_ID):
            at = int(np.flatnonzero(used <= NULL_BLOCK_ID)[0])
            raise StorageError(
                f"table: entry {at} is block {int(used[at])}, where rank {rank}'s tokens "
                f"{at * size} .. {min(n, (at + 1) * size) - 1} live; valid: block ids >= 1 "
                f"(block {NULL_BLOCK_ID} is the null block)"
            )
        local = np.arange(n, dtype=np.int64)
        blocks = used[local // size]
        return blocks * size + local % size

    def token_map(self, rank: int, *, to_global: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """``(destination positions, source positions)`` for
        :func:`~hybridkv.storage.transfer_plan.plan_transfer`: rank ``rank``'s local tokens
        into a whole-request cache (``to_global``), or the whole request's tokens into the
        rank's cache."""
        g = self.global_tokens(rank)
        local = np.arange(g.size, dtype=np.int64)
        return (g, local) if to_global else (local, g)
