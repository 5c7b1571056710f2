"""The slot format of a disk-cache file (:mod:`hybridkv.storage.disk_slots`): a 128-byte
header before each payload, slots aligned to 64 bytes.

The header names the entry (group, block hash, admission tag), its payload size, a store
counter (the eviction order a later process adopts), its state (empty or committed), the
payload's checksum (XXH3-64, ~13 GB/s on one core where zlib's CRC-32 does ~3) and its own
CRC-32, so a torn header never parses.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence

import xxhash

__all__ = [
    "COMMITTED",
    "EMPTY",
    "HEADER_BYTES",
    "HEADER_READ",
    "SLOT_ALIGN",
    "checksum",
    "pack_header",
    "parse_header",
    "payload_bytes",
    "slot_stride",
]

#: Bytes before each payload.
HEADER_BYTES = 128
#: Slots start at multiples of this.
SLOT_ALIGN = 64
_MAGIC = b"HKVSLOT1"
#: A slot's states: free (dropped, or a write that failed) and holding a whole entry.
EMPTY, COMMITTED = 0, 1
# magic, payload size, group, state, tag, stamp, payload checksum (XXH3-64), hash (33 bytes
# signed LE: a SHA-256 hash or a negative builtin one)
_HEAD = struct.Struct("<8sQIIqQQ33s")
_HCRC = struct.Struct("<I")
#: The bytes :func:`parse_header` needs.
HEADER_READ = _HEAD.size + _HCRC.size


def payload_bytes(data: memoryview | Sequence[memoryview]) -> int:
    """The bytes of a payload given whole or in pieces."""
    return data.nbytes if isinstance(data, memoryview) else sum(v.nbytes for v in data)


def slot_stride(size: int) -> int:
    """The file bytes a slot of a ``size``-byte payload takes (header, payload, alignment)."""
    return -(-(HEADER_BYTES + size) // SLOT_ALIGN) * SLOT_ALIGN


def pack_header(group: int, h: int, tag: int, size: int, stamp: int, crc: int, state: int) -> bytes:
    """The ``HEADER_BYTES`` of a slot (see the module doc)."""
    head = _HEAD.pack(
        _MAGIC, size, group, state, tag, stamp, crc, h.to_bytes(33, "little", signed=True)
    )
    whole = head + _HCRC.pack(zlib.crc32(head))
    return whole + bytes(HEADER_BYTES - len(whole))


def checksum(data: memoryview | Sequence[memoryview]) -> int:
    """The payload checksum a slot header carries (XXH3-64), of ``data`` or of the
    concatenation of its pieces (the same value: the hash is streamed over them)."""
    if isinstance(data, memoryview):
        return xxhash.xxh3_64_intdigest(data)
    state = xxhash.xxh3_64()
    for piece in data:
        state.update(piece)
    return state.intdigest()


def parse_header(raw: bytes) -> tuple[int, int, int, int, int, int, int] | None:
    """``(group, size, state, tag, stamp, hash, checksum)`` of a header that checks out
    (magic, state and its CRC), else None."""
    if len(raw) < HEADER_READ:
        return None
    head = raw[: _HEAD.size]
    (hcrc,) = _HCRC.unpack_from(raw, _HEAD.size)
    if zlib.crc32(head) != hcrc:
        return None
    magic, size, group, state, tag, stamp, crc, h = _HEAD.unpack(head)
    if magic != _MAGIC or state not in (EMPTY, COMMITTED):
        return None
    return group, size, state, tag, stamp, int.from_bytes(h, "little", signed=True), crc
