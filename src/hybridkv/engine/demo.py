"""The workload of ``hybridkv run``: shared-prefix prompts admitted in waves.

:func:`shared_prefix_prompts` makes ``n`` prompts that share their first ``shared_prefix``
tokens (a system prompt) and end in distinct suffixes of mixed lengths.
:func:`run_in_waves` feeds prompts to an :class:`~hybridkv.engine.llm_engine.LLMEngine` in
waves: wave ``k + 1`` is admitted as soon as every request of wave ``k`` has produced its first
token, so later waves find the shared prefix computed and cached (prefix hits in every group,
state checkpoints included) while the earlier waves are still decoding (continuous batching
across waves).  Nothing here prints; progress goes to an optional callback.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from hybridkv.engine.errors import PromptError
from hybridkv.engine.llm_engine import Completion, LLMEngine

__all__ = [
    "DEFAULT_SHARED_PREFIX",
    "SUFFIX_KINDS",
    "run_in_waves",
    "shared_prefix_prompts",
    "suffix_length",
]

#: Tokens every default prompt shares (a multiple of the default 16-token alignment).
DEFAULT_SHARED_PREFIX = 32


def shared_prefix_prompts(
    num_requests: int, *, vocab_size: int, shared_prefix: int = DEFAULT_SHARED_PREFIX, seed: int = 0
) -> list[list[int]]:
    """``num_requests`` prompts of seeded random token ids: the same ``shared_prefix`` tokens,
    then a suffix of :func:`suffix_length` ``(i)`` tokens of their own.  Raises :class:`PromptError`
    for a non-positive count or a negative prefix."""
    if num_requests < 1 or shared_prefix < 0 or vocab_size < 1:
        raise PromptError(
            f"prompts: num_requests must be >= 1, shared_prefix >= 0 and vocab_size >= 1, got "
            f"{num_requests}, {shared_prefix}, {vocab_size}"
        )
    gen = torch.Generator().manual_seed(seed)

    def tokens(n: int) -> list[int]:
        return [int(t) for t in torch.randint(0, vocab_size, (n,), generator=gen)]

    prefix = tokens(shared_prefix)
    return [prefix + tokens(suffix_length(i)) for i in range(num_requests)]


#: The generated prompts' suffixes come in this many lengths (:func:`suffix_length`).
SUFFIX_KINDS = 4


def suffix_length(i: int) -> int:
    """The length of generated prompt ``i``'s own suffix: 4, 7, 10, 13, 4, ..."""
    return 4 + 3 * (i % SUFFIX_KINDS)


def run_in_waves(
    engine: LLMEngine,
    prompts: Sequence[Sequence[int]],
    *,
    max_tokens: int,
    waves: int = 2,
    eos_token_ids: Sequence[int] = (),
    progress: Callable[[int, int], None] | None = None,
) -> list[Completion]:
    """Run ``prompts`` (ids ``r0``, ``r1``, ...) through ``engine`` in ``waves`` waves of
    nearly equal size (sizes differ by at most one; at most one wave per prompt; see the
    module docstring) and return their completions in order.

    Every prompt is checked (:meth:`LLMEngine.check_prompt`) before the first is queued, so a
    bad prompt raises :class:`PromptError` with nothing run.  ``progress(done, total)`` is
    called after every step with the tokens generated so far (a finished request counts as
    all it could make) and the most there can be.
    """
    if waves < 1 or max_tokens < 1 or not prompts:
        raise PromptError(
            f"run: waves and max_tokens must be >= 1 and there must be prompts, got {waves}, "
            f"{max_tokens}, {len(prompts)} prompts"
        )
    ids = [f"r{i}" for i in range(len(prompts))]
    checked = [engine.check_prompt(rid, p) for rid, p in zip(ids, prompts, strict=True)]
    n, waves = len(prompts), min(waves, len(prompts))  # exactly ``waves``: none empty
    cuts = [-(-w * n // waves) for w in range(waves + 1)]  # earlier waves the larger
    pending = [list(range(cuts[w], cuts[w + 1])) for w in range(waves)]
    # what each request can generate: max_tokens, or less where max_model_len stops it
    most = {
        rid: max(1, min(max_tokens, engine.max_model_len - len(p)))
        for rid, p in zip(ids, checked, strict=True)
    }
    total = sum(most.values())
    produced: dict[str, int] = {}
    current: list[int] = []
    while pending or engine.has_unfinished():
        if pending and all(produced.get(ids[i], 0) > 0 for i in current):
            current = pending.pop(0)
            for i in current:
                engine.add_request(
                    ids[i], checked[i], max_tokens=max_tokens, eos_token_ids=eos_token_ids
                )
        for out in engine.step():
            rid = out.request_id
            # a finished request (end of sequence, its limit) has made all it will make
            produced[rid] = (
                most[rid] if out.finished else produced.get(rid, 0) + len(out.new_token_ids)
            )
        if progress is not None:
            progress(min(sum(produced.values()), total), total)
    return [engine.completions[rid] for rid in ids]
