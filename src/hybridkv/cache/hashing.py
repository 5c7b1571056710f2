"""Chained block hashes of token prefixes.

The hash of block ``i`` (tokens ``[i*B, (i+1)*B)`` at the hash block size ``B``) is
``H(parent, tokens, extra)`` where ``parent`` is the hash of block ``i-1`` (or the hasher's
seeded root for block 0) and ``extra`` is a tuple of integers carrying the request's extra keys
(LoRA identity, cache salt, multimodal items; see :mod:`hybridkv.cache.request`).  Because the
parent is chained in, one hash identifies the whole prefix up to the end of its block.

Three hashers:

* :class:`Xxh3Hasher` (default): XXH3-128 over a stable little-endian byte encoding; identical
  across processes, machines and Python versions, 128 bits wide, and 2.6x faster than SHA-256
  on a 200k-token prompt (``benchmarks/bench_hashing.py``).  Hashes are ints below ``2**128``.
  Not a cryptographic hash: where tenants must not be able to forge a collision with another
  tenant's prefix, use SHA-256 (or a per-tenant cache salt).
* :class:`Sha256Hasher`: SHA-256 over the same encoding.  Hashes are ints below ``2**256``.
* :class:`BuiltinHasher`: CPython's tuple hash of ``(parent, tokens, extra)``.  Integers and
  tuples of integers are not salted by ``PYTHONHASHSEED``, so the value is identical across
  processes of the same CPython version on 64-bit platforms; it is ~5x faster but only 64 bits
  wide (an accidental collision merges two prefixes with probability ~n**2 / 2**65).

Strings (LoRA names, salts, multimodal ids) enter as :func:`stable_code` integers.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from array import array
from collections.abc import Sequence
from typing import ClassVar

import xxhash

from hybridkv.cache.types import BlockHash
from hybridkv.errors import HybridKVError

__all__ = [
    "HASHERS",
    "BlockHasher",
    "BuiltinHasher",
    "HasherError",
    "Sha256Hasher",
    "Xxh3Hasher",
    "make_hasher",
    "stable_code",
]

_MASK64 = (1 << 64) - 1


class HasherError(HybridKVError, ValueError):
    """An unknown hasher name or a bad seed."""


def stable_code(text: str) -> int:
    """A 63-bit non-negative integer for ``text``, identical in every process (BLAKE2b)."""
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class BlockHasher(ABC):
    """Computes chained block hashes.  Stateless after construction; safe to share."""

    name: ClassVar[str]
    #: Whether :meth:`hash_blocks` is faster given an int64 ``array`` than a list.
    takes_encoded: ClassVar[bool] = False

    def __init__(self, seed: int = 0) -> None:
        if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 1 << 63:
            raise HasherError(f"BlockHasher.seed: must be an integer in [0, 2**63), got {seed!r}")
        self.seed = seed

    @abstractmethod
    def hash_block(
        self, parent: BlockHash | None, tokens: Sequence[int], extra: tuple[int, ...]
    ) -> BlockHash:
        """Hash of one block of ``tokens`` after the prefix hashed as ``parent``.

        ``parent`` is ``None`` for the first block.  ``extra`` holds integers in
        ``[-2**63, 2**63)``; tokens are integers in ``[0, 2**63)``.
        """

    def hash_blocks(
        self, parent: BlockHash | None, tokens: Sequence[int], block_size: int
    ) -> list[BlockHash]:
        """Chained hashes of the ``len(tokens) // block_size`` whole blocks of ``tokens``
        (no extra keys) after the prefix hashed as ``parent``.

        Equal, block for block, to calling :meth:`hash_block` in a loop; hashers override it
        with a faster batch path (one encoding of the tokens instead of one per block).
        """
        out: list[BlockHash] = []
        for i in range(len(tokens) // block_size):
            parent = self.hash_block(parent, tokens[i * block_size : (i + 1) * block_size], ())
            out.append(parent)
        return out

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, BlockHasher) and type(other) is type(self) and other.seed == self.seed
        )

    def __hash__(self) -> int:
        return hash((self.name, self.seed))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(seed={self.seed})"


class _DigestHasher(BlockHasher):
    """A digest over ``parent (W bytes) | n_tokens, n_extra (int64) | tokens | extra``, where
    ``W`` is the digest width and ``parent`` the previous block's digest (or the seeded root)."""

    takes_encoded: ClassVar[bool] = True
    #: Digest width in bytes.
    width: ClassVar[int]

    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed)
        self._root = self._digest(b"hybridkv/block-hash-root/" + seed.to_bytes(8, "little"))

    @staticmethod
    @abstractmethod
    def _digest(data: bytes) -> bytes:
        """The digest of ``data`` (``width`` bytes)."""

    def hash_block(
        self, parent: BlockHash | None, tokens: Sequence[int], extra: tuple[int, ...]
    ) -> BlockHash:
        head = self._root if parent is None else parent.to_bytes(self.width, "big")
        data = head + array("q", (len(tokens), len(extra))).tobytes() + array("q", tokens).tobytes()
        if extra:
            data += array("q", extra).tobytes()
        return BlockHash(int.from_bytes(self._digest(data), "big"))

    def hash_blocks(
        self, parent: BlockHash | None, tokens: Sequence[int], block_size: int
    ) -> list[BlockHash]:
        # The same bytes as hash_block, encoded once: a 200k-token prompt hashes ~3x faster.
        n = len(tokens) // block_size
        if not n:
            return []
        whole = tokens[: n * block_size]
        if isinstance(whole, array) and whole.typecode == "q":
            data = whole.tobytes()  # already encoded (Request passes its checked array)
        else:
            data = array("q", whole).tobytes()
        header = array("q", (block_size, 0)).tobytes()
        step = 8 * block_size
        digest_of = self._digest
        digest = self._root if parent is None else parent.to_bytes(self.width, "big")
        digests = []
        for start in range(0, n * step, step):
            digest = digest_of(digest + header + data[start : start + step])
            digests.append(digest)
        return [BlockHash(int.from_bytes(d, "big")) for d in digests]


