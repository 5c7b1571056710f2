"""Seeded synthetic workloads, so every default runs without files.

* ``chat``: multi-turn conversations; each session starts with one of a few shared system
  prompts (Zipf popularity) and every turn re-sends the whole history plus a new user message.
* ``agent``: tool-use loops; one long shared tool preamble, each step re-sends the growing
  context with the last tool result appended.
* ``docs``: questions over a library of documents with Zipf popularity.
* ``mixed``: the three above interleaved.

Token ids are drawn from disjoint ranges per role so unrelated text never collides.  Generation
is deterministic in ``seed``: the same arguments always give the same requests.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

from hybridkv.errors import brief_repr
from hybridkv.workloads.types import Workload, WorkloadError, WorkloadRequest, sorted_by_arrival

__all__ = ["SYNTHETIC_WORKLOADS", "SyntheticOptions", "synthetic_workload", "zipf_weights"]


@dataclass(frozen=True, kw_only=True)
class SyntheticOptions:
    """Knobs shared by the generators (defaults give a few hundred requests)."""

    num_requests: int = 400
    seed: int = 0
    #: mean gap between new sessions, ms (0: everything arrives at once)
    session_gap_ms: float = 200.0
    #: gap between a turn's arrival and the next turn of the same session, ms
    turn_gap_ms: float = 4000.0


class _Tokens:
    """Hands out fresh, never-repeating token ids."""

    def __init__(self, start: int) -> None:
        self._next = start

    def take(self, n: int) -> tuple[int, ...]:
        out = tuple(range(self._next, self._next + n))
        self._next += n
        return out


def zipf_weights(n: int, s: float) -> list[float]:
    """Zipf(``s``) popularity of ``n`` items, most popular first (unnormalised)."""
    return [1.0 / (k + 1) ** s for k in range(n)]


def _zipf_index(rng: random.Random, n: int, s: float = 1.1) -> int:
    return rng.choices(range(n), weights=zipf_weights(n, s))[0]


def _sessions(
    name: str,
    opts: SyntheticOptions,
    make_session: Callable[[random.Random, _Tokens, int], list[tuple[tuple[int, ...], int]]],
) -> Workload:
    """Build requests session by session.

    ``make_session(rng, fresh, session)`` returns the session's turns as ``(prefix, output_len)``
    where ``prefix`` is the new prompt text of that turn; the prompt actually sent is the whole
    history (earlier prompts and outputs) plus ``prefix``.
    """
    rng = random.Random(opts.seed)
    fresh = _Tokens(1_000_000)
    outputs = _Tokens(500_000_000)
    requests: list[WorkloadRequest] = []
    t0 = 0.0
    session = 0
    while len(requests) < opts.num_requests:
        history: tuple[int, ...] = ()
        arrival = t0
        for turn, (new_text, out_len) in enumerate(make_session(rng, fresh, session)):
            if len(requests) >= opts.num_requests:
                break
            prompt = history + new_text
            out = outputs.take(out_len)
            requests.append(
                WorkloadRequest(
                    request_id=f"{name}-{session}-{turn}",
                    arrival_ms=arrival,
                    prompt_token_ids=prompt,
                    output_token_ids=out,
                    session_id=f"{name}-{session}",
                )
            )
            history = prompt + out
            arrival += opts.turn_gap_ms * rng.uniform(0.5, 1.5)
        session += 1
        if opts.session_gap_ms > 0:
            t0 += rng.expovariate(1.0 / opts.session_gap_ms)
    return Workload(f"synthetic:{name}", sorted_by_arrival(requests))


def chat(opts: SyntheticOptions) -> Workload:
    system_rng = random.Random(opts.seed + 1)
    pool = _Tokens(10_000)
    systems = [pool.take(system_rng.randint(800, 2500)) for _ in range(6)]

    def session(rng: random.Random, fresh: _Tokens, _: int) -> list[tuple[tuple[int, ...], int]]:
        turns = min(8, 1 + int(rng.expovariate(1 / 2.5)))
        system = systems[_zipf_index(rng, len(systems))]
        out = [(system + fresh.take(rng.randint(30, 400)), rng.randint(64, 400))]
        out += [(fresh.take(rng.randint(20, 300)), rng.randint(64, 400)) for _ in range(turns - 1)]
        return out

    return _sessions("chat", opts, session)


def agent(opts: SyntheticOptions) -> Workload:
    preamble = _Tokens(20_000).take(4000)

    def session(rng: random.Random, fresh: _Tokens, _: int) -> list[tuple[tuple[int, ...], int]]:
        steps = rng.randint(3, 10)
        out = [(preamble + fresh.take(rng.randint(100, 600)), rng.randint(32, 200))]
        out += [(fresh.take(rng.randint(200, 1500)), rng.randint(32, 200)) for _ in range(steps)]
        return out

    return _sessions("agent", opts, session)


def docs(opts: SyntheticOptions) -> Workload:
    doc_rng = random.Random(opts.seed + 2)
    pool = _Tokens(100_000)
    library = [pool.take(doc_rng.randint(2000, 8000)) for _ in range(40)]

    def session(rng: random.Random, fresh: _Tokens, _: int) -> list[tuple[tuple[int, ...], int]]:
        doc = library[_zipf_index(rng, len(library))]
        return [(doc + fresh.take(rng.randint(20, 120)), rng.randint(64, 256))]

    return _sessions("docs", opts, session)


def mixed(opts: SyntheticOptions) -> Workload:
    third = opts.num_requests // 3  # chat and agent a third each, docs the rest
    counts = [(chat, third, 0), (agent, third, 7), (docs, opts.num_requests - 2 * third, 13)]
    parts = [
        make(SyntheticOptions(**{**opts.__dict__, "num_requests": n, "seed": opts.seed + bump}))
        for make, n, bump in counts
        if n > 0  # fewer than three requests: docs alone
    ]
    reqs = [r for w in parts for r in w.requests]
    return Workload("synthetic:mixed", sorted_by_arrival(reqs))


SYNTHETIC_WORKLOADS: dict[str, Callable[[SyntheticOptions], Workload]] = {
    "chat": chat,
    "agent": agent,
    "docs": docs,
    "mixed": mixed,
}


def synthetic_workload(name: str, opts: SyntheticOptions | None = None) -> Workload:
    """Generate the synthetic workload ``name``; raises :class:`WorkloadError` for unknown names
    and for options that are not a :class:`SyntheticOptions` of an integer ``num_requests``
    >= 1, an integer ``seed`` and gaps that are finite numbers >= 0."""
    gen = SYNTHETIC_WORKLOADS.get(name) if isinstance(name, str) else None
    if gen is None:
        valid = ", ".join(sorted(SYNTHETIC_WORKLOADS))
        raise WorkloadError(f"workload: unknown synthetic workload {name!r}; valid: {valid}")
    if opts is not None and not isinstance(opts, SyntheticOptions):
        raise WorkloadError(
            f"workload: opts must be a SyntheticOptions (or None), got {brief_repr(opts)}"
        )
    opts = opts or SyntheticOptions()
    _check_options(opts)
    return gen(opts)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_options(opts: SyntheticOptions) -> None:
    if not _is_int(opts.num_requests):
        got = brief_repr(opts.num_requests)
        raise WorkloadError(f"workload: num_requests must be a positive integer, got {got}")
    if opts.num_requests <= 0:
        raise WorkloadError(f"workload: num_requests must be positive, got {opts.num_requests}")
    if not _is_int(opts.seed):
        raise WorkloadError(f"workload: seed must be an integer, got {brief_repr(opts.seed)}")
    for field in ("session_gap_ms", "turn_gap_ms"):
        gap = getattr(opts, field)
        if not (
            isinstance(gap, int | float)
            and not isinstance(gap, bool)
            and math.isfinite(gap)
            and gap >= 0
        ):
            raise WorkloadError(
                f"workload: {field} must be a finite number of ms >= 0, got {brief_repr(gap)}"
            )
