"""Test support: greedy decoding of several requests through the paged runner, no scheduler.

:class:`PagedGenerator` is a minimal continuous-batching loop: every step, each active request
contributes its next prefill chunk (``chunk_size`` prompt tokens, or the rest of the prompt) or
its last sampled token, all in one :class:`~hybridkv.engine.batch.StepBatch`; a
:class:`StepCache` (:class:`support.toy_cache.ToyCache` or
:class:`support.manager_cache.ManagerCache`) allocates and recycles blocks; the next token is
the argmax of the step's logits.  Results are :class:`~hybridkv.engine.generate.Generation`
objects, comparable token for token with :mod:`support.reference`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from hybridkv.engine.batch import RequestStep, StepBatch
from hybridkv.engine.errors import BatchError
from hybridkv.engine.generate import Generation
from hybridkv.engine.runner import ModelRunner, StepOutput

__all__ = ["PagedGenerator", "StepCache"]


class StepCache(Protocol):
    """The block bookkeeping a :class:`PagedGenerator` drives: the toy cache
    (:class:`support.toy_cache.ToyCache`) or the real manager
    (:class:`support.manager_cache.ManagerCache`)."""

    def add(
        self,
        request_id: str,
        prompt: Sequence[int] = (),
        *,
        prefix_of: str | None = None,
        prefix_len: int = 0,
    ) -> int:
        """Admit a request; returns how many of its tokens are already computed."""
        ...

    def num_computed(self, request_id: str) -> int: ...

    def schedule(self, request_id: str, token_ids: Sequence[int]) -> RequestStep:
        """Reserve what the next ``token_ids`` need and describe the step."""
        ...

    def commit(self, step: RequestStep, new_token: int | None = None) -> None:
        """Record that ``step`` ran (and the token it sampled)."""
        ...

    def free(self, request_id: str) -> None: ...


@dataclass
class _Active:
    request_id: str
    prompt: list[int]
    max_new_tokens: int
    chunk_size: int | None
    generated: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)


class PagedGenerator:
    """Greedy decoding of several requests at once through ``runner`` (see module docstring).

    ``cache`` must be built over the runner's layout (and views, to poison freed blocks).
    """

    def __init__(self, runner: ModelRunner, cache: StepCache) -> None:
        self.runner = runner
        self.cache = cache
        self._active: dict[str, _Active] = {}
        self.results: dict[str, Generation] = {}
        #: Every step's batch and output, in order (for inspection).
        self.batches: list[StepBatch] = []
        self.steps: list[StepOutput] = []

    def add(
        self,
        request_id: str,
        prompt: Sequence[int],
        max_new_tokens: int,
        *,
        chunk_size: int | None = None,
        prefix_of: str | None = None,
        prefix_len: int = 0,
    ) -> None:
        """Queue a request; with ``prefix_of`` it reuses that request's first ``prefix_len``
        cached tokens (which must equal its own).  Raises :class:`BatchError` for an empty
        prompt, ``max_new_tokens < 1``, ``chunk_size < 1``, a prefix covering the whole prompt
        or differing from the source's tokens."""
        prompt = list(prompt)
        if not prompt or max_new_tokens < 1 or (chunk_size is not None and chunk_size < 1):
            raise BatchError(
                f"generate: request {request_id!r} needs a non-empty prompt, max_new_tokens "
                f">= 1 and chunk_size >= 1, got {len(prompt)} tokens, {max_new_tokens}, "
                f"{chunk_size}"
            )
        if prefix_of is not None:
            src = self._active.get(prefix_of)
            seen = None if src is None else (src.prompt + src.generated)[:prefix_len]
            if prefix_len >= len(prompt) or seen != prompt[:prefix_len]:
                raise BatchError(
                    f"generate: request {request_id!r} cannot reuse {prefix_len} tokens of "
                    f"{prefix_of!r}: the prefix must be shorter than the prompt and equal to "
                    "the source's tokens"
                )
        self.cache.add(request_id, prompt, prefix_of=prefix_of, prefix_len=prefix_len)
        self._active[request_id] = _Active(request_id, prompt, max_new_tokens, chunk_size)

    @property
    def done(self) -> bool:
        return not self._active

    @property
    def active(self) -> tuple[str, ...]:
        """Ids of the requests still generating."""
        return tuple(self._active)

    def _next_tokens(self, req: _Active) -> list[int]:
        computed = self.cache.num_computed(req.request_id)
        if computed < len(req.prompt):
            stop = len(req.prompt) if req.chunk_size is None else computed + req.chunk_size
            return req.prompt[computed : min(stop, len(req.prompt))]
        return [req.generated[-1]]

    def step(self) -> StepOutput:
        """Run one step of every active request; finished requests are freed."""
        steps: list[RequestStep] = [
            self.cache.schedule(req.request_id, self._next_tokens(req))
            for req in self._active.values()
        ]
        batch = StepBatch(requests=tuple(steps))
        out = self.runner.execute(batch)
        self.batches.append(batch)
        for s in steps:
            req = self._active[s.request_id]
            if s.end < len(req.prompt):
                self.cache.commit(s)
                continue
            logits = out.logits[s.request_id]
            req.generated.append(int(logits.argmax()))
            req.logits.append(logits)
            self.cache.commit(s, req.generated[-1])
            if len(req.generated) == req.max_new_tokens:
                self.results[s.request_id] = Generation(req.generated, req.logits)
                self.cache.free(s.request_id)
                del self._active[s.request_id]
        self.steps.append(out)
        return out

    def run(self) -> dict[str, Generation]:
        """Step until every request finished; returns all results so far."""
        while not self.done:
            self.step()
        return self.results
