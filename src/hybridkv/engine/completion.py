"""What :class:`~hybridkv.engine.llm_engine.LLMEngine` keeps per request: a running one
(:class:`LiveRequest`) and a finished one (:class:`Completion`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hybridkv.scheduler import FinishReason, SequenceState

__all__ = ["Completion", "LiveRequest"]


@dataclass(frozen=True, kw_only=True)
class Completion:
    """A finished request.

    ``token_ids`` are the generated tokens; ``num_cached_tokens`` the prefix-cache hit of its
    first admission; ``logits[i]`` the float32 logits ``token_ids[i]`` is the argmax of (kept
    only when the engine was built with ``keep_logits=True``, else empty).
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    finish_reason: FinishReason
    num_cached_tokens: int
    num_preemptions: int
    logits: tuple[torch.Tensor, ...] = ()


@dataclass
class LiveRequest:
    """A request the engine is running: its scheduler state, prompt, and the tokens (and
    logits, when kept) sampled so far."""

    seq: SequenceState
    prompt: tuple[int, ...]
    tokens: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
