"""Test support: transformers' own greedy decoding, the oracle the paged runner must match.

:func:`reference_generate` is ``generate(do_sample=False)`` on one unpadded prompt, exactly
``max_new_tokens`` tokens; :func:`reference_chunked` decodes with transformers'
``DynamicCache``, prefilling a fixed number of prompt tokens per forward pass.  Both return a
:class:`~hybridkv.engine.generate.Generation` (tokens and the logits each was chosen from, on
the model's device), so a paged run can be compared token for token.  (The engine's own check,
:func:`hybridkv.engine.verify.greedy_reference`, also stops at end-of-sequence ids and returns
CPU logits.)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hybridkv.engine.generate import Generation

__all__ = ["reference_chunked", "reference_generate"]


def reference_generate(model: Any, prompt: Sequence[int], max_new_tokens: int) -> Generation:
    """transformers' greedy ``generate`` on ``prompt`` (batch of one, no padding)."""
    device = next(model.parameters()).device
    ids = torch.tensor([list(prompt)], dtype=torch.long, device=device)
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    tokens = [int(t) for t in out.sequences[0, len(prompt) :]]
    return Generation(tokens, [lg[0].float() for lg in out.logits])


def reference_chunked(
    model: Any, prompt: Sequence[int], chunk_size: int, max_new_tokens: int
) -> Generation:
    """Greedy decoding with transformers' own ``DynamicCache``, prefilling ``chunk_size``
    prompt tokens per forward pass.

    Same arithmetic as a chunked paged run, so it isolates paging from the (small) numeric
    difference some mixers show between chunked and whole-prompt prefill (gated DeltaNet's
    chunked scan: ~1e-4 in the first logits).
    """
    from transformers import DynamicCache

    from hybridkv.engine.probe import cache_argument

    device = next(model.parameters()).device
    cache = DynamicCache(config=model.config)
    tokens: list[int] = []
    logits: list[torch.Tensor] = []
    feed, done = list(prompt), 0
    with torch.no_grad():
        while len(tokens) < max_new_tokens:
            step = feed[done : done + chunk_size] if done < len(prompt) else feed[done:]
            out = model(
                input_ids=torch.tensor([step], device=device),
                position_ids=torch.arange(done, done + len(step), device=device)[None],
                use_cache=True,
                **{cache_argument(model): cache},
            )
            done += len(step)
            if done < len(prompt):
                continue
            last = out.logits[0, -1].float()
            logits.append(last)
            tokens.append(int(last.argmax()))
            feed.append(tokens[-1])
    return Generation(tokens, logits)
