"""Paged attention plugged into transformers through ``AttentionInterface``.

A model loaded with ``attn_implementation=PAGED_ATTENTION`` calls :func:`paged_attention_forward`
from every attention module with post-RoPE ``query`` ``[B, H, L, D]`` and, for ordinary
attention layers, the ``key`` / ``value`` of the new tokens only ``[B, Hkv, L, D]`` (the
runner's cache layers pass them through).  The function hands them to the *active step*: the
:class:`AttentionStep` the runner installs around ``model(...)`` with :func:`active_step`.  The
step writes the new K/V into the paged views and attends over the gathered keys; transformers
builds no mask for an unknown implementation name (``attention_mask`` is ``None``), so the step
builds its own.  MLA layers are different: the cache layer already gathered the latent of every
visible token, so ``key`` / ``value`` hold the expanded visible keys (see
:mod:`hybridkv.engine.hf_cache`).

:func:`attend` is the math, matched to transformers' eager attention: GQA by repeating KV heads
(query head ``h`` reads KV head ``h // (H // Hkv)``), ``scores = q k^T * scaling``, optional
softcap ``tanh(s / c) * c``, masked positions at ``-inf``, optional learned sinks (gpt-oss
``s_aux``: one extra logit per head, in the softmax but not in the output), softmax in float32,
dropout 0.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Protocol

import torch

from hybridkv.engine.errors import EngineError, NoActiveStepError

__all__ = [
    "PAGED_ATTENTION",
    "AttentionStep",
    "active_step",
    "attend",
    "current_step",
    "paged_attention_forward",
    "register_paged_attention",
]

#: The ``attn_implementation`` name the runner registers and sets on its model.
PAGED_ATTENTION = "hybridkv_paged"


class AttentionStep(Protocol):
    """What the attention function calls into while a step (or a probe) is active."""

    def attention(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        scaling: float,
        softcap: float | None,
        sinks: torch.Tensor | None,
        sliding_window: int | None,
    ) -> torch.Tensor:
        """Return the attention output ``[B, L, H, Dv]`` of layer ``module.layer_idx``."""
        ...


_ACTIVE: ContextVar[AttentionStep | None] = ContextVar("hybridkv_attention_step", default=None)


@contextmanager
def active_step(step: AttentionStep) -> Iterator[None]:
    """Install ``step`` for the attention calls made inside the ``with`` block."""
    token = _ACTIVE.set(step)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def current_step() -> AttentionStep:
    """The active step; raises :class:`NoActiveStepError` outside :func:`active_step`."""
    step = _ACTIVE.get()
    if step is None:
        raise NoActiveStepError(
            f"attention: a model using attn_implementation={PAGED_ATTENTION!r} was called "
            "outside ModelRunner.execute; run it through the runner, or load it with another "
            "attn_implementation"
        )
    return step


def attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor,
    *,
    scaling: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one request over its gathered keys, or of a batch of requests.

    ``query`` ``[*B, H, T, D]``, ``key`` ``[*B, Hkv, S, D]``, ``value`` ``[*B, Hkv, S, Dv]``,
    ``mask`` ``[*B, T, S]`` bool (True = may read), ``sinks`` ``[H]``; ``*B`` is empty or one
    batch dimension.  Returns ``[*B, T, H, Dv]`` in the query dtype.  Every query must see at
    least one key; keys nobody sees (padding) must hold finite values.
    """
    heads, kv_heads = query.shape[-3], key.shape[-3]
    if heads != kv_heads:
        rep = heads // kv_heads
        key = key.repeat_interleave(rep, dim=-3)
        value = value.repeat_interleave(rep, dim=-3)
    scores = torch.matmul(query, key.transpose(-1, -2)) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask.unsqueeze(-3), float("-inf"))
    if sinks is not None:
        sink = sinks.to(scores.dtype).reshape(heads, 1, 1).expand(*scores.shape[:-1], 1)
        logits = torch.cat([scores, sink], dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = torch.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    out = torch.matmul(probs.to(value.dtype), value)
    return out.transpose(-3, -2).to(query.dtype)


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The ``AttentionInterface`` entry point (see the module docstring).

    Returns ``(output [B, L, H, Dv], None)``.  ``attention_mask`` must be ``None``: the step
    builds the mask from the block tables.  Raises :class:`NoActiveStepError` outside a step.
    """
    step = current_step()
    if attention_mask is not None:
        raise EngineError(
            "attention: got a prepared attention_mask; the paged attention builds its own mask "
            "and needs attention_mask=None (do not pass one to the model)"
        )
    if dropout:
        raise EngineError(f"attention: dropout must be 0 at inference, got {dropout}")
    scale = float(query.shape[-1] ** -0.5 if scaling is None else scaling)
    softcap = kwargs.get("softcap")
    sinks = kwargs.get("s_aux")
    window = kwargs.get("sliding_window")
    return (
        step.attention(
            module,
            query,
            key,
            value,
            scaling=scale,
            softcap=None if softcap is None else float(softcap),
            sinks=sinks,
            sliding_window=None if window is None else int(window),
        ),
        None,
    )


def register_paged_attention() -> None:
    """Register :func:`paged_attention_forward` as :data:`PAGED_ATTENTION` (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(PAGED_ATTENTION, paged_attention_forward)
