"""The model runner: execute a :class:`~hybridkv.engine.batch.StepBatch` on a transformers model
over hybridkv's paged hybrid cache.

How a step runs
---------------
1. **Check** the whole batch against the layout (block tables, slots, lengths, write
   conflicts) and compute every request's gather indices (:mod:`hybridkv.engine.gather`).  A
   bad batch raises :class:`BatchError` here, before anything is written.
2. **Zero and copy** state slots (``zero_before``, then ``copies_before``, of every request
   in batch order).
3. **Forward passes.**  A model without recurrent layers runs the whole step as one packed
   sequence ``[1, total_tokens]``: per-request ``position_ids``, one segment per request, and
   attention that only mixes tokens of the same request (each request gathers its own keys).
   Recurrent layers scan along the sequence, so a model with them runs one pass per *bucket*
   of requests with the same number of new tokens and the same "has a cached state" flag, as
   an unpadded ``[B, T]`` batch (padding would leak into the recurrent state).  A request
   whose cached prefix holds blocks another request writes in this step (a same-step prefix
   hit: the manager publishes blocks at allocation) runs in a later pass than that writer.
4. **Store** the final states into ``write_slot`` s, then do ``copies_after``.

Attention layers write the new K/V into their group's views during the pass; MLA layers write
the latent.  If a pass raises, the state slots are restored to their state before the step
(zeroing and ``copies_before`` undone); K/V and latent slots of the step's *new* tokens may
have been written, which changes no computed token.

Logits: for every request, the float32 logits of its last new token.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, NamedTuple

import torch

from hybridkv.engine.attention import PAGED_ATTENTION, active_step, register_paged_attention
from hybridkv.engine.batch import RequestStep, StateIO, StepBatch
from hybridkv.engine.binding import ModelBinding, RouteKind, bind_layout
from hybridkv.engine.errors import BatchError
from hybridkv.engine.forward_pass import ForwardPass, Segment
from hybridkv.engine.gather import SegmentIndex, segment_index
from hybridkv.engine.hf_cache import (
    LatentLayer,
    PassThroughLayer,
    build_cache,
    collect_states,
    dummy_layer,
    load_states,
)
from hybridkv.engine.probe import ModelProbe, cache_argument, probe_model
from hybridkv.engine.views import PagedKVViews
from hybridkv.plan import NULL_BLOCK_ID, MemoryLayout

__all__ = ["ModelRunner", "StepOutput"]

logger = logging.getLogger(__name__)


class StepOutput(NamedTuple):
    """Result of one step: ``request id -> float32 logits [vocab]`` of its last new token, how
    many forward passes the step took, and for every request that asked for more than one
    (``RequestStep.num_logits``) the logits ``[num_logits, vocab]`` of its last
    ``num_logits`` new tokens."""

    logits: dict[str, torch.Tensor]
    num_passes: int
    position_logits: Mapping[str, torch.Tensor] = MappingProxyType({})


class ModelRunner:
    """Runs steps of a transformers causal LM over paged hybrid cache views.

    ``model`` is put in eval mode and switched to the paged attention implementation
    (:data:`~hybridkv.engine.attention.PAGED_ATTENTION`); ``layout`` is checked against what
    the model really caches (:func:`~hybridkv.engine.probe.probe_model`, or ``probe`` if given)
    and ``views`` must serve every member of it.  Raises
    :class:`~hybridkv.engine.errors.BindingError` when the layout does not fit the model.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        layout: MemoryLayout,
        views: PagedKVViews,
        *,
        probe: ModelProbe | None = None,
    ) -> None:
        register_paged_attention()
        model.eval()
        config: Any = getattr(model, "config", None)
        if config is not None and config._attn_implementation != PAGED_ATTENTION:
            model.set_attn_implementation(PAGED_ATTENTION)  # type: ignore[operator]
        self.model = model
        #: The forward keyword of the cache (``cache``, or ``past_key_values`` before 5.24).
        self._cache_kw = cache_argument(model)
        self.layout = layout
        self.views = views
        self.probe = probe if probe is not None else probe_model(model)
        self.binding: ModelBinding = bind_layout(self.probe, layout)
        self.device = next(model.parameters()).device
        #: The last step's speculative requests (``num_logits > 1``) and their input states.
        self._verified: dict[str, tuple[RequestStep, list[tuple[torch.Tensor, int, torch.Tensor]]]]
        self._verified = {}

    # ----------------------------------------------------------------- checks

    def _check_request(self, r: RequestStep) -> dict[int, SegmentIndex]:
        token_groups = self.binding.token_groups()
        state_groups = self.binding.state_groups()
        owner = f"request {r.request_id!r}"
        if set(r.block_tables) != set(token_groups):
            raise BatchError(
                f"{owner}: block_tables has groups {sorted(r.block_tables)}; the model's token "
                f"groups are {sorted(token_groups)}"
            )
        if set(r.states) != set(state_groups):
            raise BatchError(
                f"{owner}: states has groups {sorted(r.states)}; the model's state groups are "
                f"{sorted(state_groups)}"
            )
        for gid, io in r.states.items():
            num_ids = state_groups[gid][1]
            for slot in io.slots:
                if not NULL_BLOCK_ID < slot < num_ids:
                    raise BatchError(
                        f"{owner}: states[{gid}] names slot {slot}; valid slots are "
                        f"1..{num_ids - 1} (0 is the null block)"
                    )
            if r.num_computed == 0 and io.read_slot is not None:
                raise BatchError(
                    f"{owner}: states[{gid}].read_slot is {io.read_slot} but num_computed is 0; "
                    "a request with no computed tokens starts from the zero state (read_slot=None)"
                )
        return {
            gid: segment_index(
                group,
                r.block_tables[gid],
                num_computed=r.num_computed,
                num_new=r.num_new,
                num_block_ids=num_ids,
                request_id=r.request_id,
                device=self.device,
            )
            for gid, (group, num_ids) in token_groups.items()
        }

    def _check_conflicts(self, batch: StepBatch) -> None:
        written: dict[tuple[int, int], str] = {}
        for r in batch.requests:
            for gid, table in r.block_tables.items():
                size = self.layout.groups[gid].block_size
                for i in range(r.num_computed // size, -(-r.end // size)):
                    other = written.setdefault((gid, table[i]), r.request_id)
                    if other != r.request_id:
                        raise BatchError(
                            f"block_tables[{gid}]: requests {other!r} and {r.request_id!r} both "
                            f"write new tokens into block {table[i]}"
                        )
        slots: dict[tuple[int, int], str] = {}
        for r in batch.requests:
            for gid, io in r.states.items():
                other = slots.setdefault((gid, io.write_slot), r.request_id)
                if other != r.request_id:
                    raise BatchError(
                        f"states[{gid}]: requests {other!r} and {r.request_id!r} both write "
                        f"slot {io.write_slot}"
                    )

    # ----------------------------------------------------------------- passes

    @property
    def packed(self) -> bool:
        """True when a step runs as one packed sequence (no state, no cache-length reads)."""
        return not (self.binding.has_state or self.probe.reads_cache_length)

    def _levels(self, batch: StepBatch) -> list[int]:
        """Per request, how many passes must run before its own: a request whose computed
        prefix holds a block another request of this step writes (a same-step prefix hit,
        published at allocation) runs after that writer."""
        writer: dict[tuple[int, int], int] = {}
        for i, r in enumerate(batch.requests):
            for gid, table in r.block_tables.items():
                size = self.layout.groups[gid].block_size
                for j in range(r.num_computed // size, -(-r.end // size)):
                    writer[(gid, table[j])] = i
        deps: list[set[int]] = []
        for i, r in enumerate(batch.requests):
            found: set[int] = set()
            for gid, table in r.block_tables.items():
                size = self.layout.groups[gid].block_size
                for b in table[: r.num_computed // size]:
                    w = writer.get((gid, b))
                    if w is not None and w != i:
                        found.add(w)
            deps.append(found)
        level = [0] * len(deps)
        for _ in range(len(deps)):  # longest path in the (acyclic) writer -> reader graph
            changed = False
            for i, found in enumerate(deps):
                for w in found:
                    if level[w] + 1 > level[i]:
                        level[i] = level[w] + 1
                        changed = True
            if not changed:
                return level
        raise BatchError("requests of one step read each other's new tokens (a cycle)")

    def _buckets(self, batch: StepBatch) -> list[list[int]]:
        if self.packed:  # one pass writes every layer's new tokens before attending
            return [list(range(len(batch.requests)))]
        level = self._levels(batch)
        buckets: dict[tuple[int, ...], list[int]] = {}
        for i, r in enumerate(batch.requests):
            key: tuple[int, ...] = (level[i], r.num_new, r.num_computed > 0)
            if self.probe.reads_cache_length:
                key += (r.num_computed,)
            buckets.setdefault(key, []).append(i)
        return [buckets[k] for k in sorted(buckets, key=lambda k: k[0])]

    def _copy_slots(self, copies: list[tuple[int, StateIO]], *, after: bool) -> None:
        for gid, io in copies:
            for route in self.binding.states.values():
                if route.group.group_id != gid:
                    continue
                for t in route.tensors:
                    tensor = self.views.state(route.layer, route.slot, t.name)
                    if not after:
                        for slot in io.zero_before:
                            tensor[slot] = 0
                    for c in io.copies_after if after else io.copies_before:
                        tensor[c.dst] = tensor[c.src]

    def _snapshot(self, batch: StepBatch) -> list[tuple[torch.Tensor, int, torch.Tensor]]:
        saved = []
        for r in batch.requests:
            for gid, io in r.states.items():
                for route in self.binding.states.values():
                    if route.group.group_id != gid:
                        continue
                    for t in route.tensors:
                        tensor = self.views.state(route.layer, route.slot, t.name)
                        for dst in (*io.zero_before, *(c.dst for c in io.copies_before)):
                            saved.append((tensor, dst, tensor[dst].clone()))
        return saved

    def _layout_pass(
        self, requests: list[RequestStep]
    ) -> tuple[list[Segment], list[list[int]], list[list[int]]]:
        """Segments, token ids and positions of one pass: one packed row, or a row each."""
        if not self.packed:
            segments = [Segment(n, n, 0, r.num_new) for n, r in enumerate(requests)]
            return (
                segments,
                [list(r.token_ids) for r in requests],
                [list(r.rope_positions) for r in requests],
            )
        segments, start = [], 0
        for n, r in enumerate(requests):
            segments.append(Segment(n, 0, start, r.num_new))
            start += r.num_new
        ids = [[t for r in requests for t in r.token_ids]]
        return segments, ids, [[p for r in requests for p in r.rope_positions]]

    def _cache_layers(self, requests: list[RequestStep], step: ForwardPass) -> list[Any]:
        """One transformers cache layer per model layer (see :mod:`hybridkv.engine.hf_cache`)."""
        # Only read by models that call get_seq_length(), whose passes share num_computed.
        seq_length = 0 if self.packed else requests[0].num_computed
        resuming = requests[0].num_computed > 0
        layers: list[Any] = []
        for layer in range(self.binding.num_layers):
            token_route = self.binding.tokens.get(layer)
            state_route = self.binding.states.get(layer)
            if state_route is not None:  # with attention too for falcon_h1's hybrid layers
                gid = state_route.group.group_id
                slots = [int(r.states[gid].read_slot or 0) for r in requests]
                layers.append(
                    load_states(
                        state_route,
                        slots if resuming else None,
                        self.views,
                        device=self.device,
                        attention=None if token_route is None else seq_length,
                        listener=step,
                    )
                )
            elif token_route is not None and token_route.kind is RouteKind.ATTENTION:
                layers.append(PassThroughLayer(seq_length, layer=layer, listener=step))
            elif token_route is not None:
                layers.append(LatentLayer(layer, step, seq_length))
            else:
                layers.append(dummy_layer())
        return layers

    def _run_pass(
        self,
        batch: StepBatch,
        members: list[int],
        index: list[dict[int, SegmentIndex]],
        pending: list[tuple[torch.Tensor, int, torch.Tensor]],
    ) -> dict[str, torch.Tensor]:
        """Run one forward pass; queue its final states in ``pending``; return its logits."""
        requests = [batch.requests[i] for i in members]
        segments, ids, pos = self._layout_pass(requests)
        per_group = {gid: [index[i][gid] for i in members] for gid in self.binding.token_groups()}
        step = ForwardPass(self.binding, self.views, segments, per_group, len(ids))
        layers = self._cache_layers(requests, step)
        counts = [r.num_logits for r in requests]
        keep: int | torch.Tensor = max(counts)
        if self.packed:  # the last num_logits positions of every segment
            rows = [
                i
                for s, m in zip(segments, counts, strict=True)
                for i in range(s.start + s.length - m, s.start + s.length)
            ]
            keep = torch.tensor(rows, device=self.device)
        with torch.no_grad(), active_step(step):
            out = self.model(
                input_ids=torch.tensor(ids, dtype=torch.long, device=self.device),
                position_ids=torch.tensor(pos, dtype=torch.long, device=self.device),
                use_cache=True,
                logits_to_keep=keep,
                **{self._cache_kw: build_cache(layers)},
            )
        if self.packed:
            flat = out.logits[0]
            offsets = [sum(counts[:n]) for n in range(len(counts))]
            per_request = [flat[o : o + m] for o, m in zip(offsets, counts, strict=True)]
        else:
            per_request = [out.logits[n, out.logits.shape[1] - m :] for n, m in enumerate(counts)]
        for layer, route in self.binding.states.items():
            produced = collect_states(route, layers[layer])
            for row, r in enumerate(requests):
                slot = r.states[route.group.group_id].write_slot
                for t in route.tensors:
                    target = self.views.state(route.layer, route.slot, t.name)
                    pending.append((target, slot, produced[t.name][row]))
        return {r.request_id: per_request[n].float() for n, r in enumerate(requests)}

    # ----------------------------------------------------------------- public

    def execute(self, batch: StepBatch) -> StepOutput:
        """Run one step (see the module docstring) and return the logits.

        Mutates the cache views: K/V (or latent) slots of the new tokens, state slots named by
        ``write_slot`` and copy destinations.  Raises :class:`BatchError` for a batch that
        does not fit the layout (nothing written) and :class:`EngineError` when the model and
        the views disagree.
        """
        index = [self._check_request(r) for r in batch.requests]
        self._check_conflicts(batch)
        copies = [(gid, io) for r in batch.requests for gid, io in r.states.items()]
        saved = self._snapshot(batch)
        self._copy_slots(copies, after=False)
        self._verified = {
            r.request_id: (r, self._input_states(r)) for r in batch.requests if r.num_logits > 1
        }
        logits: dict[str, torch.Tensor] = {}
        pending: list[tuple[torch.Tensor, int, torch.Tensor]] = []
        buckets = self._buckets(batch)
        try:
            for members in buckets:
                logits.update(self._run_pass(batch, members, index, pending))
        except BaseException:
            for tensor, slot, value in reversed(saved):
                tensor[slot] = value
            raise
        for tensor, slot, value in pending:
            tensor[slot] = value.to(device=tensor.device, dtype=tensor.dtype)
        self._copy_slots(copies, after=True)
        ordered = {r.request_id: logits[r.request_id][-1] for r in batch.requests}
        verify = {r.request_id: logits[r.request_id] for r in batch.requests if r.num_logits > 1}
        logger.debug(
            "step: %d requests, %d tokens, %d passes", len(ordered), batch.num_tokens, len(buckets)
        )
        return StepOutput(logits=ordered, num_passes=len(buckets), position_logits=verify)

    # ----------------------------------------------------------------- speculative steps

    def _input_states(self, r: RequestStep) -> list[tuple[torch.Tensor, int, torch.Tensor]]:
        """Per state tensor of ``r``'s groups: the tensor, ``r``'s write slot and the state the
        step starts from (after its zeroing and copies), so :meth:`rewind` can start again."""
        out = []
        for route in self.binding.states.values():
            io = r.states.get(route.group.group_id)
            if io is None:
                continue
            for t in route.tensors:
                tensor = self.views.state(route.layer, route.slot, t.name)
                start = (
                    torch.zeros_like(tensor[io.write_slot])
                    if io.read_slot is None
                    else tensor[io.read_slot].clone()
                )
                out.append((tensor, io.write_slot, start))
        return out

    def rewind(self, kept: Mapping[str, int]) -> int:
        """Make the last step of each request in ``kept`` end after its first ``kept[id]`` new
        tokens.

        For speculative steps (``num_logits > 1``) whose draft tokens were partly rejected.
        Attention and MLA slots past the kept tokens are simply not read again (the next step
        overwrites them), but a recurrent state holds every token it scanned: the state each
        step started from is restored into its write slots and the kept tokens run again (one
        step, all such requests together).  Returns the number of forward passes this took
        (0 for a model without state, or when every new token is kept).

        Raises :class:`BatchError`, rewinding nothing, when the last step ran no speculative
        step of some request, a count is not in ``[1, num_new]``, or such a step checkpointed a
        state after its last token (``copies_after``: the checkpoint holds rejected tokens).
        """
        again: list[RequestStep] = []
        restore: list[tuple[torch.Tensor, int, torch.Tensor]] = []
        for rid, num_tokens in kept.items():
            entry = self._verified.get(rid)
            if entry is None:
                raise BatchError(f"rewind: the last step ran no speculative step of {rid!r}")
            r, inputs = entry
            if not isinstance(num_tokens, int) or not 1 <= num_tokens <= r.num_new:
                raise BatchError(
                    f"rewind: tokens kept of request {rid!r} must be in [1, {r.num_new}], got "
                    f"{num_tokens!r}"
                )
            if num_tokens == r.num_new or not inputs:
                continue
            if any(io.copies_after for io in r.states.values()):
                raise BatchError(
                    f"rewind: the step of request {rid!r} checkpointed its state after its last "
                    "token; a speculative step must not end on a checkpoint boundary"
                )
            restore.extend(inputs)
            again.append(
                RequestStep(
                    request_id=rid,
                    token_ids=r.token_ids[:num_tokens],
                    num_computed=r.num_computed,
                    block_tables=r.block_tables,
                    states={
                        gid: StateIO(read_slot=io.write_slot, write_slot=io.write_slot)
                        for gid, io in r.states.items()
                    },
                    positions=None if r.positions is None else r.positions[:num_tokens],
                )
            )
        for rid in kept:
            del self._verified[rid]
        if not again:
            return 0
        for tensor, slot, value in restore:
            tensor[slot] = value
        return self.execute(StepBatch(requests=tuple(again))).num_passes
