"""Mooncake traces may be gzip-compressed; unreadable input is a WorkloadError naming it."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from hybridkv.workloads import WorkloadError, load_mooncake_trace

LINES = [
    {"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [0, 1]},
    {"timestamp": 5, "input_length": 700, "output_length": 2, "hash_ids": [0, 2]},
]


def _write(path: Path, *, compress: bool) -> Path:
    text = "".join(json.dumps(line) + "\n" for line in LINES).encode()
    path.write_bytes(gzip.compress(text) if compress else text)
    return path


def test_gzipped_trace_equals_plain_trace(tmp_path: Path) -> None:
    plain = load_mooncake_trace(_write(tmp_path / "t.jsonl", compress=False))
    # the magic bytes decide, not the suffix
    packed = load_mooncake_trace(_write(tmp_path / "t.data", compress=True))
    assert packed.requests == plain.requests
    assert [r.prompt_len for r in packed] == [600, 700]
    assert packed.requests[0].prompt_token_ids[:512] == packed.requests[1].prompt_token_ids[:512]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (
            bytes(range(256)),
            r"bad\.bin:1: not UTF-8 text; a trace is JSON lines \(optionally gzip\)",
        ),
        (gzip.compress(b'{"timestamp": 0}\n')[:15], r"bad\.bin: cannot read the gzip stream"),
        (gzip.compress(bytes(range(128, 256))), r"bad\.bin:1: not UTF-8 text"),
    ],
    ids=["binary", "truncated-gzip", "gzip-of-binary"],
)
def test_unreadable_trace_is_a_workload_error(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "bad.bin"
    path.write_bytes(content)
    with pytest.raises(WorkloadError, match=message):
        load_mooncake_trace(path)


def test_directory_and_missing_file(tmp_path: Path) -> None:
    with pytest.raises(WorkloadError, match="is a directory; give a JSON-lines trace file"):
        load_mooncake_trace(tmp_path)
    with pytest.raises(WorkloadError, match="trace: no such file"):
        load_mooncake_trace(tmp_path / "missing.jsonl")
