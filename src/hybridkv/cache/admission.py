"""Which recurrent-state checkpoints are worth their bytes: admission by measured yield.

A checkpoint of a recurrent-state group is a whole state slot (Jamba-v0.1: 15.8 MiB, the KV
of ~1,000 tokens of its attention layers; Nemotron-H-8B: 98 MiB, ~6,000 tokens), saved at an
aligned step end in the hope that a later request hits exactly there.  Where a step ends says
how likely that is, so each candidate gets a *reason*:

* ``junction``: the end of the prefix this request shares with cached ones (a branch point:
  a second request already shared it, so a third is likely to);
* ``prompt_end``: the prompt's last aligned boundary (a resend, or the next turn of a chat);
* ``before_end``: the aligned boundary before that one (the next turn of a chat whose prompt
  differs from this one in its last tokens: a chat template that rewrites the generation
  prompt or drops reasoning, or a trace that records prompts in coarser blocks than the
  alignment); the scheduler ends a prefill chunk there when its
  ``checkpoint_before_end`` is on;
* ``chunk``: the end of a prefill chunk inside the prompt (a later request that diverges
  somewhere past it hits here, short of where it diverges);
* ``decode``: an aligned boundary reached while decoding (the next turn, if it contains the
  output).

Policy ``yield`` (the default): a reason is admitted while the hit tokens its checkpoints
served per byte they occupied is at least the cache's average (every hit's tokens over the
bytes every group published), so a checkpoint is saved only where it is expected to return
more per byte than the KV it displaces.  A reason is admitted unconditionally until it has
:data:`MIN_CHECKPOINTS` published checkpoints on record; a rejected reason still admits the
candidates whose block hash is a multiple of :data:`EXPLORE` (1 in 16, the same decision in
every state group and every run), so its yield keeps being measured.  Every counter halves
each time the groups have published the layout's bytes once over, so the policy follows the
workload.  Policy ``all`` saves a checkpoint at every aligned step end (vLLM's "align" mode).

Measured on the Mooncake conversation trace (2,000 requests, 64 GiB,
``benchmarks/compare_vllm.py``'s scheduler, :meth:`CheckpointAdmission.report` at the end):
Jamba-v0.1 ends with ``junction`` at 71x the average yield, ``prompt_end`` 4.2x, ``chunk``
2.5x and ``decode`` 0 (the trace's next turns do not contain the outputs); Nemotron-H-8B,
whose slot is 6x larger, ``junction`` 44x, ``prompt_end`` 1.3x, ``chunk`` 0.17x, ``decode`` 0.
Hit rates with each policy: docs/vllm.md, section 6.

Counters change only when blocks are published or a hit is taken, never while an allocation
is planned, so every state group of one allocation sees the same decision.
"""

from __future__ import annotations

from typing import Final

__all__ = [
    "CHECKPOINT_ADMISSION",
    "CHECKPOINT_REASONS",
    "CHECKPOINT_WHEN_FULL",
    "EXPLORE",
    "MIN_CHECKPOINTS",
    "TIER_ADMISSION",
    "CheckpointAdmission",
]

#: Admission policies for state checkpoints (see the module doc).
CHECKPOINT_ADMISSION: Final = ("yield", "all")
#: Where state checkpoints the device evicts go: ``"yield"``, a checkpoint whose reason the
#: checkpoint admission would not save now (the same rule, explored hashes included) skips the
#: host tier, to the disk tier if there is one, else it is dropped; ``"all"``: every one goes
#: to the top tier, as any block.
TIER_ADMISSION: Final = ("yield", "all")
#: What a step does when the cache cannot also hold the state checkpoint it would save:
#: ``"refuse"``: the allocation fails (the scheduler preempts or waits), as for any block;
#: ``"skip_minor"``: a running request's step skips a checkpoint whose reason is neither
#: ``junction`` nor ``prompt_end`` (the points later requests most often hit) and runs without
#: it, while a first allocation, and a step saving one of those two, is refused; ``"skip"``:
#: every such checkpoint is skipped.  ``KVCacheManager(checkpoint_when_full=None)`` picks by
#: layout (see :meth:`~hybridkv.cache.coordinator.HybridCoordinator.when_full_default`).
#: Under every mode, a request alone in the cache skips a checkpoint it has no room for:
#: nothing could be preempted to make room, so a refusal would stop it for good.
CHECKPOINT_WHEN_FULL: Final = ("refuse", "skip_minor", "skip")
#: Reason codes, indexed by :meth:`CheckpointAdmission.admits`' ``reason`` (0: untagged).
CHECKPOINT_REASONS: Final = ("", "junction", "prompt_end", "chunk", "decode", "before_end")
JUNCTION, PROMPT_END, CHUNK, DECODE, BEFORE_END = 1, 2, 3, 4, 5
#: A rejected reason still admits the checkpoints whose hash is a multiple of this.
EXPLORE: Final = 16
#: Checkpoints of a reason on record before its yield decides.
MIN_CHECKPOINTS: Final = 8