class Sha256Hasher(_DigestHasher):
    """SHA-256 over ``parent (32 bytes) | n_tokens, n_extra (int64) | tokens | extra``."""

    name: ClassVar[str] = "sha256"
    width: ClassVar[int] = 32

    @staticmethod
    def _digest(data: bytes) -> bytes:
        return hashlib.sha256(data).digest()


class Xxh3Hasher(_DigestHasher):
    """XXH3-128 over ``parent (16 bytes) | n_tokens, n_extra (int64) | tokens | extra``."""

    name: ClassVar[str] = "xxh3"
    width: ClassVar[int] = 16

    @staticmethod
    def _digest(data: bytes) -> bytes:
        return xxhash.xxh3_128_digest(data)


class BuiltinHasher(BlockHasher):
    """CPython tuple hash; fast, 64-bit, stable across processes of one CPython version.

    Not injective on integers, which the other hashers are: CPython hashes ints modulo
    2**61 - 1 and -1 like -2, so token ids from 2**61 - 1 up, and the multimodal keys of
    items starting one and two tokens into a block, collide by construction (found by
    review).  Use ``xxh3`` (the default) or ``sha256`` for such requests."""

    name: ClassVar[str] = "builtin"

    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed)
        # A str would be salted by PYTHONHASHSEED: derive the root from a digest instead.
        self._root = stable_code(f"hybridkv/block-hash-root/{seed}")

    def hash_block(
        self, parent: BlockHash | None, tokens: Sequence[int], extra: tuple[int, ...]
    ) -> BlockHash:
        base = self._root if parent is None else parent
        return BlockHash(hash((base, tuple(tokens), extra)) & _MASK64)

    def hash_blocks(
        self, parent: BlockHash | None, tokens: Sequence[int], block_size: int
    ) -> list[BlockHash]:
        base: int = self._root if parent is None else parent
        out: list[BlockHash] = []
        for start in range(0, len(tokens) // block_size * block_size, block_size):
            base = hash((base, tuple(tokens[start : start + block_size]), ())) & _MASK64
            out.append(BlockHash(base))
        return out


#: Hashers by name (``--hasher`` values).
HASHERS: dict[str, type[BlockHasher]] = {
    Xxh3Hasher.name: Xxh3Hasher,
    Sha256Hasher.name: Sha256Hasher,
    BuiltinHasher.name: BuiltinHasher,
}


def make_hasher(name: str = "xxh3", seed: int = 0) -> BlockHasher:
    """A hasher by name (``"xxh3"``, ``"sha256"`` or ``"builtin"``).

    Raises :class:`HasherError`."""
    cls = HASHERS.get(name)
    if cls is None:
        raise HasherError(f"hasher: unknown name {name!r}; valid: {', '.join(HASHERS)}")
    return cls(seed)
