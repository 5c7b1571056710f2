"""Loader for Mooncake-format request traces (JSON lines).

Each line: ``{"timestamp": ms, "input_length": int, "output_length": int, "hash_ids": [int]}``.
``hash_ids`` name prefix blocks of ``source_block`` tokens (512 in the published traces): two
requests agreeing on their first ``k`` ids share their first ``k * 512`` prompt tokens.  Block
``h`` becomes the tokens ``TOKEN_BASE + h * source_block + i``; the last block is cut to
``input_length``.  Output tokens are unique per request, so outputs never produce false hits.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

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


def load_mooncake_trace(
    path: str | os.PathLike[str],
    *,
    limit: int | None = None,
    source_block: int = 512,
) -> Workload:
    """Read a Mooncake trace into a :class:`Workload` (at most ``limit`` requests).

    Raises :class:`WorkloadError` naming the file, the line number and the field for a
    malformed line, and when the file does not exist or holds no request.
    """
    p = Path(path)
    if not p.is_file():
        raise WorkloadError(f"trace: no such file {str(p)!r}")
    requests: list[WorkloadRequest] = []
    with p.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
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
