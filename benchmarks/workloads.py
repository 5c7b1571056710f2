"""Request workloads for the benchmarks: a synthetic shared-prefix chat mix and the Mooncake trace.

Importable on its own (standard library only).  A workload is a list of
:class:`WorkloadRequest`; a request with a ``parent`` is a multi-turn re-send: its prompt is
the parent's prompt, the parent's output and a new user turn, and it may only arrive once the
parent has finished (``think_steps`` later).

Synthetic default (the anchors' workload): 200 requests, prompts of 500-4000 tokens built on
one of 8 shared prefixes drawn from a Zipf distribution, 64-256 output tokens, and multi-turn
re-sends of finished conversations.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "DEFAULT_TRACE",
    "WorkloadRequest",
    "mooncake_workload",
    "synthetic_workload",
    "workload_summary",
]

#: Where the Mooncake conversation trace lives in this workspace (not in the repository).
DEFAULT_TRACE = (
    Path(__file__).resolve().parents[2] / "shared/traces/mooncake_conversation_trace.jsonl"
)

_PREFIX_BASE = 1_000_000  # token ids of shared prefix i: _PREFIX_BASE * (i + 1) + j
_UNIQUE_BASE = 100  # unique tokens: drawn from [100, 900_000)


@dataclass(frozen=True, kw_only=True)
class WorkloadRequest:
    """One request: its prompt and output token ids, and when it may arrive (in steps)."""

    request_id: str
    prompt: tuple[int, ...]
    output: tuple[int, ...]
    arrival_step: int
    parent: str | None = None
    think_steps: int = 0


def _zipf_weights(n: int, a: float) -> list[float]:
    return [1.0 / (i + 1) ** a for i in range(n)]


def synthetic_workload(
    num_requests: int = 200,
    *,
    seed: int = 0,
    num_prefixes: int = 8,
    zipf_a: float = 1.1,
    prefix_range: tuple[int, int] = (300, 1500),
    prompt_range: tuple[int, int] = (500, 4000),
    output_range: tuple[int, int] = (64, 256),
    multi_turn_fraction: float = 0.3,
    turn_range: tuple[int, int] = (32, 256),
    arrival_interval: float = 4.0,
    think_steps: int = 8,
) -> list[WorkloadRequest]:
    """The synthetic chat mix (deterministic for a seed).

    First turns arrive every ``arrival_interval`` steps (with jitter); each picks a shared
    prefix by Zipf(``zipf_a``) and adds unique tokens up to a prompt length uniform in
    ``prompt_range``.  About ``multi_turn_fraction`` of the requests are re-sends of an earlier
    conversation's latest turn (prompt + output + ``turn_range`` new tokens, capped at the
    prompt range's maximum).
    """
    rng = random.Random(seed)
    prefixes = [
        tuple(range(_PREFIX_BASE * (i + 1), _PREFIX_BASE * (i + 1) + rng.randint(*prefix_range)))
        for i in range(num_prefixes)
    ]
    weights = _zipf_weights(num_prefixes, zipf_a)
    out: list[WorkloadRequest] = []
    latest: list[WorkloadRequest] = []  # latest turn of each conversation
    t = 0.0
    while len(out) < num_requests:
        follow = [
            c for c in latest if len(c.prompt) + len(c.output) + turn_range[0] <= prompt_range[1]
        ]
        if follow and rng.random() < multi_turn_fraction:
            parent = rng.choice(follow)
            room = prompt_range[1] - len(parent.prompt) - len(parent.output)
            extra = rng.randint(turn_range[0], min(turn_range[1], room))
            turn = tuple(rng.randrange(_UNIQUE_BASE, 900_000) for _ in range(extra))
            req = WorkloadRequest(
                request_id=f"s{len(out)}",
                prompt=parent.prompt + parent.output + turn,
                output=tuple(
                    rng.randrange(_UNIQUE_BASE, 900_000) for _ in range(rng.randint(*output_range))
                ),
                arrival_step=int(t),
                parent=parent.request_id,
                think_steps=think_steps,
            )
            latest[latest.index(parent)] = req
        else:
            prefix = rng.choices(prefixes, weights)[0]
            length = max(rng.randint(*prompt_range), len(prefix) + 1)
            unique = tuple(
                rng.randrange(_UNIQUE_BASE, 900_000) for _ in range(length - len(prefix))
            )
            req = WorkloadRequest(
                request_id=f"s{len(out)}",
                prompt=prefix + unique,
                output=tuple(
                    rng.randrange(_UNIQUE_BASE, 900_000) for _ in range(rng.randint(*output_range))
                ),
                arrival_step=int(t),
            )
            latest.append(req)
            t += rng.uniform(0.5, 1.5) * arrival_interval
        out.append(req)
    return out


def mooncake_workload(
    path: str | Path = DEFAULT_TRACE,
    *,
    num_requests: int | None = None,
    ms_per_step: float = 50.0,
    max_prompt: int | None = None,
    seed: int = 0,
) -> list[WorkloadRequest]:
    """Requests of the Mooncake FAST'25 conversation trace (``hash_ids`` at 512 tokens).

    Block ``h`` becomes tokens ``h * 512 + 1000 + i``; the prompt is cut to ``input_length``.
    Output tokens are random (the trace has only their count).  Arrival: ``timestamp`` in ms
    divided by ``ms_per_step``.  Requests with prompts over ``max_prompt`` are skipped.
    Raises FileNotFoundError when the trace is absent.
    """
    rng = random.Random(seed)
    out: list[WorkloadRequest] = []
    with Path(path).open() as fh:
        for line in fh:
            if num_requests is not None and len(out) >= num_requests:
                break
            row = json.loads(line)
            n = int(row["input_length"])
            if n <= 0 or (max_prompt is not None and n > max_prompt):
                continue
            prompt = [h * 512 + 1000 + i for h in row["hash_ids"] for i in range(512)][:n]
            outputs = max(1, int(row["output_length"]))
            out.append(
                WorkloadRequest(
                    request_id=f"m{len(out)}",
                    prompt=tuple(prompt),
                    output=tuple(rng.randrange(100, 1000) for _ in range(outputs)),
                    arrival_step=int(row["timestamp"] / ms_per_step),
                )
            )
    return out


def workload_summary(requests: Sequence[WorkloadRequest]) -> dict[str, float]:
    """Counts and mean lengths, for the benchmark's report."""
    n = len(requests)
    return {
        "requests": n,
        "multi_turn": sum(1 for r in requests if r.parent is not None),
        "mean_prompt": sum(len(r.prompt) for r in requests) / max(n, 1),
        "mean_output": sum(len(r.output) for r in requests) / max(n, 1),
        "prompt_tokens": sum(len(r.prompt) for r in requests),
    }
