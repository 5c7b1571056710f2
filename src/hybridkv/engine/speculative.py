"""Speculative decoding: draft proposers and greedy verification.

A decode step of a request normally computes one token (the last one sampled) and samples the
next.  With a :class:`SpeculativeConfig`, the engine first asks the proposer for up to
``num_draft_tokens`` guesses of the tokens that follow; the scheduler allocates their slots as
lookahead (never published) and the step runs the decode token and the drafts in one pass,
returning logits at every position (:attr:`~hybridkv.engine.runner.StepOutput.position_logits`).

Verification is greedy and exact: with ``g[i]`` the argmax after the decode token and the
first ``i`` drafts, drafts are accepted while ``draft[i] == g[i]``; the step yields the
accepted drafts and ``g[accepted]`` (:func:`accept_greedy`), which are exactly the tokens plain
greedy decoding produces one step at a time (on Mamba2 layers, up to the model's chunked-scan
versus one-step numerics: a near-tie can flip, as between transformers' own forward and
``generate``; see docs/architecture.md).  The accepted drafts' K/V are already in the
cache; a recurrent state, which scanned every draft, is rolled back by
:meth:`~hybridkv.engine.runner.ModelRunner.rewind` (the state the step started from, and the
kept tokens run again).  A speculative step never ends on a state checkpoint boundary
(:meth:`~hybridkv.scheduler.Scheduler.draft_room`), so checkpoints and published blocks are
the ones plain decoding leaves: prefix hits after speculation are the same.

Example (prompt lookup on a repetitive prompt)::

    >>> NgramProposer(max_n=2).propose("r", [5, 6, 7, 8, 5, 6], 3)
    (7, 8, 5)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from hybridkv.engine.errors import EngineError, SpeculativeConfigError
from hybridkv.engine.model_source import is_token_id

__all__ = [
    "DraftProposer",
    "NgramProposer",
    "SpeculativeConfig",
    "accept_greedy",
    "checked_draft",
    "no_drafts",
]


@runtime_checkable
class DraftProposer(Protocol):
    """Guesses the tokens that follow a request's known tokens."""

    def propose(self, request_id: str, token_ids: Sequence[int], num_tokens: int) -> Sequence[int]:
        """At most ``num_tokens`` draft tokens to follow ``token_ids`` (prompt and output so
        far) of request ``request_id``; fewer or none when it has no good guess."""
        ...


@dataclass(frozen=True)
class NgramProposer:
    """Prompt-lookup drafts: find the latest earlier occurrence of the sequence's last
    ``n`` tokens (``max_n`` down to ``min_n``) and propose the tokens that followed it.

    Costs one scan of the sequence per proposal, no model.  Pays off where outputs repeat
    their context (code edits, extraction, quoting, summaries of a given text).
    """

    max_n: int = 3
    min_n: int = 1

    def __post_init__(self) -> None:
        for name in ("max_n", "min_n"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise SpeculativeConfigError(
                    f"NgramProposer.{name}: must be an integer >= 1, got {value!r}"
                )
        if self.min_n > self.max_n:
            raise SpeculativeConfigError(
                f"NgramProposer.min_n: {self.min_n} exceeds max_n {self.max_n}; valid: "
                f"1 <= min_n <= max_n"
            )

    def propose(
        self, request_id: str, token_ids: Sequence[int], num_tokens: int
    ) -> tuple[int, ...]:
        tokens = list(token_ids)
        size = len(tokens)
        if num_tokens <= 0:
            return ()
        for n in range(min(self.max_n, size - 1), self.min_n - 1, -1):
            tail = tokens[size - n :]
            # The latest match ending before the tail itself: scan right to left.
            for start in range(size - n - 1, -1, -1):
                if tokens[start : start + n] == tail:
                    follow = tokens[start + n : start + n + num_tokens]
                    if follow:
                        return tuple(follow)
        return ()


#: Draft tokens per decode step at most.
MAX_DRAFT_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding in :class:`~hybridkv.engine.llm_engine.LLMEngine`: ``proposer``
    guesses up to ``num_draft_tokens`` (1..16) tokens after each decode token."""

    proposer: DraftProposer
    num_draft_tokens: int = 3

    def __post_init__(self) -> None:
        k = self.num_draft_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_DRAFT_TOKENS:
            raise SpeculativeConfigError(
                "SpeculativeConfig.num_draft_tokens: must be an integer in "
                f"[1, {MAX_DRAFT_TOKENS}], got {k!r}"
            )
        if not isinstance(self.proposer, DraftProposer):
            raise SpeculativeConfigError(
                f"SpeculativeConfig.proposer: {self.proposer!r} has no propose(request_id, "
                "token_ids, num_tokens) method"
            )


def accept_greedy(drafts: Sequence[int], greedy: Sequence[int]) -> tuple[int, ...]:
    """The tokens a speculative step yields: the drafts that equal the greedy token at their
    position, up to the first that does not, then the greedy token after them.

    ``greedy[i]`` is the argmax after the decode token and the first ``i`` drafts
    (``len(greedy) == len(drafts) + 1``).  Example: drafts ``(4, 9, 2)``, greedy
    ``(4, 9, 7, 1)`` -> ``(4, 9, 7)``: two drafts accepted, the third rejected.
    """
    if len(greedy) != len(drafts) + 1:
        raise EngineError(
            f"accept_greedy: {len(greedy)} greedy tokens for {len(drafts)} drafts; expected "
            f"{len(drafts) + 1}"
        )
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == greedy[accepted]:
        accepted += 1
    return tuple(greedy[: accepted + 1])


def no_drafts(name: str) -> SpeculativeConfigError:
    """The error for a model whose state cannot verify drafts (``name``: the model)."""
    return SpeculativeConfigError(
        f"speculative: {name} cannot verify drafts: its recurrent state (Mamba1) only "
        "continues one token at a time in transformers"
    )


def checked_draft(draft: Sequence[int], room: int, vocab_size: int) -> tuple[int, ...]:
    """A proposer's draft as a tuple of at most ``room`` tokens; raises
    :class:`SpeculativeConfigError` for a token outside the vocabulary."""
    out = tuple(draft)[:room]
    for t in out:
        if not is_token_id(t, vocab_size):
            raise SpeculativeConfigError(
                f"speculative: the proposer drafted token {t!r}, outside the vocabulary "
                f"[0, {vocab_size})"
            )
    return out
