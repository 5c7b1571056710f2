"""Argument checks of :class:`~hybridkv.engine.llm_engine.LLMEngine`: the constructor's
arguments, a request's token sequences, and which models cannot resume a prefill.

Each check raises the typed error of the argument's layer before anything is loaded or
queued, with a message that names the argument, the value and what would be valid.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from hybridkv.engine.cache_config import CacheConfig
from hybridkv.engine.errors import (
    BindingError,
    EngineError,
    ModelSourceError,
    PromptError,
    SpeculativeConfigError,
)
from hybridkv.engine.model_source import is_token_id, position_limit
from hybridkv.engine.speculative import SpeculativeConfig, no_drafts
from hybridkv.errors import PlanError
from hybridkv.scheduler import SchedulerConfig, SchedulerError
from hybridkv.specs import ModelSpec, StateMixer, StateSpec

__all__ = [
    "check_engine_args",
    "check_eos",
    "check_max_tokens",
    "check_positions",
    "check_speculation",
    "resumes_no_prefill",
    "token_tuple",
]


def check_engine_args(
    model: object, cache: object, scheduler: object, seed: object, speculative: object
) -> None:
    """Typed errors for :class:`LLMEngine` arguments of the wrong type (before anything is
    loaded): :class:`ModelSourceError` for ``model``, :class:`PlanError` for ``cache``,
    :class:`~hybridkv.scheduler.SchedulerError` for ``scheduler``, :class:`EngineError` for
    ``seed`` and :class:`SpeculativeConfigError` for ``speculative``."""
    if not isinstance(model, (str, Path, torch.nn.Module)):
        raise ModelSourceError(
            f"model: expected a tiny model's name, a checkpoint directory or a loaded "
            f"torch.nn.Module, got {type(model).__name__}"
        )
    if cache is not None and not isinstance(cache, CacheConfig):
        raise PlanError(f"cache: expected a CacheConfig (or None), got {type(cache).__name__}")
    if scheduler is not None and not isinstance(scheduler, SchedulerConfig):
        raise SchedulerError(
            f"scheduler: expected a SchedulerConfig (or None), got {type(scheduler).__name__}"
        )
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 1 << 63:
        raise EngineError(f"seed: must be an integer in [0, 2^63), got {seed!r}")
    if speculative is not None and not isinstance(speculative, SpeculativeConfig):
        raise SpeculativeConfigError(
            f"speculative: expected a SpeculativeConfig (or None), got {speculative!r}"[:300]
        )


def check_positions(name: str, config: Any, max_model_len: int | None) -> None:
    """A :class:`BindingError` for a ``CacheConfig.max_model_len`` beyond the positions the
    model (transformers ``config``) was made for."""
    limit = position_limit(config)
    if max_model_len is not None and limit is not None and max_model_len > limit:
        raise BindingError(
            f"max_model_len: {max_model_len} is above {name}'s own limit of {limit} positions "
            "(max_position_embeddings); give at most that"
        )


def check_speculation(name: str, spec: ModelSpec, whole_prefill: bool) -> None:
    """Refuse speculative decoding where no draft could be verified: a model whose prefill
    cannot resume (:func:`resumes_no_prefill`), or a scheduler that computes every prompt
    whole (``whole_prefill`` the caller set)."""
    if resumes_no_prefill(spec):
        raise no_drafts(name)
    if whole_prefill:
        raise SpeculativeConfigError(
            "speculative: drafts are verified by multi-token passes that resume a "
            "request, and SchedulerConfig(whole_prefill=True) computes every prompt "
            "whole; leave whole_prefill off to speculate"
        )


def token_tuple(request_id: str, value: object, what: str) -> tuple[Any, ...]:
    """``value`` as a tuple, or a :class:`PromptError` (``request {id}: {what} a sequence of
    token ids, got ...``) for a string, bytes or a non-iterable."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise PromptError(
            f"request {request_id!r}: {what} a sequence of token ids, got "
            f"{type(value).__name__} {value!r}"[:300]
        )
    return tuple(value)


def check_eos(request_id: str, eos_token_ids: object, vocab_size: int) -> tuple[int, ...]:
    """``eos_token_ids`` as a tuple of token ids of the vocabulary ``[0, vocab_size)``, or a
    :class:`PromptError` naming the request and the bad value."""
    eos = token_tuple(request_id, eos_token_ids, "eos_token_ids must be")
    for t in eos:
        if not is_token_id(t, vocab_size):
            raise PromptError(
                f"request {request_id!r}: eos_token_ids: {t!r} is not a token id of the "
                f"vocabulary [0, {vocab_size})"
            )
    return eos


def check_max_tokens(request_id: str, max_tokens: object) -> int:
    """``max_tokens`` if it is an integer >= 1, else a :class:`PromptError`."""
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise PromptError(
            f"request {request_id!r}: max_tokens must be an integer >= 1, got {max_tokens!r}"
        )
    return max_tokens


def resumes_no_prefill(spec: ModelSpec) -> bool:
    """Whether ``spec`` has a recurrent state transformers cannot continue a prefill from: its
    Mamba1 mixer (Jamba) runs a multi-token pass from a zero state, using the cached state only
    for one-token decode steps."""
    return any(
        isinstance(c, StateSpec) and c.mixer is StateMixer.MAMBA1
        for layer in spec.layers
        for c in layer.caches
    )
