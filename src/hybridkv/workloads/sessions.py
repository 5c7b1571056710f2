"""Which requests of a workload a later request continues: an oracle for protected sessions.

A request *continues* an earlier one when its prompt starts with more than half of the
earlier one's prompt, reads a block the earlier request introduced (beyond the prefix that
request itself shared with the requests before it), and either reads the earlier one's whole
prompt (as far as the workload's ``source_block`` resolves it) or leaves it at a block no other
request leaves it at: the next turn of a conversation, a resend, a second question on a
document only those two read.  A prefix that two or more requests read and then leave at the
same block is a shared start (a system prompt, a popular document) and continues nothing,
even for the request that brought it.  The first request that continues an earlier one is its
*successor*, and a chain of successors is one session.  :func:`continuations` reads that off
a whole workload, so it knows the future: :mod:`hybridkv.sim` uses it to play a client that
knows which conversations go on (``simulate --protect oracle``,
:meth:`~hybridkv.cache.manager.KVCacheManager.protect`), the most that client hints can add,
next to the plain recency order that knows nothing.

Standard library only.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from hybridkv.workloads.types import WorkloadError

__all__ = ["Continuation", "continuations"]


class _Request(Protocol):
    @property
    def request_id(self) -> str: ...

    @property
    def prompt_token_ids(self) -> tuple[int, ...]: ...

    @property
    def output_token_ids(self) -> tuple[int, ...]: ...


@dataclass(frozen=True, slots=True)
class Continuation:
    """One request's place in its session: the session's name (its first request's id) and
    the request that continues it (None: the session ends here)."""

    session: str
    successor: str | None


def _keys(tokens: Sequence[int], block_size: int) -> list[int]:
    """Chained keys of ``tokens``' whole blocks of ``block_size``."""
    keys, key = [], 0
    for b in range(len(tokens) // block_size):
        key = hash((key, tuple(tokens[b * block_size : (b + 1) * block_size])))
        keys.append(key)
    return keys


def continuations(
    requests: Iterable[_Request], block_size: int = 16, *, source_block: int = 1
) -> dict[str, Continuation]:
    """Per request id, its session and successor (see the module doc), matching prompts at
    ``block_size`` granularity in arrival order (``source_block``: the workload's own, see
    :attr:`~hybridkv.workloads.types.Workload.source_block`).  Raises :class:`WorkloadError`
    for a block size below 1 or a repeated request id."""
    if not isinstance(block_size, int) or block_size < 1:
        raise WorkloadError(f"continuations: block_size must be >= 1, got {block_size!r}")
    if not isinstance(source_block, int) or source_block < 1:
        raise WorkloadError(f"continuations: source_block must be >= 1, got {source_block!r}")
    # First pass: where each request's match with the requests before it ends (the key of its
    # last matched block, and the request that held it last), and how many requests' matches
    # end at each key: a prefix two or more later requests share and leave at the same block
    # is a shared start (a system prompt, a document), not one conversation's history.
    owner: dict[int, int] = {}  # block key -> index of the latest request holding it
    ids: list[str] = []
    seen: set[str] = set()
    matched: list[int] = []  # per request: its whole prompt blocks an earlier request held
    ends: list[int] = []  # per request: the key its match ends at (-1: no match; no hash is)
    end_count: dict[int, int] = {}
    held_by: list[int] = []  # per request: who held its last matched block (-1: nobody)
    prompt_lens: list[int] = []
    for j, r in enumerate(requests):
        if r.request_id in seen:
            raise WorkloadError(f"continuations: request id {r.request_id!r} repeats")
        seen.add(r.request_id)
        ids.append(r.request_id)
        prompt = tuple(r.prompt_token_ids)
        keys = _keys(prompt + tuple(r.output_token_ids), block_size)
        hittable = len(prompt) // block_size
        k = 0
        while k < hittable and keys[k] in owner:
            k += 1
        matched.append(k)
        prompt_lens.append(len(prompt))
        end = keys[k - 1] if k else -1
        ends.append(end)
        end_count[end] = end_count.get(end, 0) + 1
        held_by.append(owner[end] if k else -1)
        for key in keys:
            owner[key] = j
    # Second pass: link in arrival order.
    whole = [n // source_block * source_block // block_size for n in prompt_lens]
    successor: list[int | None] = []
    session: list[str] = []
    for j, rid in enumerate(ids):
        k, i, name = matched[j], held_by[j], rid
        if (
            i >= 0
            and k > matched[i]  # past what the earlier request shared with those before it
            and 2 * k * block_size > prompt_lens[i]
            and successor[i] is None
            # its whole prompt, or a point no other request leaves it at
            and (k >= whole[i] or end_count[ends[j]] == 1)
        ):
            successor[i] = j
            name = session[i]
        successor.append(None)
        session.append(name)
    return {
        rid: Continuation(session[n], None if (s := successor[n]) is None else ids[s])
        for n, rid in enumerate(ids)
    }
