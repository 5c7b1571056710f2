"""Check finished requests against transformers' own greedy ``generate``.

For every :class:`~hybridkv.engine.llm_engine.Completion`, :func:`verify_completions` runs
the reference model's ``generate`` on the prompt alone (batch of one, no padding, greedy, the
same end-of-sequence ids, as many new tokens as the engine produced) and reports the first
position where the tokens differ.  When the completion kept its logits, the largest absolute
logit difference is reported too (informational: tokens decide the verdict, since a batch of
several requests legitimately moves fp32 logits by ~1e-4 in some architectures).

The reference model must have transformers' own attention (take it with
:func:`~hybridkv.engine.models.reference_copy` before the engine switches the model).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from hybridkv.engine.errors import EngineError
from hybridkv.engine.generate import Generation
from hybridkv.engine.llm_engine import Completion

__all__ = [
    "Mismatch",
    "VerifyResult",
    "greedy_reference",
    "sink_masks",
    "sink_reference",
    "verify_completions",
]


class Mismatch(NamedTuple):
    """Request ``request_id`` first differs at output position ``position``: the engine
    produced ``got``, transformers ``want`` (``None`` where one of them had already stopped)."""

    request_id: str
    position: int
    got: int | None
    want: int | None


@dataclass(frozen=True, kw_only=True)
class VerifyResult:
    """Outcome of :func:`verify_completions`.  ``max_logit_diff`` is None when no completion
    kept logits."""

    num_requests: int
    num_tokens: int
    mismatches: tuple[Mismatch, ...]
    max_logit_diff: float | None

    @property
    def ok(self) -> bool:
        """True when every request's tokens equal transformers'."""
        return not self.mismatches


def greedy_reference(
    model: Any, prompt: Sequence[int], max_new_tokens: int, eos_token_ids: Sequence[int] = ()
) -> Generation:
    """transformers' greedy ``generate`` on ``prompt`` alone: at most ``max_new_tokens``
    tokens, stopping early at any of ``eos_token_ids``.  A fresh generation config is used,
    so a checkpoint's sampling or repetition settings do not apply."""
    from transformers import GenerationConfig

    device = next(model.parameters()).device
    ids = torch.tensor([list(prompt)], dtype=torch.long, device=device)
    eos = list(eos_token_ids)
    config = GenerationConfig(  # type: ignore[no-untyped-call]
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=eos or None,
        pad_token_id=eos[0] if eos else 0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    tokens = [int(t) for t in out.sequences[0, len(prompt) :]]
    return Generation(tokens, [lg[0].float().cpu() for lg in out.logits][: len(tokens)])


def sink_masks(config: Any, length: int, sink_tokens: int) -> dict[str, torch.Tensor]:
    """Additive float masks ``[1, 1, length, length]`` per layer type of a model whose
    sliding-window layers also read the first ``sink_tokens`` tokens (StreamingLLM sinks):
    ``full_attention`` causal, ``sliding_attention`` causal within the window or on a sink.

    transformers models with ``layer_types`` take such a mapping as ``attention_mask``.
    Raises :class:`~hybridkv.engine.errors.EngineError` for a config without sliding-window
    layers or with a layer type these masks do not cover.
    """
    text = config.get_text_config(decoder=True)
    window = getattr(text, "sliding_window", None)
    types = set(getattr(text, "layer_types", None) or ())
    if not isinstance(window, int) or "sliding_attention" not in types:
        raise EngineError(
            f"sink_masks: model_type {text.model_type!r} has no sliding_attention layers with a "
            "sliding_window to add sinks to"
        )
    other = types - {"full_attention", "sliding_attention"}
    if other:
        raise EngineError(
            f"sink_masks: layer types {sorted(other)} of {text.model_type!r} take no explicit "
            "mask; the sink reference covers full_attention and sliding_attention only"
        )
    q = torch.arange(length)[:, None]
    k = torch.arange(length)[None, :]
    causal = k <= q
    sliding = causal & ((k > q - window) | (k < sink_tokens))
    low = torch.finfo(torch.float32).min

    def additive(allowed: torch.Tensor) -> torch.Tensor:
        return torch.where(allowed, 0.0, low)[None, None]

    return {"full_attention": additive(causal), "sliding_attention": additive(sliding)}


def sink_reference(
    model: Any,
    prompt: Sequence[int],
    max_new_tokens: int,
    sink_tokens: int,
    eos_token_ids: Sequence[int] = (),
) -> Generation:
    """Greedy decoding of ``model`` with StreamingLLM sinks on its sliding-window layers:
    every step runs the whole sequence again with :func:`sink_masks` (no cache at all, so
    nothing but the mask is shared with the engine's paged path)."""
    device = next(model.parameters()).device
    seq = list(prompt)
    tokens: list[int] = []
    logits: list[torch.Tensor] = []
    eos = set(eos_token_ids)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            masks = sink_masks(model.config, len(seq), sink_tokens)
            out = model(
                input_ids=torch.tensor([seq], dtype=torch.long, device=device),
                attention_mask={k: v.to(device) for k, v in masks.items()},
                use_cache=False,
            )
            last = out.logits[0, -1].float().cpu()
            token = int(last.argmax())
            tokens.append(token)
            logits.append(last)
            seq.append(token)
            if token in eos:
                break
    return Generation(tokens, logits)


def _first_difference(request_id: str, got: Sequence[int], want: Sequence[int]) -> Mismatch | None:
    for i in range(max(len(got), len(want))):
        a = got[i] if i < len(got) else None
        b = want[i] if i < len(want) else None
        if a != b:
            return Mismatch(request_id, i, a, b)
    return None


def verify_completions(
    reference: Any,
    completions: Sequence[Completion],
    eos_token_ids: Sequence[int] = (),
    *,
    sink_tokens: int = 0,
) -> VerifyResult:
    """Compare every completion with :func:`greedy_reference` (see the module docstring), or
    with :func:`sink_reference` for an engine with ``attention_sinks=sink_tokens``.
    Reads only; runs one ``generate`` per completion."""
    mismatches: list[Mismatch] = []
    diff: float | None = None
    tokens = 0
    for c in completions:
        n = len(c.token_ids)
        want = (
            sink_reference(reference, c.prompt_token_ids, n, sink_tokens, eos_token_ids)
            if sink_tokens
            else greedy_reference(reference, c.prompt_token_ids, n, eos_token_ids)
        )
        tokens += len(c.token_ids)
        found = _first_difference(c.request_id, c.token_ids, want.tokens)
        if found is not None:
            mismatches.append(found)
        for got, ref in zip(c.logits, want.logits, strict=False):
            d = float((got.float() - ref).abs().max())
            diff = d if diff is None else max(diff, d)
    return VerifyResult(
        num_requests=len(completions),
        num_tokens=tokens,
        mismatches=tuple(mismatches),
        max_logit_diff=diff,
    )
