"""Loader for Mooncake-format request traces (JSON lines, optionally gzip-compressed).

Each line: ``{"timestamp": ms, "input_length": int, "output_length": int, "hash_ids": [int]}``.
``hash_ids`` name prefix blocks of ``source_block`` tokens (512 in the published traces): two
requests agreeing on their first ``k`` ids share their first ``k * 512`` prompt tokens.  Block
``h`` becomes the tokens ``TOKEN_BASE + h * source_block + i``; the last block is cut to
``input_length``.  Output tokens are unique per request, so outputs never produce false hits.

Every problem with the input — a missing file, a directory, binary or non-UTF-8 data, a broken
gzip stream, a line that is not a JSON object with those four fields, a file with no request —
is a one-line :class:`WorkloadError` naming the file (and the line) and what is expected.
Standard library only.
"""

from __future__ import annotations

import codecs
import dataclasses
import gzip
import io
import json
import os
import zlib
from collections.abc import Iterator
from pathlib import Path

from hybridkv.errors import brief_repr
from hybridkv.workloads.types import Workload, WorkloadError, WorkloadRequest, sorted_by_arrival

__all__ = ["TOKEN_BASE", "load_mooncake_trace", "trace_path"]

#: Token ids below this are left free (special tokens of real vocabularies).
TOKEN_BASE = 1000
_OUTPUT_BASE = 1 << 40
_OUTPUT_STRIDE = 1 << 20  # output ids of request i: _OUTPUT_BASE + i * _OUTPUT_STRIDE + j
_GZIP_MAGIC = b"\x1f\x8b"
#: Longest line read (bytes): a real trace line is a few KiB; anything longer is not a trace.
_MAX_LINE = 16 << 20
_FORMAT = (
    "a trace is JSON lines (optionally gzip), one object per line with timestamp, "
    "input_length, output_length and hash_ids"
)


def _open_binary(p: Path) -> tuple[io.BufferedIOBase, bool]:
    """``p`` opened for reading bytes, through gzip when it starts with gzip's magic bytes;
    also returns whether it is gzip."""
    if p.is_dir():
        raise WorkloadError(f"trace: {str(p)!r} is a directory; give a JSON-lines trace file")
    try:
        with p.open("rb") as raw:
            magic = raw.read(2)
        if magic == _GZIP_MAGIC:
            return gzip.open(p, "rb"), True
        return p.open("rb"), False
    except FileNotFoundError:
        raise WorkloadError(f"trace: no such file {str(p)!r}") from None
    except OSError as exc:
        raise WorkloadError(f"trace: cannot read {str(p)!r}: {exc.strerror or exc}") from None


def _lines(fh: io.BufferedIOBase, p: Path, gz: bool) -> Iterator[tuple[int, str]]:
    """Numbered text lines of ``fh``, each decoded on its own so that an error names the exact
    line: undecodable bytes or NUL bytes (binary data), an overlong line and a broken gzip
    stream become WorkloadErrors."""
    lineno = 0
    while True:
        try:
            raw = fh.readline(_MAX_LINE)
        except (OSError, EOFError, zlib.error) as exc:  # gzip.BadGzipFile is an OSError
            what = "the gzip stream" if gz else "the file"
            raise WorkloadError(f"{p}: cannot read {what}: {exc}") from None
        if not raw:
            return
        lineno += 1
        if lineno == 1 and raw.startswith(codecs.BOM_UTF8):
            raw = raw[len(codecs.BOM_UTF8) :]
        try:
            if b"\0" in raw:
                raise UnicodeError("NUL byte")
            line = raw.decode("utf-8")
        except UnicodeError:
            raise WorkloadError(
                f"{p}:{lineno}: not UTF-8 text; a trace is JSON lines (optionally gzip)"
            ) from None
        if len(raw) >= _MAX_LINE and not raw.endswith(b"\n"):
            raise WorkloadError(f"{p}:{lineno}: line longer than {_MAX_LINE} bytes; {_FORMAT}")
        yield lineno, line


def _count(obj: dict[str, object], name: str, where: str, least: int) -> int:
    if name not in obj:
        raise WorkloadError(f"{where}: missing field {name!r}; {_FORMAT}")
    value = obj[name]
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        what = "a positive integer" if least == 1 else "a non-negative integer"
        raise WorkloadError(f"{where}: field {name!r} must be {what}, got {value!r}")
    return value


