"""The vLLM driver's workloads: requests, the fake sampled-token stream, the synthetic generator,
the shared-workload and Mooncake-trace converters and the unbounded-cache hit bound.

Plain Python (never imports vLLM); :mod:`vllm_driver` re-exports these names.
"""

from __future__ import annotations

import json
import random
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "OUTPUT_TOKEN_BASE",
    "OUTPUT_TOKEN_RANGE",
    "PROMPT_TOKEN_RANGE",
    "TRACE_BLOCK",
    "TRACE_TOKEN_BASE",
    "SyntheticWorkloadConfig",
    "WorkloadRequest",
    "fake_output_token",
    "from_shared_workload",
    "ideal_hit_tokens",
    "load_mooncake_trace",
    "make_synthetic_workload",
]

PROMPT_TOKEN_RANGE = (1_000, 60_000)  # random user-text token ids
OUTPUT_TOKEN_BASE, OUTPUT_TOKEN_RANGE = 100_000, 50_000  # fake sampled token ids
TRACE_TOKEN_BASE, TRACE_BLOCK = 1_000_000, 512  # Mooncake hash_id -> tokens (traces/README)


# ---------------------------------------------------------------------------------- workload
@dataclass(frozen=True, kw_only=True)
class WorkloadRequest:
    """One request.  ``arrival_step`` is in scheduler steps; a follow-up turn (``parent_id``
    set) becomes eligible only ``think_steps`` steps after its parent finished.  The sampled
    tokens are ``output_token_ids`` when given, else :func:`fake_output_token`."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    max_output_tokens: int
    arrival_step: int
    parent_id: str | None = None
    think_steps: int = 0
    output_token_ids: tuple[int, ...] = ()

    def output_token(self, position: int) -> int:
        """The token this request samples at output ``position`` (0-based)."""
        if self.output_token_ids:
            return self.output_token_ids[position]
        return fake_output_token(self.request_id, position)


def fake_output_token(request_id: str, position: int) -> int:
    """Deterministic "sampled" token: the same (request, output position) gives the same id in
    every system and process, so two managers see identical token streams."""
    return OUTPUT_TOKEN_BASE + zlib.crc32(f"{request_id}:{position}".encode()) % OUTPUT_TOKEN_RANGE


def from_shared_workload(requests: Sequence[Any]) -> list[WorkloadRequest]:
    """Requests of ``benchmarks/workloads.py`` (fields ``prompt``, ``output``, ``parent``), the
    workload hybridkv's own benchmarks replay, as driver requests with the same tokens."""
    return [
        WorkloadRequest(
            request_id=r.request_id,
            prompt_token_ids=tuple(r.prompt),
            max_output_tokens=len(r.output),
            output_token_ids=tuple(r.output),
            arrival_step=r.arrival_step,
            parent_id=r.parent,
            think_steps=r.think_steps,
        )
        for r in requests
    ]


@dataclass(frozen=True, kw_only=True)
class SyntheticWorkloadConfig:
    """The anchors.md synthetic workload.  Ranges are inclusive, in tokens or steps."""

    num_requests: int = 200
    num_prefixes: int = 8
    zipf_s: float = 1.1
    prefix_tokens: tuple[int, int] = (256, 2048)
    prompt_tokens: tuple[int, int] = (500, 4000)
    output_tokens: tuple[int, int] = (64, 256)
    followup_prob: float = 0.3
    turn_tokens: tuple[int, int] = (32, 512)
    mean_arrival_gap_steps: float = 1.0
    think_steps: tuple[int, int] = (0, 20)
    seed: int = 0


