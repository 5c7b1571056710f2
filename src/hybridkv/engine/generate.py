"""The result of greedy generation: tokens and the logits each was chosen from.

:class:`Generation` is what :func:`~hybridkv.engine.verify.greedy_reference` (transformers'
own ``generate``) returns, so an engine's output can be compared with it token for token.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["Generation"]


class Generation(NamedTuple):
    """Generated tokens and, per token, the float32 logits it was the argmax of."""

    tokens: list[int]
    logits: list[torch.Tensor]
