"""Trace files that are not Mooncake JSON lines: one-line WorkloadErrors with exact messages.

Every message names the file (and the line, where one is at fault) and what is expected; no
UnicodeDecodeError, IsADirectoryError, zlib.error or JSONDecodeError escapes.
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import pytest

from hybridkv.cli.main import main
from hybridkv.workloads import WorkloadError, load_mooncake_trace, load_workload

FORMAT = (
    "a trace is JSON lines (optionally gzip), one object per line with timestamp, "
    "input_length, output_length and hash_ids"
)
GOOD = json.dumps({"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [0]})


def _line(**fields: object) -> bytes:
    obj: dict[str, object] = {
        "timestamp": 0,
        "input_length": 5,
        "output_length": 1,
        "hash_ids": [0],
    }
    obj.update(fields)
    return json.dumps({k: v for k, v in obj.items() if v is not ...}).encode()


def _corrupt_gzip() -> bytes:
    data = bytearray(gzip.compress(((GOOD + "\n") * 2000).encode()))
    for i in range(20, 60):  # inside the deflate stream: zlib.error, not an OSError
        data[i] ^= 0x55
    return bytes(data)


CASES = [
    ("empty", b"", "trace: '{p}' holds no request; " + FORMAT),
    ("blank-lines", b"\n  \n\n", "trace: '{p}' holds no request; " + FORMAT),
    ("gzip-of-nothing", gzip.compress(b""), "trace: '{p}' holds no request; " + FORMAT),
    (
        "json-array",
        f"[{GOOD}]\n".encode(),
        "{p}:1: expected a JSON object, got a list; " + FORMAT,
    ),
    (
        "pretty-printed-json",
        json.dumps(json.loads(GOOD), indent=2).encode(),
        "{p}:1: not valid JSON (Expecting property name enclosed in double quotes); " + FORMAT,
    ),
    ("csv", b"timestamp,input_length\n0,5\n", "{p}:1: not valid JSON (Expecting value); " + FORMAT),
    ("json-string", b'"hello"\n', "{p}:1: expected a JSON object, got a string; " + FORMAT),
    ("json-null", b"null\n", "{p}:1: expected a JSON object, got null; " + FORMAT),
    (
        "latin-1-on-line-3",
        f"{GOOD}\n{GOOD}\n".encode() + '{"x": "caf\xe9"}\n'.encode("latin-1"),
        "{p}:3: not UTF-8 text; a trace is JSON lines (optionally gzip)",
    ),
    (
        "nul-byte-on-line-2",
        f"{GOOD}\n".encode() + b'{"x": "\x00"}\n',
        "{p}:2: not UTF-8 text; a trace is JSON lines (optionally gzip)",
    ),
    (
        "corrupt-gzip",
        _corrupt_gzip(),
        "{p}: cannot read the gzip stream: Error -3 while decompressing data: "
        "invalid bit length repeat",
    ),
    (
        "missing-timestamp",
        _line(timestamp=...),
        "{p}:1: missing field 'timestamp'; " + FORMAT,
    ),
    (
        "missing-hash-ids",
        _line(hash_ids=...),
        "{p}:1: missing field 'hash_ids'; " + FORMAT,
    ),
    (
        "nan-timestamp",
        b'{"timestamp": NaN, "input_length": 5, "output_length": 1, "hash_ids": [0]}',
        "{p}:1: field 'timestamp' must be a non-negative number of ms, got nan",
    ),
    (
        "bool-length",
        _line(input_length=True),
        "{p}:1: field 'input_length' must be a positive integer, got True",
    ),
    (
        "zero-input",
        _line(input_length=0),
        "{p}:1: field 'input_length' must be a positive integer, got 0",
    ),
    (
        "huge-output",
        _line(output_length=1 << 21),
        "{p}:1: field 'output_length' must be below 1048576, got 2097152",
    ),
    (
        "long-bad-hash-ids",
        _line(hash_ids=["x"] * 50),
        "{p}:1: field 'hash_ids' must be a list of non-negative integers, got "
        "['x', 'x', 'x', 'x', 'x', 'x', 'x', 'x', 'x', 'x', 'x', '...",
    ),
]


@pytest.mark.parametrize(("content", "message"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_trace_exact_message(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_bytes(content)
    with pytest.raises(WorkloadError) as info:
        load_mooncake_trace(path)
    assert str(info.value) == message.format(p=path)
    assert "\n" not in str(info.value)


def test_directory_missing_and_unreadable_exact(tmp_path: Path) -> None:
    with pytest.raises(WorkloadError) as info:
        load_mooncake_trace(tmp_path)
    assert str(info.value) == f"trace: '{tmp_path}' is a directory; give a JSON-lines trace file"
    missing = tmp_path / "missing.jsonl"
    with pytest.raises(WorkloadError) as info:
        load_mooncake_trace(missing)
    assert str(info.value) == f"trace: no such file '{missing}'"


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX permissions")
def test_unreadable_file(tmp_path: Path) -> None:
    path = tmp_path / "locked.jsonl"
    path.write_text(GOOD + "\n")
    path.chmod(0)
    try:
        try:
            with path.open("rb"):
                readable = True  # root ignores file permissions: nothing to test
        except PermissionError:
            readable = False
        if readable:
            pytest.skip("running as a user that ignores file permissions")
        with pytest.raises(WorkloadError) as info:
            load_mooncake_trace(path)
        assert str(info.value) == f"trace: cannot read '{path}': Permission denied"
    finally:
        path.chmod(0o644)


def test_utf8_bom_and_crlf_are_accepted(tmp_path: Path) -> None:
    path = tmp_path / "windows.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + GOOD.encode() + b"\r\n" + GOOD.encode() + b"\r\n")
    assert len(load_mooncake_trace(path)) == 2


def test_gzip_named_by_suffix_only_is_read_by_magic(tmp_path: Path) -> None:
    plain = tmp_path / "plain.gz"  # a .gz name with plain text inside
    plain.write_text(GOOD + "\n")
    packed = tmp_path / "packed.jsonl.gz"
    packed.write_bytes(gzip.compress((GOOD + "\n").encode()))
    assert load_mooncake_trace(plain).requests == load_mooncake_trace(packed).requests


def test_max_prompt_tokens_skips_and_counts(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    lines = [_line(input_length=n, hash_ids=[0, 1]) for n in (600, 5, 900, 7)]
    path.write_bytes(b"\n".join(lines) + b"\n")
    w = load_mooncake_trace(path, max_prompt_tokens=512, limit=2)
    assert [r.prompt_len for r in w] == [5, 7]
    assert [r.request_id for r in w] == ["trace-0", "trace-1"]
    assert w.skipped == 2
    with pytest.raises(WorkloadError) as info:
        load_mooncake_trace(path, max_prompt_tokens=4)
    assert str(info.value) == (
        f"trace: '{path}' holds no request with input_length <= max_prompt_tokens=4 "
        "(4 longer skipped); raise max_prompt_tokens"
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"limit": 0}, "trace: limit must be >= 1 (or None), got 0"),
        ({"max_prompt_tokens": 0}, "trace: max_prompt_tokens must be >= 1 (or None), got 0"),
        ({"source_block": 0}, "trace: source_block must be >= 1 tokens, got 0"),
    ],
)
def test_bad_arguments(tmp_path: Path, kwargs: dict[str, int], message: str) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(GOOD + "\n")
    with pytest.raises(WorkloadError) as info:
        load_mooncake_trace(path, **kwargs)  # type: ignore[arg-type]
    assert str(info.value) == message


def test_load_workload_passes_errors_through(tmp_path: Path) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_bytes(b"")
    with pytest.raises(WorkloadError, match="holds no request"):
        load_workload(str(path), num_requests=3)


def test_simulate_cli_prints_one_line_and_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "binary.bin"
    path.write_bytes(bytes(range(256)))
    assert main(["simulate", "--trace", str(path)]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"hybridkv simulate: error: {path}:1: not UTF-8 text; a trace is JSON lines "
        "(optionally gzip)\n"
    )
