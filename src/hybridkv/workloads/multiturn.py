"""Seeded multi-turn chat workloads for step-driven benchmarks (the anchors' description).

Both generators follow the same one-line description — prompts of 500-4000 tokens that start
with one of 8 shared prefixes drawn from a Zipf distribution, 64-256 output tokens, and about
30% multi-turn re-sends (an earlier prompt, its whole output and a new user turn) — and differ
in how they realise it, which moves hit rates by several points (see ``docs/vllm.md``):

* :func:`conversation_workload` (:class:`ConversationConfig`): new conversations arrive every
  ``arrival_gap_steps`` (jittered x0.5-1.5); a follow-up continues the *latest* turn of a
  conversation and waits a fixed ``think_steps`` after it finished.  Prefixes of 300-1500
  tokens.  What ``benchmarks/bench_manager.py`` and the vLLM driver replay by default.
* :func:`branching_workload` (:class:`BranchingConfig`): every request arrives by a Poisson
  process; a follow-up may continue *any* earlier request (conversations branch) after a
  random think time.  Prefixes of 256-2048 tokens.

User text and outputs are random token ids, so two requests share a cache block only through a
common prefix or a re-send (barring negligible chance); output tokens are fixed in advance, so
a follow-up re-sends exactly its parent's output.  Each generator is a pure function of its
config: the same config always gives the same requests (the benchmarks' quoted numbers depend
on that).  Standard library only.
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass

from hybridkv.workloads.steps import StepRequest
from hybridkv.workloads.synthetic import zipf_weights
from hybridkv.workloads.types import WorkloadError

__all__ = [
    "BranchingConfig",
    "ConversationConfig",
    "branching_workload",
    "conversation_workload",
]

# conversation_workload: shared prefix i holds the ids _PREFIX_BASE * (i + 1) + j; user text and
# outputs are drawn from [_TEXT_LO, _TEXT_HI).
_PREFIX_BASE = 1_000_000
_TEXT_LO, _TEXT_HI = 100, 900_000
# branching_workload: prefixes and user text from [_BRANCH_TEXT_LO, _BRANCH_TEXT_HI); outputs
# from [_REPLY_BASE, _REPLY_BASE + _REPLY_RANGE), a CRC of (request id, position).
_BRANCH_TEXT_LO, _BRANCH_TEXT_HI = 1_000, 60_000
_REPLY_BASE, _REPLY_RANGE = 100_000, 50_000


def _check_range(owner: str, name: str, value: tuple[int, int], low: int) -> None:
    lo, hi = value
    if not low <= lo <= hi:
        raise WorkloadError(
            f"{owner}: {name} must be an inclusive range (lo, hi) with {low} <= lo <= hi, "
            f"got {value!r}"
        )


def _check_common(owner: str, cfg: ConversationConfig | BranchingConfig) -> None:
    if cfg.num_requests < 1 or cfg.num_prefixes < 1:
        raise WorkloadError(
            f"{owner}: num_requests and num_prefixes must be >= 1, got {cfg.num_requests} "
            f"and {cfg.num_prefixes}"
        )
    if cfg.zipf_s < 0:
        raise WorkloadError(f"{owner}: zipf_s must be >= 0, got {cfg.zipf_s}")
    if not 0.0 <= cfg.followup_prob <= 1.0:
        raise WorkloadError(f"{owner}: followup_prob must be in [0, 1], got {cfg.followup_prob}")
    if cfg.arrival_gap_steps < 0:
        raise WorkloadError(
            f"{owner}: arrival_gap_steps must be >= 0 steps, got {cfg.arrival_gap_steps}"
        )
    for name in ("prefix_tokens", "prompt_tokens", "output_tokens", "turn_tokens"):
        _check_range(owner, name, getattr(cfg, name), 1)


@dataclass(frozen=True, kw_only=True)
class ConversationConfig:
    """:func:`conversation_workload`'s knobs.  Ranges are inclusive, in tokens.

    ``arrival_gap_steps``: mean steps between new conversations (each gap is that times a
    uniform 0.5-1.5); a follow-up is stamped with the current arrival clock and released
    ``think_steps`` after its parent finished.  ``followup_prob``: chance that a request
    continues the latest turn of an earlier conversation (one whose prompt, output and a
    minimal turn still fit ``prompt_tokens``)."""

    num_requests: int = 200
    seed: int = 0
    num_prefixes: int = 8
    zipf_s: float = 1.1
    prefix_tokens: tuple[int, int] = (300, 1500)
    prompt_tokens: tuple[int, int] = (500, 4000)
    output_tokens: tuple[int, int] = (64, 256)
    followup_prob: float = 0.3
    turn_tokens: tuple[int, int] = (32, 256)
    arrival_gap_steps: float = 4.0
    think_steps: int = 8

    def __post_init__(self) -> None:
        _check_common("ConversationConfig", self)
        if self.prefix_tokens[1] >= _PREFIX_BASE:
            raise WorkloadError(
                f"ConversationConfig: prefix_tokens must stay below {_PREFIX_BASE} tokens, got "
                f"{self.prefix_tokens!r}"
            )
        if self.think_steps < 0:
            raise WorkloadError(
                f"ConversationConfig: think_steps must be >= 0, got {self.think_steps}"
            )


def conversation_workload(cfg: ConversationConfig | None = None) -> list[StepRequest]:
    """The conversation mix (see the module docstring); ids ``s0``, ``s1``, ... in generation
    order, along which arrival steps never decrease."""
    cfg = cfg or ConversationConfig()
    rng = random.Random(cfg.seed)

    def text(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(_TEXT_LO, _TEXT_HI) for _ in range(n))

    prefixes = [
        tuple(
            range(_PREFIX_BASE * (i + 1), _PREFIX_BASE * (i + 1) + rng.randint(*cfg.prefix_tokens))
        )
        for i in range(cfg.num_prefixes)
    ]
    weights = zipf_weights(cfg.num_prefixes, cfg.zipf_s)
    max_prompt, min_turn = cfg.prompt_tokens[1], cfg.turn_tokens[0]
    out: list[StepRequest] = []
    latest: list[StepRequest] = []  # the latest turn of each conversation
    clock = 0.0
    while len(out) < cfg.num_requests:
        follow = [c for c in latest if c.prompt_len + c.output_len + min_turn <= max_prompt]
        if follow and rng.random() < cfg.followup_prob:
            parent = rng.choice(follow)
            room = max_prompt - parent.prompt_len - parent.output_len
            turn = text(rng.randint(min_turn, min(cfg.turn_tokens[1], room)))
            req = StepRequest(
                request_id=f"s{len(out)}",
                prompt_token_ids=parent.prompt_token_ids + parent.output_token_ids + turn,
                output_token_ids=text(rng.randint(*cfg.output_tokens)),
                arrival_step=int(clock),
                parent_id=parent.request_id,
                think_steps=cfg.think_steps,
            )
            latest[latest.index(parent)] = req
        else:
            prefix = rng.choices(prefixes, weights)[0]
            length = max(rng.randint(*cfg.prompt_tokens), len(prefix) + 1)
            unique = text(length - len(prefix))
            req = StepRequest(
                request_id=f"s{len(out)}",
                prompt_token_ids=prefix + unique,
                output_token_ids=text(rng.randint(*cfg.output_tokens)),
                arrival_step=int(clock),
            )
            latest.append(req)
            clock += rng.uniform(0.5, 1.5) * cfg.arrival_gap_steps
        out.append(req)
    return out


@dataclass(frozen=True, kw_only=True)
class BranchingConfig:
    """:func:`branching_workload`'s knobs.  Ranges are inclusive, in tokens or steps.

    ``arrival_gap_steps``: mean of the exponential gap between consecutive requests (0: all at
    step 0).  ``followup_prob``: chance that a request re-sends an earlier request (any whose
    prompt, output and this request's turn still fit ``prompt_tokens``); it is released
    ``think_steps`` (drawn per request) after that request finished."""

    num_requests: int = 200
    seed: int = 0
    num_prefixes: int = 8
    zipf_s: float = 1.1
    prefix_tokens: tuple[int, int] = (256, 2048)
    prompt_tokens: tuple[int, int] = (500, 4000)
    output_tokens: tuple[int, int] = (64, 256)
    followup_prob: float = 0.3
    turn_tokens: tuple[int, int] = (32, 512)
    arrival_gap_steps: float = 1.0
    think_steps: tuple[int, int] = (0, 20)

    def __post_init__(self) -> None:
        _check_common("BranchingConfig", self)
        _check_range("BranchingConfig", "think_steps", self.think_steps, 0)
        if self.prefix_tokens[1] + 32 > self.prompt_tokens[1]:
            raise WorkloadError(
                f"BranchingConfig: the longest prefix plus 32 tokens must fit prompt_tokens, "
                f"got prefix_tokens {self.prefix_tokens!r} and prompt_tokens "
                f"{self.prompt_tokens!r}"
            )


def _reply_token(request_id: str, position: int) -> int:
    """The token ``request_id`` "samples" at output ``position``: a CRC of both."""
    return _REPLY_BASE + zlib.crc32(f"{request_id}:{position}".encode()) % _REPLY_RANGE


def branching_workload(cfg: BranchingConfig | None = None) -> list[StepRequest]:
    """The branching mix (see the module docstring); ids ``req-00000``, ``req-00001``, ... in
    arrival order.  Output token ``j`` of request ``r`` is a CRC of ``(r, j)``."""
    cfg = cfg or BranchingConfig()
    rng = random.Random(cfg.seed)

    def text(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(_BRANCH_TEXT_LO, _BRANCH_TEXT_HI) for _ in range(n))

    prefixes = [text(rng.randint(*cfg.prefix_tokens)) for _ in range(cfg.num_prefixes)]
    weights = zipf_weights(cfg.num_prefixes, cfg.zipf_s)
    max_prompt = cfg.prompt_tokens[1]
    out: list[StepRequest] = []
    clock = 0.0
    for i in range(cfg.num_requests):
        if i and cfg.arrival_gap_steps > 0:
            clock += rng.expovariate(1.0 / cfg.arrival_gap_steps)
        num_out, turn = rng.randint(*cfg.output_tokens), rng.randint(*cfg.turn_tokens)
        fits = [r for r in out if r.prompt_len + r.output_len + turn <= max_prompt]
        parent = rng.choice(fits) if fits and rng.random() < cfg.followup_prob else None
        if parent is not None:
            prompt = parent.prompt_token_ids + parent.output_token_ids + text(turn)
        else:
            prefix = rng.choices(prefixes, weights)[0]
            total = rng.randint(max(cfg.prompt_tokens[0], len(prefix) + 32), max_prompt)
            prompt = prefix + text(total - len(prefix))
        request_id = f"req-{i:05d}"
        out.append(
            StepRequest(
                request_id=request_id,
                prompt_token_ids=prompt,
                output_token_ids=tuple(_reply_token(request_id, j) for j in range(num_out)),
                arrival_step=int(clock),
                parent_id=None if parent is None else parent.request_id,
                think_steps=rng.randint(*cfg.think_steps),
            )
        )
    return out
