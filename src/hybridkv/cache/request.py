"""A request as the cache manager sees it: token ids, extra keys and chained block hashes.

Hashes are kept at the layout's ``hash_block_size`` ``B`` (the gcd of the group block sizes):
``block_hashes[i]`` covers tokens ``[0, (i+1)*B)``.  A group whose block size is ``k*B`` names
its block ``j`` by ``block_hashes[(j+1)*k - 1]``, so coarse groups do not coarsen fine ones.
Appending tokens extends the hashes of every block the new tokens complete.

Extra keys enter each block's hash as integers (see :func:`block_extra_keys`):

* ``lora_id`` (LoRA adapter identity): every block;
* ``cache_salt``: the first block only (chaining carries it to every later block);
* ``mm_items``: every block that overlaps the item's placeholder tokens, with the block's
  start relative to the item's start, so equal tokens with different images never match.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from hybridkv.cache.errors import RequestLengthError
from hybridkv.cache.hashing import BlockHasher, Xxh3Hasher, stable_code
from hybridkv.cache.types import BlockHash
from hybridkv.errors import RequestError, brief_repr

__all__ = ["MultiModalItem", "Request", "block_extra_keys"]

_TAG_LORA = 1
_TAG_SALT = 2
_TAG_MM = 3


class MultiModalItem(NamedTuple):
    """A multimodal input occupying prompt tokens ``[offset, offset + length)``.

    ``identifier`` names the item's content (e.g. a hash of the image bytes).
    """

    identifier: str
    offset: int
    length: int


def block_extra_keys(
    index: int,
    block_size: int,
    *,
    lora_code: int | None,
    salt_code: int | None,
    mm: Sequence[tuple[int, int, int]],
) -> tuple[int, ...]:
    """Extra-key integers of hash block ``index`` (tokens ``[index*block_size, ...)``).

    ``mm`` holds ``(code, offset, length)`` per multimodal item.  Each key is tagged so the
    encoding is unambiguous.
    """
    start = index * block_size
    end = start + block_size
    out: list[int] = []
    if lora_code is not None:
        out += (_TAG_LORA, lora_code)
    if index == 0 and salt_code is not None:
        out += (_TAG_SALT, salt_code)
    for code, offset, length in mm:
        if offset < end and offset + length > start:
            out += (_TAG_MM, code, start - offset)
    return tuple(out)


#: Token ids lie in [0, 2**63): an int64 array holds them.
_INT64_END = 1 << 63

#: Where an int64's sign bit lies in its native encoding.
_SIGN_BYTE = 7 if sys.byteorder == "little" else 0


def _checked_array(ids: Iterable[int], field: str) -> array[int]:
    """``ids`` as an int64 array; raises :class:`RequestError` for a non-integer or negative."""
    try:
        arr = array("q", ids)
    except (TypeError, OverflowError) as exc:
        raise RequestError(f"{field}: token ids must be integers in [0, 2**63): {exc}") from None
    # A negative int64 has its top bit set: the last byte of its little-endian encoding is
    # >= 0x80 (one C pass over the bytes, 10x faster than min() on a 200k-token prompt).
    if not arr.tobytes()[_SIGN_BYTE::8].isascii():
        raise RequestError(f"{field}: token ids must be >= 0, got {min(arr)}")
    return arr


def _checked_tokens(ids: Iterable[int], field: str) -> list[int]:
    return _checked_array(ids, field).tolist()


def _check_extras(hasher: object, lora_id: object, cache_salt: object) -> None:
    """Raise :class:`RequestError` for a hasher, LoRA id or cache salt of another type (found
    by review: an object's repr, which differs between processes, keyed the hashes, and the
    salt 123 hashed as "123")."""
    if hasher is not None and not isinstance(hasher, BlockHasher):
        raise RequestError(
            f"Request.hasher: must be a BlockHasher (hybridkv.cache.make_hasher(name)) or None, "
            f"got {brief_repr(hasher)}"
        )
    if lora_id is not None and (isinstance(lora_id, bool) or not isinstance(lora_id, int | str)):
        raise RequestError(
            f"Request.lora_id: must be an int, a str or None, got {brief_repr(lora_id)}"
        )
    if cache_salt is not None and not isinstance(cache_salt, str):
        raise RequestError(
            f"Request.cache_salt: must be a str or None, got {brief_repr(cache_salt)}"
        )


def _mm_items(given: object, request_id: str) -> tuple[MultiModalItem, ...]:
    """``mm_items`` as :class:`MultiModalItem` tuples; raises :class:`RequestError` for one that
    is not ``(identifier: str, offset: int, length: int)``."""
    field = f"Request({request_id}).mm_items"
    if isinstance(given, (str, bytes)) or not isinstance(given, Iterable):
        raise RequestError(
            f"{field}: expected a sequence of MultiModalItem(identifier, offset, length), "
            f"got {brief_repr(given)}"
        )
    items: list[MultiModalItem] = []
    for i, item in enumerate(given):
        parts = tuple(item) if isinstance(item, Sequence) and not isinstance(item, str) else ()
        if not (
            len(parts) == 3
            and isinstance(parts[0], str)
            and all(isinstance(v, int) and not isinstance(v, bool) for v in parts[1:])
        ):
            raise RequestError(
                f"{field}: item {i} is {brief_repr(item)}; expected MultiModalItem(identifier: "
                "str, offset: int, length: int)"
            )
        items.append(MultiModalItem(*parts))
    return tuple(items)


class Request:
    """Token ids and block hashes of one request.

    ``num_computed_tokens`` is owned by the scheduler, as in vLLM: after a step that computed
    ``n`` tokens it adds ``n`` (the manager reads it, never writes it, except
    :meth:`KVCacheManager.preempt` which resets it to 0).  ``token_ids`` grows with
    :meth:`append_token_ids`; do not mutate the list it returns.  A prompt given as a list is
    copied as it is (its elements then stay the objects passed: ints, or integer-like objects
    such as numpy integers, which the check accepts); any other iterable becomes Python ints.

    Raises :class:`RequestError` for a bad id, tokens or multimodal item.
    """

    __slots__ = (
        "_extras",
        "_lora_code",
        "_mm",
        "_salt_code",
        "_tokens",
        "block_hashes",
        "cache_salt",
        "hash_block_size",
        "hasher",
        "is_finished",
        "lora_id",
        "mm_items",
        "num_computed_tokens",
        "num_prompt_tokens",
        "request_id",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Iterable[int],
        *,
        hash_block_size: int,
        hasher: BlockHasher | None = None,
        lora_id: int | str | None = None,
        cache_salt: str | None = None,
        mm_items: Sequence[MultiModalItem | tuple[str, int, int]] = (),
    ) -> None:
        if not isinstance(request_id, str) or not request_id:
            raise RequestError(f"Request.request_id: must be a non-empty str, got {request_id!r}")
        size_ok = isinstance(hash_block_size, int) and not isinstance(hash_block_size, bool)
        if not size_ok or hash_block_size <= 0:
            raise RequestError(
                f"Request.hash_block_size: must be a positive integer, got {hash_block_size!r}"
            )
        _check_extras(hasher, lora_id, cache_salt)
        checked = _checked_array(prompt_token_ids, f"Request({request_id}).prompt_token_ids")
        # A list that passed the check holds integers only: copied as it is (5x faster than
        # converting the array back).
        tokens = prompt_token_ids.copy() if type(prompt_token_ids) is list else checked.tolist()
        if not tokens:
            raise RequestLengthError(f"Request({request_id}).prompt_token_ids: must not be empty")
        self.request_id = request_id
        self.hash_block_size = hash_block_size
        self.hasher: BlockHasher = Xxh3Hasher() if hasher is None else hasher
        self.lora_id = lora_id
        self.cache_salt = cache_salt
        self._lora_code = None if lora_id is None else stable_code(f"lora:{lora_id!r}")
        self._salt_code = None if cache_salt is None else stable_code(f"salt:{cache_salt}")
        mm: list[tuple[int, int, int]] = []
        items = _mm_items(mm_items, request_id)
        for item in items:
            offset, length = item.offset, item.length
            if offset < 0 or length <= 0 or offset + length > len(tokens):
                raise RequestLengthError(
                    f"Request({request_id}).mm_items: item {item.identifier!r} spans "
                    f"[{offset}, {offset + length}) but the prompt has {len(tokens)} tokens; "
                    "items must lie inside the prompt with length > 0"
                )
            mm.append((stable_code(f"mm:{item.identifier}"), offset, length))
        self.mm_items = items
        self._mm = tuple(mm)
        self._extras = self._lora_code is not None or self._salt_code is not None or bool(mm)
        self._tokens = tokens
        self.num_prompt_tokens = len(tokens)
        self.num_computed_tokens = 0
        self.is_finished = False
        self.block_hashes: list[BlockHash] = []
        self._extend_hashes(checked)

    @property
    def token_ids(self) -> list[int]:
        """All token ids (prompt then outputs).  Read-only by contract."""
        return self._tokens

    @property
    def num_tokens(self) -> int:
        return len(self._tokens)

    def append_token_ids(self, token_ids: Iterable[int]) -> None:
        """Append output tokens and hash every block they complete.  Raises RequestError."""
        if (type(token_ids) is tuple or type(token_ids) is list) and len(token_ids) == 1:
            t = token_ids[0]  # a decode step's token: no array, no call below
            if type(t) is int and 0 <= t < _INT64_END:
                tokens = self._tokens
                tokens.append(t)
                if self._extras or (
                    (len(self.block_hashes) + 1) * self.hash_block_size <= len(tokens)
                ):
                    self._extend_hashes()
                return
        new = _checked_tokens(token_ids, f"Request({self.request_id}).append_token_ids")
        self._tokens.extend(new)
        self._extend_hashes()

    def _extend_hashes(self, encoded: array[int] | None = None) -> None:
        """Hash every block the tokens complete.  ``encoded``: the tokens as an int64 array,
        when the caller has it (the hasher then skips encoding them again)."""
        size = self.hash_block_size
        takes = encoded is not None and self.hasher.takes_encoded
        tokens: Sequence[int] = encoded if takes and encoded is not None else self._tokens
        hashes = self.block_hashes
        hasher = self.hasher
        i = len(hashes)
        parent = hashes[-1] if hashes else None
        if not self._extras:
            if (i + 1) * size <= len(tokens):
                hashes.extend(hasher.hash_blocks(parent, tokens[i * size :], size))
            return
        while (i + 1) * size <= len(tokens):
            extra = block_extra_keys(
                i, size, lora_code=self._lora_code, salt_code=self._salt_code, mm=self._mm
            )
            parent = hasher.hash_block(parent, tokens[i * size : (i + 1) * size], extra)
            hashes.append(parent)
            i += 1

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, num_tokens={self.num_tokens}, "
            f"num_computed_tokens={self.num_computed_tokens})"
        )