class CheckpointAdmission:
    """Per-reason yield bookkeeping shared by every group of one coordinator.

    ``turnover_bytes``: published bytes between two halvings of every counter (the layout's
    total bytes); ``min_checkpoints`` and ``explore``: see :data:`MIN_CHECKPOINTS` and
    :data:`EXPLORE`.
    """

    __slots__ = (
        "checkpoint_bytes",
        "checkpoints",
        "explore",
        "hit_tokens",
        "min_checkpoints",
        "since_decay",
        "total_bytes",
        "total_hits",
        "turnover_bytes",
        "warm",
    )

    def __init__(
        self,
        turnover_bytes: int,
        *,
        min_checkpoints: int = MIN_CHECKPOINTS,
        explore: int = EXPLORE,
    ) -> None:
        n = len(CHECKPOINT_REASONS)
        self.min_checkpoints = min_checkpoints
        self.explore = max(1, explore)
        self.turnover_bytes = max(1, turnover_bytes)
        self.checkpoints = [0.0] * n
        self.checkpoint_bytes = [0.0] * n
        self.hit_tokens = [0.0] * n
        self.total_bytes = 0.0
        self.total_hits = 0.0
        self.since_decay = 0
        #: False until the groups published the layout's bytes once (the first halving): a
        #: checkpoint cannot be hit before later requests arrive, so none is judged sooner.
        self.warm = False

    def admits(self, reason: int, block_hash: int) -> bool:
        """Whether a checkpoint for ``reason`` ending at the block ``block_hash`` is saved."""
        if not self.warm or self.checkpoints[reason] < self.min_checkpoints:
            return True
        # yield_reason >= average yield, cross-multiplied (no division by zero)
        if (
            self.hit_tokens[reason] * self.total_bytes
            >= self.total_hits * self.checkpoint_bytes[reason]
        ):
            return True
        return block_hash % self.explore == 0

    def published(self, nbytes: int) -> None:
        """Any group published ``nbytes`` of blocks to the prefix cache."""
        self.total_bytes += nbytes
        self.since_decay += nbytes
        if self.since_decay >= self.turnover_bytes:
            self.since_decay = 0
            self._halve()

    def checkpoint_published(self, reason: int, nbytes: int, whole: bool = True) -> None:
        """A checkpoint of ``reason`` (``nbytes``) joined the prefix cache; ``whole``: False
        for every part but one of a checkpoint stored in parts (one per state group), which
        adds its bytes but is not counted again."""
        self.checkpoints[reason] += whole
        self.checkpoint_bytes[reason] += nbytes

    def hit(self, tokens: int) -> None:
        """A request was admitted with a prefix hit of ``tokens`` (counted once)."""
        self.total_hits += tokens

    def checkpoint_hit(self, reason: int, tokens: int) -> None:
        """A hit of ``tokens`` restored a checkpoint of ``reason``."""
        self.hit_tokens[reason] += tokens

    def _halve(self) -> None:
        self.warm = True
        for xs in (self.checkpoints, self.checkpoint_bytes, self.hit_tokens):
            for i in range(len(xs)):
                xs[i] *= 0.5
        self.total_bytes *= 0.5
        self.total_hits *= 0.5

    def report(self) -> dict[str, dict[str, float | bool]]:
        """Per reason: checkpoints and bytes on record, hit tokens, yield relative to the
        average (1.0 = average; None-free: 0 without data) and whether it is admitted now."""
        avg = self.total_hits / self.total_bytes if self.total_bytes else 0.0
        out: dict[str, dict[str, float | bool]] = {}
        for r, name in enumerate(CHECKPOINT_REASONS):
            if not r:
                continue
            cb = self.checkpoint_bytes[r]
            y = self.hit_tokens[r] / cb if cb else 0.0
            out[name] = {
                "checkpoints": self.checkpoints[r],
                "bytes": cb,
                "hit_tokens": self.hit_tokens[r],
                "relative_yield": y / avg if avg else 0.0,
                "admitted": not self.warm or self.checkpoints[r] < self.min_checkpoints or y >= avg,
            }
        return out
