"""Loader for Mooncake-format request traces (JSON lines).

Each line: ``{"timestamp": ms, "input_length": int, "output_length": int, "hash_ids": [int]}``.
``hash_ids`` name prefix blocks of ``source_block`` tokens (512 in the published traces): two
requests agreeing on their first ``k`` ids share their first ``k * 512`` prompt tokens.  Block
``h`` becomes the tokens ``TOKEN_BASE + h * source_block + i``; the last block is cut to
``input_length``.  Output tokens are unique per request, so outputs never produce false hits.
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

from hybridkv.workloads.types import Workload, WorkloadError, WorkloadRequest, sorted_by_arrival

__all__ = ["TOKEN_BASE", "load_mooncake_trace"]

#: Token ids below this are left free (special tokens of real vocabularies).
TOKEN_BASE = 1000
_OUTPUT_BASE = 1 << 40


def _field(obj: dict[str, object], name: str, path: str, lineno: int) -> int:
    if name not in obj:
        raise WorkloadError(f"{path}:{lineno}: missing field {name!r}")
    value = obj[name]
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise WorkloadError(
            f"{path}:{lineno}: field {name!r} must be a non-negative integer, got {value!r}"
        )
    return value


def _open_text(p: Path) -> TextIO:
    """``p`` opened as UTF-8 text, through gzip when it starts with gzip's magic bytes."""
    if p.is_dir():
        raise WorkloadError(f"trace: {str(p)!r} is a directory; give a JSON-lines trace file")
    try:
        with p.open("rb") as raw:
            magic = raw.read(2)
        if magic == b"\x1f\x8b":
            return gzip.open(p, "rt", encoding="utf-8")
        return p.open(encoding="utf-8")
    except FileNotFoundError:
        raise WorkloadError(f"trace: no such file {str(p)!r}") from None
    except OSError as exc:
        raise WorkloadError(f"trace: cannot read {str(p)!r}: {exc.strerror}") from None


def _lines(fh: TextIO, p: Path) -> Iterator[tuple[int, str]]:
    """Numbered lines of ``fh``; undecodable bytes and broken gzip become WorkloadErrors."""
    lineno = 0
    try:
        for lineno, line in enumerate(fh, start=1):
            yield lineno, line
    except UnicodeDecodeError:
        raise WorkloadError(
            f"{p}:{lineno + 1}: not UTF-8 text; a trace is JSON lines (optionally gzip)"
        ) from None
    except (OSError, EOFError) as exc:  # gzip.BadGzipFile is an OSError
        raise WorkloadError(f"{p}: cannot read the gzip stream: {exc}") from None


def load_mooncake_trace(
    path: str | os.PathLike[str],
    *,
    limit: int | None = None,
    source_block: int = 512,
) -> Workload:
    """Read a Mooncake trace into a :class:`Workload` (at most ``limit`` requests).

    The file may be gzip-compressed.  Raises :class:`WorkloadError` naming the file, the line
    number and the field for a malformed line, and when the file does not exist, is not
    (gzip of) UTF-8 text, or holds no request.
    """
    p = Path(path)
    requests: list[WorkloadRequest] = []
    with _open_text(p) as fh:
        for lineno, line in _lines(fh, p):
            if limit is not None and len(requests) >= limit:
                break
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise WorkloadError(f"{p}:{lineno}: not valid JSON ({exc.msg})") from None
            if not isinstance(obj, dict):
                raise WorkloadError(f"{p}:{lineno}: expected a JSON object")
            ts = obj.get("timestamp")
            if not isinstance(ts, int | float) or isinstance(ts, bool) or ts < 0:
                raise WorkloadError(
                    f"{p}:{lineno}: field 'timestamp' must be a non-negative number, got {ts!r}"
                )
            n_in = _field(obj, "input_length", str(p), lineno)
            n_out = _field(obj, "output_length", str(p), lineno)
            if "hash_ids" not in obj:
                raise WorkloadError(f"{p}:{lineno}: missing field 'hash_ids'")
            hash_ids = obj["hash_ids"]
            if not isinstance(hash_ids, list) or not all(
                isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in hash_ids
            ):
                raise WorkloadError(
                    f"{p}:{lineno}: field 'hash_ids' must be a list of non-negative integers"
                )
            if n_in <= 0:
                raise WorkloadError(f"{p}:{lineno}: field 'input_length' must be positive")
            if len(hash_ids) * source_block < n_in:
                raise WorkloadError(
                    f"{p}:{lineno}: field 'hash_ids' has {len(hash_ids)} blocks of "
                    f"{source_block}, too few for input_length {n_in}"
                )
            tokens: list[int] = []
            for h in hash_ids:
                start = TOKEN_BASE + h * source_block
                tokens.extend(range(start, start + source_block))
                if len(tokens) >= n_in:
                    break
            idx = len(requests)
            out_start = _OUTPUT_BASE + idx * (1 << 20)
            requests.append(
                WorkloadRequest(
                    request_id=f"trace-{idx}",
                    arrival_ms=float(ts),
                    prompt_token_ids=tuple(tokens[:n_in]),
                    output_token_ids=tuple(range(out_start, out_start + max(1, n_out))),
                )
            )
    if not requests:
        raise WorkloadError(f"trace: {str(p)!r} holds no request")
    return Workload(f"mooncake:{p.name}", sorted_by_arrival(requests))