def make_synthetic_workload(cfg: SyntheticWorkloadConfig) -> list[WorkloadRequest]:
    """Prompts start with one of ``num_prefixes`` shared prefixes (Zipf popularity) followed by
    unique text, or re-send an earlier request's prompt + its whole output + a new user turn
    (probability ``followup_prob``).  Poisson arrivals.  A pure function of ``cfg``."""
    rng = random.Random(cfg.seed)

    def text(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(*PROMPT_TOKEN_RANGE) for _ in range(n))

    prefixes = [text(rng.randint(*cfg.prefix_tokens)) for _ in range(cfg.num_prefixes)]
    weights = [1.0 / (k + 1) ** cfg.zipf_s for k in range(cfg.num_prefixes)]
    out: list[WorkloadRequest] = []
    clock = 0.0
    for i in range(cfg.num_requests):
        if i and cfg.mean_arrival_gap_steps > 0:
            clock += rng.expovariate(1.0 / cfg.mean_arrival_gap_steps)
        max_out, turn = rng.randint(*cfg.output_tokens), rng.randint(*cfg.turn_tokens)
        fits = [
            r
            for r in out
            if len(r.prompt_token_ids) + r.max_output_tokens + turn <= cfg.prompt_tokens[1]
        ]
        parent = rng.choice(fits) if fits and rng.random() < cfg.followup_prob else None
        if parent is not None:
            pid = parent.request_id
            reply = tuple(fake_output_token(pid, j) for j in range(parent.max_output_tokens))
            prompt = parent.prompt_token_ids + reply + text(turn)
        else:
            prefix = rng.choices(prefixes, weights)[0]
            total = rng.randint(max(cfg.prompt_tokens[0], len(prefix) + 32), cfg.prompt_tokens[1])
            prompt = prefix + text(total - len(prefix))
        out.append(
            WorkloadRequest(
                request_id=f"req-{i:05d}",
                prompt_token_ids=prompt,
                max_output_tokens=max_out,
                arrival_step=int(clock),
                parent_id=parent.request_id if parent else None,
                think_steps=rng.randint(*cfg.think_steps),
            )
        )
    return out


def load_mooncake_trace(
    path: Path, num_requests: int, ms_per_step: float, max_model_len: int
) -> tuple[list[WorkloadRequest], int]:
    """The first ``num_requests`` trace lines as requests (hash block ``h`` holds the tokens
    ``TRACE_TOKEN_BASE + h * 512 + i``).  Returns (requests, lines skipped because prompt +
    output exceeds ``max_model_len``)."""
    out: list[WorkloadRequest] = []
    skipped = 0
    with path.open() as fh:
        for i, line in enumerate(fh):
            if i >= num_requests:
                break
            rec = json.loads(line)
            n_in, n_out = int(rec["input_length"]), max(1, int(rec["output_length"]))
            if n_in + n_out > max_model_len:
                skipped += 1
                continue
            base = [TRACE_TOKEN_BASE + h * TRACE_BLOCK for h in rec["hash_ids"]]
            toks = tuple(b + j for b in base for j in range(TRACE_BLOCK))[:n_in]
            out.append(
                WorkloadRequest(
                    request_id=f"trace-{i:06d}",
                    prompt_token_ids=toks,
                    max_output_tokens=n_out,
                    arrival_step=int(rec["timestamp"] / ms_per_step),
                )
            )
    return out, skipped


def ideal_hit_tokens(requests: Sequence[WorkloadRequest], block_size: int) -> int:
    """Hit tokens with an unbounded cache at ``block_size`` granularity, requests served in
    arrival order, each hit capped at prompt_len - 1 as in vLLM: the bound for any manager."""
    seen: set[int] = set()
    total = 0
    for r in sorted(requests, key=lambda r: (r.arrival_step, r.request_id)):
        outs = tuple(r.output_token(j) for j in range(r.max_output_tokens))
        seq, n_prompt = r.prompt_token_ids + outs, len(r.prompt_token_ids)
        key, hit = 0, 0
        # The cached sequence: prompt + output but the last sampled token (never computed).
        for b in range((len(seq) - 1) // block_size):
            key = hash((key, seq[b * block_size : (b + 1) * block_size]))
            if hit == b * block_size and b < (n_prompt - 1) // block_size and key in seen:
                hit += block_size
            seen.add(key)
        total += hit
    return total
