"""Chained block hashes and the Request object: reproducibility, extra keys, incremental growth."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as hst

from hybridkv.cache import (
    BuiltinHasher,
    HasherError,
    MultiModalItem,
    Request,
    Sha256Hasher,
    Xxh3Hasher,
    make_hasher,
)
from hybridkv.cache.errors import RequestLengthError
from hybridkv.cache.hashing import BlockHasher
from hybridkv.cache.request import block_extra_keys
from hybridkv.cache.types import BlockHash
from hybridkv.errors import RequestError

_SNIPPET = (
    "from hybridkv.cache import Request, make_hasher;"
    "r = Request('x', list(range(40)), hash_block_size=8, hasher=make_hasher('{name}'),"
    " lora_id='a', cache_salt='s', mm_items=[('img', 3, 9)]);"
    "print(r.block_hashes)"
)


@pytest.mark.parametrize("name", ["xxh3", "sha256", "builtin"])
def test_hashes_are_identical_across_processes(name: str) -> None:
    outs = set()
    for seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        proc = subprocess.run(
            [sys.executable, "-c", _SNIPPET.format(name=name)],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        outs.add(proc.stdout)
    here = Request(
        "x",
        range(40),
        hash_block_size=8,
        hasher=make_hasher(name),
        lora_id="a",
        cache_salt="s",
        mm_items=[MultiModalItem("img", 3, 9)],
    )
    assert outs == {f"{here.block_hashes}\n"}


@pytest.mark.parametrize(
    ("cls", "first", "second"),
    [
        (
            Xxh3Hasher,
            0xD808CA60737294A75265D86078BD9498,
            0x291D5F432DA1C027E339F3032BD288B9,
        ),
        (
            Sha256Hasher,
            0x721807070428F710BD7394DD8E1CDE4A232A6C4A44289806296D50615F674D53,
            0x9B253413BAC1605CAC566C16A5C12D211E876E72E8176BF317A778C941EC5D95,
        ),
    ],
)
def test_digest_hashers_are_pinned(cls: type[BlockHasher], first: int, second: int) -> None:
    # The values a disk cache written by an earlier release was keyed with: any change to the
    # encoding must change the disk fingerprint too.
    h = cls()
    assert h.hash_block(None, [1, 2, 3, 4], ()) == first
    assert h.hash_block(BlockHash(first), [5, 6, 7, 8], (1, 9)) == second
    assert h.hash_blocks(None, [1, 2, 3, 4, 5], 4) == [first]


def test_default_hasher_is_xxh3() -> None:
    assert make_hasher() == Xxh3Hasher(0)
    assert isinstance(Request("d", range(8), hash_block_size=4).hasher, Xxh3Hasher)
    assert Xxh3Hasher().hash_block(None, [1], ()).bit_length() <= 128


def test_sha256_known_value_and_chaining() -> None:
    h = Sha256Hasher()
    first = h.hash_block(None, [1, 2, 3, 4], ())
    assert first == h.hash_block(None, (1, 2, 3, 4), ())
    assert first.bit_length() <= 256
    assert h.hash_block(first, [5, 6, 7, 8], ()) != h.hash_block(None, [5, 6, 7, 8], ())
    assert Sha256Hasher(seed=1).hash_block(None, [1, 2, 3, 4], ()) != first
    assert h.hash_block(None, [1, 2, 3, 4], (1, 9)) != first
    assert BuiltinHasher().hash_block(None, [1, 2, 3, 4], ()) < 2**64


def test_make_hasher_rejects_unknown_names_and_seeds() -> None:
    with pytest.raises(HasherError, match="valid: xxh3, sha256, builtin"):
        make_hasher("md5")
    with pytest.raises(HasherError, match="seed"):
        Sha256Hasher(seed=-1)
    assert make_hasher("builtin", 3) == BuiltinHasher(3) != BuiltinHasher(4)
    assert Sha256Hasher(3) != BuiltinHasher(3)


def test_request_hashes_full_blocks_only_and_extends_incrementally() -> None:
    r = Request("a", range(10), hash_block_size=4)
    assert len(r.block_hashes) == 2 and r.num_tokens == 10 and r.num_prompt_tokens == 10
    r.append_token_ids([10, 11])
    assert len(r.block_hashes) == 3
    whole = Request("b", range(12), hash_block_size=4)
    assert r.block_hashes == whole.block_hashes
    assert r.token_ids == list(range(12))


@given(
    tokens=hst.lists(hst.integers(0, 50), min_size=1, max_size=40),
    cuts=hst.lists(hst.integers(1, 7), max_size=8),
    block=hst.sampled_from([1, 2, 4, 8]),
)
def test_incremental_hashing_equals_batch(tokens: list[int], cuts: list[int], block: int) -> None:
    grown = Request("g", tokens[:1], hash_block_size=block, hasher=BuiltinHasher())
    pos = 1
    for c in cuts:
        grown.append_token_ids(tokens[pos : pos + c])
        pos += c
    grown.append_token_ids(tokens[pos:])
    batch = Request("b", tokens, hash_block_size=block, hasher=BuiltinHasher())
    assert grown.block_hashes == batch.block_hashes
    assert len(batch.block_hashes) == len(tokens) // block


def test_extra_keys_salt_first_block_lora_every_block_mm_overlapping() -> None:
    keys = [block_extra_keys(i, 4, lora_code=5, salt_code=9, mm=[(77, 6, 3)]) for i in range(4)]
    assert keys[0] == (1, 5, 2, 9)  # LoRA, salt
    assert keys[1] == (1, 5, 3, 77, -2)  # item [6, 9) overlaps block [4, 8): block starts 2 early
    assert keys[2] == (1, 5, 3, 77, 2)  # block [8, 12) starts 2 tokens into the item
    assert keys[3] == (1, 5)


def test_salt_lora_and_images_change_hashes_from_where_they_apply() -> None:
    plain = Request("p", range(16), hash_block_size=4).block_hashes
    salted = Request("s", range(16), hash_block_size=4, cache_salt="x").block_hashes
    assert all(a != b for a, b in zip(plain, salted, strict=True))  # chained from block 0
    image = Request("i", range(16), hash_block_size=4, mm_items=[MultiModalItem("cat", 9, 2)])
    other = Request("j", range(16), hash_block_size=4, mm_items=[MultiModalItem("dog", 9, 2)])
    assert image.block_hashes[:2] == plain[:2] == other.block_hashes[:2]
    assert image.block_hashes[2] != other.block_hashes[2] != plain[2]
    lora = Request("l", range(16), hash_block_size=4, lora_id=3).block_hashes
    assert (
        lora[0] != plain[0]
        and lora != Request("m", range(16), hash_block_size=4, lora_id="3").block_hashes
    )


def test_request_validation() -> None:
    with pytest.raises(RequestError, match="request_id"):
        Request("", [1], hash_block_size=4)
    with pytest.raises(RequestLengthError, match="must not be empty"):
        Request("a", [], hash_block_size=4)
    with pytest.raises(RequestError, match=">= 0, got -3"):
        Request("a", [1, -3], hash_block_size=4)
    with pytest.raises(RequestError, match="integers"):
        Request("a", [1, 2.5], hash_block_size=4)  # type: ignore[list-item]
    with pytest.raises(RequestError, match="hash_block_size"):
        Request("a", [1], hash_block_size=0)
    with pytest.raises(RequestLengthError, match=r"spans \[2, 12\) but the prompt has 4"):
        Request("a", [1, 2, 3, 4], hash_block_size=4, mm_items=[MultiModalItem("x", 2, 10)])
    r = Request("a", [1, 2], hash_block_size=4)
    with pytest.raises(RequestError):
        r.append_token_ids([2**63])
    assert r.token_ids == [1, 2]


@pytest.mark.parametrize("name", ["xxh3", "sha256", "builtin"])
@given(
    tokens=hst.lists(hst.integers(0, 2**63 - 1), max_size=120),
    block=hst.integers(1, 9),
    chained=hst.booleans(),
)
def test_batch_hashing_equals_block_by_block(
    name: str, tokens: list[int], block: int, chained: bool
) -> None:
    from array import array

    hasher = make_hasher(name, seed=3)
    parent = hasher.hash_block(None, [1, 2, 3], ()) if chained else None
    expected = []
    p = parent
    for i in range(len(tokens) // block):
        p = hasher.hash_block(p, tokens[i * block : (i + 1) * block], ())
        expected.append(p)
    assert hasher.hash_blocks(parent, tokens, block) == expected
    assert hasher.hash_blocks(parent, array("q", tokens), block) == expected
    # the generic (base class) batch path agrees too
    assert BlockHasher.hash_blocks(hasher, parent, tokens, block) == expected


@pytest.mark.parametrize("salt", [None, "s"])
def test_one_token_appends_hash_as_one_append_of_them_all(salt: str | None) -> None:
    tokens = list(range(3, 40))
    whole = Request("w", tokens, hash_block_size=4, cache_salt=salt)
    grown = Request("g", tokens[:5], hash_block_size=4, cache_salt=salt)
    for i, t in enumerate(tokens[5:]):
        grown.append_token_ids((t,) if i % 2 else [t])
    assert grown.token_ids == whole.token_ids
    assert grown.block_hashes == whole.block_hashes and len(grown.block_hashes) == 9


@pytest.mark.parametrize("bad", [-1, 2**63, 2.0, "7"])
def test_a_bad_single_token_is_refused_changing_nothing(bad: object) -> None:
    r = Request("a", [1, 2, 3], hash_block_size=4)
    with pytest.raises(RequestError, match="append_token_ids"):
        r.append_token_ids([bad])  # type: ignore[list-item]
    assert (r.token_ids, r.block_hashes) == ([1, 2, 3], [])
    r.append_token_ids([True])  # an int subclass goes the general way: stored as 1
    assert r.token_ids == [1, 2, 3, 1] and len(r.block_hashes) == 1