def _parse(line: str, where: str, source_block: int) -> tuple[float, int, int, list[int]]:
    """One trace line as (timestamp, input_length, output_length, hash_ids), validated."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise WorkloadError(f"{where}: not valid JSON ({exc.msg}); {_FORMAT}") from None
    except ValueError as exc:  # an integer of more digits than Python converts
        raise WorkloadError(f"{where}: not a usable JSON line ({exc}); {_FORMAT}") from None
    except RecursionError:
        raise WorkloadError(f"{where}: JSON nested too deeply to read; {_FORMAT}") from None
    if not isinstance(obj, dict):
        raise WorkloadError(f"{where}: expected a JSON object, got {_json_type(obj)}; {_FORMAT}")
    if "timestamp" not in obj:
        raise WorkloadError(f"{where}: missing field 'timestamp'; {_FORMAT}")
    ts = obj["timestamp"]
    if not isinstance(ts, int | float) or isinstance(ts, bool) or not 0 <= ts < float("inf"):
        raise WorkloadError(
            f"{where}: field 'timestamp' must be a non-negative number of ms, got {ts!r}"
        )
    n_in = _count(obj, "input_length", where, 1)
    n_out = _count(obj, "output_length", where, 0)
    if "hash_ids" not in obj:
        raise WorkloadError(f"{where}: missing field 'hash_ids'; {_FORMAT}")
    hash_ids = obj["hash_ids"]
    if not isinstance(hash_ids, list) or not all(
        isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in hash_ids
    ):
        raise WorkloadError(
            f"{where}: field 'hash_ids' must be a list of non-negative integers, got "
            f"{_short(hash_ids)}"
        )
    if n_out >= _OUTPUT_STRIDE:
        raise WorkloadError(
            f"{where}: field 'output_length' must be below {_OUTPUT_STRIDE}, got {n_out}"
        )
    if len(hash_ids) * source_block < n_in:
        raise WorkloadError(
            f"{where}: field 'hash_ids' has {len(hash_ids)} blocks of "
            f"{source_block}, too few for input_length {n_in}"
        )
    return float(ts), n_in, n_out, hash_ids


def _json_type(value: object) -> str:
    names = {list: "a list", str: "a string", bool: "a boolean", type(None): "null"}
    return names.get(type(value), "a number")


def _short(value: object, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def trace_path(path: object) -> Path:
    """``path`` (a ``str`` or :class:`os.PathLike` naming a trace file) as a :class:`Path`;
    raises :class:`WorkloadError` for anything else."""
    text = os.fspath(path) if isinstance(path, os.PathLike) else path
    if not isinstance(text, str):
        raise WorkloadError(
            f"trace: expected a path to a Mooncake-format trace file (a str or os.PathLike), "
            f"got {brief_repr(path)}"
        )
    return Path(text)


def load_mooncake_trace(
    path: str | os.PathLike[str],
    *,
    limit: int | None = None,
    source_block: int = 512,
    max_prompt_tokens: int | None = None,
) -> Workload:
    """Read a Mooncake trace into a :class:`Workload` of at most ``limit`` requests, ids
    ``trace-0``, ``trace-1``, ... in file order.

    Arrival times are counted from the earliest kept request's timestamp, so a trace of
    absolute (epoch) timestamps replays as one of offsets from 0 would.
    Lines whose ``input_length`` exceeds ``max_prompt_tokens`` are validated but skipped: they
    do not count toward ``limit`` and are counted in :attr:`Workload.skipped`.  Reading stops
    once ``limit`` requests are kept.  An ``output_length`` of 0 (a prefill-only request) is
    read as one output token: the prefill samples it.  The file may be gzip-compressed
    (recognised by its magic bytes, whatever its name).  Raises :class:`WorkloadError` (one
    line, naming the file, the line and the field) for a missing file, a directory, binary or
    non-UTF-8 data, a broken gzip stream, a malformed line, or a file that holds no request.
    """
    p = trace_path(path)
    for name, value, optional in (
        ("limit", limit, True),
        ("max_prompt_tokens", max_prompt_tokens, True),
        ("source_block", source_block, False),
    ):
        if (value is not None or not optional) and (
            not isinstance(value, int) or isinstance(value, bool)
        ):
            none = " (or None)" if optional else ""
            raise WorkloadError(
                f"trace: {name} must be an integer >= 1{none}, got {brief_repr(value)}"
            )
    for name, value in (("limit", limit), ("max_prompt_tokens", max_prompt_tokens)):
        if value is not None and value < 1:
            raise WorkloadError(f"trace: {name} must be >= 1 (or None), got {value}")
    if source_block < 1:
        raise WorkloadError(f"trace: source_block must be >= 1 tokens, got {source_block}")
    requests: list[WorkloadRequest] = []
    skipped = lines = 0
    fh, gz = _open_binary(p)
    with fh:
        for lineno, line in _lines(fh, p, gz):
            if not line.strip():
                continue
            lines += 1
            ts, n_in, n_out, hash_ids = _parse(line, f"{p}:{lineno}", source_block)
            if max_prompt_tokens is not None and n_in > max_prompt_tokens:
                skipped += 1
                continue
            tokens: list[int] = []
            for h in hash_ids:
                start = TOKEN_BASE + h * source_block
                tokens.extend(range(start, start + source_block))
                if len(tokens) >= n_in:
                    break
            idx = len(requests)
            out_start = _OUTPUT_BASE + idx * _OUTPUT_STRIDE
            requests.append(
                WorkloadRequest(
                    request_id=f"trace-{idx}",
                    arrival_ms=ts,
                    prompt_token_ids=tuple(tokens[:n_in]),
                    output_token_ids=tuple(range(out_start, out_start + max(1, n_out))),
                )
            )
            if limit is not None and len(requests) >= limit:
                break  # the next line is not read
    if not requests:
        if lines:
            raise WorkloadError(
                f"trace: {str(p)!r} holds no request with input_length <= "
                f"max_prompt_tokens={max_prompt_tokens} ({lines} longer skipped); raise "
                "max_prompt_tokens"
            )
        raise WorkloadError(f"trace: {str(p)!r} holds no request; {_FORMAT}")
    t0 = min(r.arrival_ms for r in requests)
    if t0:
        requests = [dataclasses.replace(r, arrival_ms=r.arrival_ms - t0) for r in requests]
    return Workload(f"mooncake:{p.name}", sorted_by_arrival(requests), skipped, source_block)
