"""What the model runner is asked to do in one step: the batch description.

One :class:`StepBatch` holds one :class:`RequestStep` per scheduled request.  A request step
says which tokens to run (``token_ids``), where they sit (``num_computed``: tokens of the
request already in the cache; the new tokens take cache indices ``num_computed ..
num_computed + len(token_ids) - 1``), and where its cache lives:

* ``block_tables[group_id]`` for every token group (full, sliding, chunked, MLA): *manager*
  block ids of the request in that group, block ``i`` covering tokens ``[i * block_size,
  (i + 1) * block_size)``.  Released or skipped blocks hold the null block id ``0``.  The
  runner derives kernel block tables itself (``kernel id = manager id * ratio + j``, see
  :mod:`hybridkv.engine.gather`).
* ``states[group_id]`` for every state group (Mamba, gated DeltaNet, short conv): a
  :class:`StateIO` naming the slot (a block id of that group) to read the state from, the slot to
  write the state after the step to, and slot copies to do before and after the step
  (checkpoints at block boundaries, restores from a checkpoint on a prefix hit).

Example: a request with 20 tokens cached in full-attention group 0 (block size 16) sends 3 new
tokens; its table must cover 23 tokens, so 2 blocks::

    RequestStep(request_id="r1", token_ids=(5, 9, 2), num_computed=20,
                block_tables={0: (7, 12)}, states={1: StateIO(read_slot=4, write_slot=4)})

Everything here is plain data, checked on construction (:class:`BatchError` naming the field);
checks against a memory layout happen in the runner, before anything is written.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from hybridkv.engine.errors import BatchError

__all__ = ["RequestStep", "SlotCopy", "StateIO", "StepBatch"]


def _non_negative(owner: str, name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise BatchError(f"{owner}.{name}: must be an integer >= 0, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class SlotCopy:
    """Copy every state tensor of a state group from slot ``src`` to slot ``dst``."""

    src: int
    dst: int

    def __post_init__(self) -> None:
        _non_negative("SlotCopy", "src", self.src)
        _non_negative("SlotCopy", "dst", self.dst)
        if self.src == self.dst:
            raise BatchError(f"SlotCopy: src and dst are the same slot {self.src}")


@dataclass(frozen=True, kw_only=True)
class StateIO:
    """State slots of one request in one state group for one step.

    Order of work: ``zero_before`` slots are zeroed, ``copies_before`` done (in order), then
    the step reads the state from ``read_slot`` and writes the state after its last token to
    ``write_slot``, then ``copies_after`` are done (in order).  ``read_slot=None`` starts from
    the zero state and is only valid when the request has no computed tokens.  ``read_slot``
    and ``write_slot`` may be the same slot (the usual running-state slot).
    """

    read_slot: int | None
    write_slot: int
    copies_before: tuple[SlotCopy, ...] = ()
    copies_after: tuple[SlotCopy, ...] = ()
    zero_before: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.read_slot is not None:
            _non_negative("StateIO", "read_slot", self.read_slot)
        _non_negative("StateIO", "write_slot", self.write_slot)
        object.__setattr__(self, "zero_before", tuple(self.zero_before))
        for slot in self.zero_before:
            _non_negative("StateIO", "zero_before[...]", slot)
        object.__setattr__(self, "copies_before", tuple(self.copies_before))
        object.__setattr__(self, "copies_after", tuple(self.copies_after))
        for name in ("copies_before", "copies_after"):
            for copy in getattr(self, name):
                if not isinstance(copy, SlotCopy):
                    raise BatchError(f"StateIO.{name}: expected SlotCopy items, got {copy!r}")

    @property
    def slots(self) -> tuple[int, ...]:
        """Every slot this step touches (read, written or copied)."""
        out = [self.write_slot] if self.read_slot is None else [self.read_slot, self.write_slot]
        out.extend(self.zero_before)
        for copy in (*self.copies_before, *self.copies_after):
            out.extend((copy.src, copy.dst))
        return tuple(out)


@dataclass(frozen=True, kw_only=True)
class RequestStep:
    """One request's share of a step.  See the module docstring for the fields.

    ``positions`` are the RoPE positions of the new tokens; ``None`` means ``num_computed + i``
    (the only case the cache indexing assumes; explicit positions only change RoPE).
    ``num_logits``: how many of the last new tokens the runner returns logits for (more than
    one when a speculative step verifies draft tokens).
    """

    request_id: str
    token_ids: tuple[int, ...]
    num_computed: int
    block_tables: Mapping[int, tuple[int, ...]] = field(default_factory=dict)
    states: Mapping[int, StateIO] = field(default_factory=dict)
    positions: tuple[int, ...] | None = None
    num_logits: int = 1

    def __post_init__(self) -> None:
        owner = f"RequestStep({self.request_id!r})"
        if not isinstance(self.request_id, str) or not self.request_id:
            raise BatchError(
                f"RequestStep.request_id: must be a non-empty string, got {self.request_id!r}"
            )
        tokens = tuple(self.token_ids)
        if not tokens:
            raise BatchError(f"{owner}.token_ids: a step needs at least one new token")
        for t in tokens:
            _non_negative(owner, "token_ids[...]", t)
        object.__setattr__(self, "token_ids", tokens)
        _non_negative(owner, "num_computed", self.num_computed)
        if (
            not isinstance(self.num_logits, int)
            or isinstance(self.num_logits, bool)
            or not 1 <= self.num_logits <= len(tokens)
        ):
            raise BatchError(
                f"{owner}.num_logits: must be an integer in [1, {len(tokens)}] (the new "
                f"tokens), got {self.num_logits!r}"
            )
        tables: dict[int, tuple[int, ...]] = {}
        for gid, table in self.block_tables.items():
            _non_negative(owner, "block_tables key", gid)
            ids = tuple(table)
            for b in ids:
                _non_negative(owner, f"block_tables[{gid}][...]", b)
            tables[gid] = ids
        object.__setattr__(self, "block_tables", MappingProxyType(tables))
        states: dict[int, StateIO] = {}
        for gid, io in self.states.items():
            _non_negative(owner, "states key", gid)
            if not isinstance(io, StateIO):
                raise BatchError(f"{owner}.states[{gid}]: expected a StateIO, got {io!r}")
            if io.read_slot is None and self.num_computed > 0:
                raise BatchError(
                    f"{owner}.states[{gid}].read_slot: None (zero state) is only valid with "
                    f"num_computed 0, got num_computed {self.num_computed}"
                )
            states[gid] = io
        object.__setattr__(self, "states", MappingProxyType(states))
        if self.positions is not None:
            positions = tuple(self.positions)
            if len(positions) != len(tokens):
                raise BatchError(
                    f"{owner}.positions: {len(positions)} positions for {len(tokens)} tokens"
                )
            for p in positions:
                _non_negative(owner, "positions[...]", p)
            object.__setattr__(self, "positions", positions)

    @property
    def num_new(self) -> int:
        """Number of new tokens in this step."""
        return len(self.token_ids)

    @property
    def end(self) -> int:
        """Tokens in the cache after this step (``num_computed + num_new``)."""
        return self.num_computed + len(self.token_ids)

    @property
    def rope_positions(self) -> tuple[int, ...]:
        """The positions given, or ``num_computed .. end - 1``."""
        if self.positions is not None:
            return self.positions
        return tuple(range(self.num_computed, self.end))


@dataclass(frozen=True, kw_only=True)
class StepBatch:
    """The requests of one step, in output order.  Request ids are unique."""

    requests: tuple[RequestStep, ...]

    def __post_init__(self) -> None:
        requests = tuple(self.requests)
        if not requests:
            raise BatchError("StepBatch.requests: a step needs at least one request")
        seen: set[str] = set()
        for r in requests:
            if not isinstance(r, RequestStep):
                raise BatchError(f"StepBatch.requests: expected RequestStep items, got {r!r}")
            if r.request_id in seen:
                raise BatchError(f"StepBatch.requests: request id {r.request_id!r} appears twice")
            seen.add(r.request_id)
        object.__setattr__(self, "requests", requests)

    @property
    def num_tokens(self) -> int:
        """New tokens over all requests."""
        return sum(r.num_new for r in self.requests)
