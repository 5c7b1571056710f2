from __future__ import annotations

import json
from itertools import pairwise
from pathlib import Path

import pytest

from hybridkv.workloads import (
    SYNTHETIC_WORKLOADS,
    SyntheticOptions,
    WorkloadError,
    WorkloadRequest,
    load_mooncake_trace,
    load_workload,
    synthetic_workload,
)
from hybridkv.workloads.mooncake import TOKEN_BASE

TRACE = (
    Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
)


def _write(tmp_path: Path, lines: list[str]) -> Path:
    p = tmp_path / "trace.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return p


def test_mooncake_tokens_follow_hash_ids(tmp_path: Path) -> None:
    lines = [
        json.dumps({"timestamp": 5, "input_length": 700, "output_length": 3, "hash_ids": [0, 1]}),
        json.dumps({"timestamp": 0, "input_length": 600, "output_length": 2, "hash_ids": [0, 2]}),
    ]
    w = load_mooncake_trace(_write(tmp_path, lines))
    first, second = w.requests  # sorted by arrival: the timestamp-0 line comes first
    assert first.arrival_ms == 0 and second.arrival_ms == 5
    assert first.prompt_len == 600 and second.prompt_len == 700
    # both share block 0 (512 tokens), then diverge
    assert first.prompt_token_ids[:512] == second.prompt_token_ids[:512]
    assert first.prompt_token_ids[:512] == tuple(range(TOKEN_BASE, TOKEN_BASE + 512))
    assert first.prompt_token_ids[512] != second.prompt_token_ids[512]
    assert second.prompt_token_ids[512] == TOKEN_BASE + 1 * 512
    assert first.output_len == 2 and second.output_len == 3
    assert not set(first.output_token_ids) & set(second.output_token_ids)
    # the trace tells shared prefixes at its hash blocks, and a cut keeps that
    assert w.source_block == w.head(1).source_block == 512
    assert load_mooncake_trace(_write(tmp_path, lines), source_block=1024).source_block == 1024
    assert synthetic_workload("chat", SyntheticOptions(num_requests=2)).source_block == 1


def test_mooncake_arrivals_count_from_the_earliest_request(tmp_path: Path) -> None:
    # found by review: epoch-millisecond timestamps put the whole offset into the simulated
    # clock (tok/s 769 -> 2e-05 for the same requests)
    base = 1_700_000_000_000
    lines = [
        json.dumps({"timestamp": base + t, "input_length": 10, "output_length": 1, "hash_ids": [t]})
        for t in (30, 0, 12)
    ]
    w = load_mooncake_trace(_write(tmp_path, lines))
    assert [r.arrival_ms for r in w.requests] == [0, 12, 30]


def test_mooncake_does_not_read_past_the_limit(tmp_path: Path) -> None:
    # found by review: the line after the limit was decoded, so bytes that are not UTF-8
    # there failed a run that never uses them
    good = json.dumps({"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [0]})
    p = tmp_path / "trace.jsonl"
    p.write_bytes((good + "\n").encode() * 2 + b"\xff\xfe not utf-8\n")
    assert len(load_mooncake_trace(p, limit=2).requests) == 2
    with pytest.raises(WorkloadError, match=":3:"):
        load_mooncake_trace(p, limit=3)


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        ("{not json", ":2: not valid JSON"),
        ("[" * 100_000 + "]" * 100_000, ":2: JSON nested too deeply to read"),
        ('{"timestamp": 0, "input_length": ' + "7" * 5000 + "}", ":2: not a usable JSON line"),
        ('{"timestamp": 0, "output_length": 1, "hash_ids": [0]}', "missing field 'input_length'"),
        ('{"timestamp": -1, "input_length": 5, "output_length": 1, "hash_ids": [0]}', "timestamp"),
        (
            '{"timestamp": 0, "input_length": 5, "output_length": "x", "hash_ids": [0]}',
            "output_length",
        ),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": "a"}', "hash_ids"),
        ('{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [0]}', "too few"),
    ],
)
def test_mooncake_errors_name_line_and_field(tmp_path: Path, line: str, needle: str) -> None:
    good = json.dumps({"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [0]})
    with pytest.raises(WorkloadError) as info:
        load_mooncake_trace(_write(tmp_path, [good, line]))
    assert needle in str(info.value)
    assert ":2:" in str(info.value)


def test_mooncake_missing_file(tmp_path: Path) -> None:
    with pytest.raises(WorkloadError, match="no such file"):
        load_mooncake_trace(tmp_path / "absent.jsonl")


@pytest.mark.skipif(not TRACE.is_file(), reason="shared Mooncake trace not present")
def test_real_trace_head() -> None:
    w = load_mooncake_trace(TRACE, limit=50)
    assert len(w) == 50
    assert all(r.prompt_len > 0 and r.output_len > 0 for r in w)


@pytest.mark.parametrize("name", sorted(SYNTHETIC_WORKLOADS))
def test_synthetic_is_deterministic(name: str) -> None:
    opts = SyntheticOptions(num_requests=60, seed=3)
    a = synthetic_workload(name, opts)
    b = synthetic_workload(name, opts)
    c = synthetic_workload(name, SyntheticOptions(num_requests=60, seed=4))
    assert a == b
    assert a != c
    assert len(a) == 60
    arrivals = [r.arrival_ms for r in a]
    assert arrivals == sorted(arrivals)


def test_chat_turns_resend_history() -> None:
    w = synthetic_workload("chat", SyntheticOptions(num_requests=80, seed=1))
    by_session: dict[str | None, list[WorkloadRequest]] = {}
    for r in w:
        by_session.setdefault(r.session_id, []).append(r)
    multi = [turns for turns in by_session.values() if len(turns) > 1]
    assert multi, "expected multi-turn sessions"
    for turns in multi:
        for prev, nxt in pairwise(turns):
            history = prev.prompt_token_ids + prev.output_token_ids
            assert nxt.prompt_token_ids[: len(history)] == history


def test_unknown_synthetic_name() -> None:
    with pytest.raises(WorkloadError, match="unknown synthetic workload 'nope'; valid: agent"):
        load_workload("synthetic:nope")


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_mixed_holds_as_many_requests_as_asked(n: int) -> None:
    # found by review: mixed gave chat and agent one request each below three (1 -> 2)
    assert len(load_workload("synthetic:mixed", num_requests=n).requests) == n
