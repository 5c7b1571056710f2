"""``hybridkv plan [MODEL]``: how many max-length requests fit a memory budget, and how.

Examples::

    hybridkv plan                                   # the default model, 8 GiB, arena
    hybridkv plan Qwen3-Next-80B-A3B --memory 80GiB --strategy all
    hybridkv plan ./config.json --max-model-len 32768 --strategy pools --pool-ratios 1,3 --json

Prints one table row per group (kind, window or chunk, layers, bytes and blocks), then the
capacity, the waste per cause, the physical need and the utilisation.  ``--strategy all``
prints every strategy and the naive "every layer is full attention" estimate side by side.
Bad input prints one line on stderr and exits 2 (see :mod:`hybridkv.cli.main`).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from hybridkv.cli.common import (
    CliInputError,
    add_block_options,
    add_kv_cache_dtype,
    add_max_model_len,
    add_memory,
    add_model,
    add_mtp,
    add_pool_options,
    add_tp,
    check_positive,
    check_state_options,
    check_state_split,
    chunk_alignment_arg,
    max_model_len_for,
    model_name,
    with_flag_names,
)
from hybridkv.cli.format import compact_ranges, percent, render_table
from hybridkv.errors import PlanError
from hybridkv.models.catalog import DEFAULT_MODEL
from hybridkv.units import format_bytes, format_bytes_exact, parse_bytes

if TYPE_CHECKING:
    from hybridkv.plan import Plan, StrategyComparison
    from hybridkv.specs import (
        CacheSpec,
        ChunkedLocalSpec,
        ModelSpec,
        SlidingWindowSpec,
        StateSpec,
    )

__all__ = [
    "add_arguments",
    "comparison_report",
    "group_table",
    "plan_report",
    "run",
]

_STRATEGY_CHOICES = ("arena", "uniform", "pools", "all")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register ``plan``'s arguments (imports nothing heavy)."""
    add_model(parser, default_help=DEFAULT_MODEL)
    add_memory(parser)
    add_max_model_len(parser)
    add_tp(parser)
    add_kv_cache_dtype(parser)
    add_mtp(parser)
    add_block_options(parser, kernel=True)
    parser.add_argument(
        "--strategy",
        choices=_STRATEGY_CHOICES,
        default="arena",
        help="memory layout, or all of them side by side with the naive estimate",
    )
    add_pool_options(parser)
    parser.add_argument(
        "--shared-state-chunks",
        action="store_true",
        help="arena: let state slots share a chunk as the common multiple gives, instead of "
        "padding state pages by up to 5%% for one slot per chunk (what simulate and run plan "
        "for a cache with lower tiers, which keeps dead tails)",
    )
    parser.add_argument("--json", action="store_true", help="print the plan(s) as JSON")


def parse_ratios(text: str | None) -> tuple[float, ...] | None:
    """``'0.3,0.7'`` -> ``(0.3, 0.7)``; raises :class:`PlanError` naming ``--pool-ratios``."""
    if text is None:
        return None
    try:
        return tuple(float(part) for part in text.split(","))
    except ValueError:
        raise PlanError(
            f"pool_ratios: cannot parse --pool-ratios {text!r}; give comma-separated positive "
            "numbers, one per group, e.g. 0.3,0.7"
        ) from None


def run(args: argparse.Namespace) -> int:
    """Resolve the model, plan, print.  Returns 0; raises HybridKVError on bad input."""
    from hybridkv import models
    from hybridkv.plan import compare_strategies, make_plan

    check_positive(
        args,
        (
            "tp",
            "max_model_len",
            "block_size",
            "kernel_block_size",
            "state_block_size",
            "state_split",
        ),
    )
    memory = parse_bytes(args.memory, field="--memory")
    alignment = chunk_alignment_arg(args, memory)
    check_state_split(args)
    ratios = parse_ratios(args.pool_ratios)
    name = model_name(args, models.DEFAULT_MODEL)
    model = models.resolve_model(
        name, tp_size=args.tp, kv_cache_dtype=args.kv_cache_dtype, mtp=args.mtp
    )
    check_state_options(args, model, ["state_split", "state_block_size"])
    check_shared_state_chunks(args, model)
    max_len = max_model_len_for(model, args.max_model_len, "plan")
    if args.strategy == "all":
        comparison = compare_strategies(
            model,
            memory_bytes=memory,
            max_model_len=max_len,
            block_size=args.block_size,
            kernel_block_size=args.kernel_block_size,
            state_block_size=args.state_block_size,
            pool_ratios=ratios,
            chunk_alignment=alignment,
            state_split=args.state_split,
            one_slot_chunks=not args.shared_state_chunks,
        )
        data: dict[str, Any] = comparison.to_dict()
        text = comparison_report(comparison)
    else:
        plan = make_plan(
            model,
            memory_bytes=memory,
            max_model_len=max_len,
            strategy=args.strategy,
            block_size=args.block_size,
            kernel_block_size=args.kernel_block_size,
            state_block_size=args.state_block_size,
            pool_ratios=ratios,
            chunk_alignment=alignment,
            state_split=args.state_split,
            one_slot_chunks=not args.shared_state_chunks,
        )
        data = plan.to_dict()
        text = plan_report(plan)
    print(json.dumps(data, indent=2) if args.json else text)
    return 0


def check_shared_state_chunks(args: argparse.Namespace, model: ModelSpec) -> None:
    """Refuse ``--shared-state-chunks`` where no arena holds a state slot (another strategy,
    or a model without recurrent-state layers), where it would change nothing."""
    from hybridkv.specs import CacheKind

    if not args.shared_state_chunks:
        return
    if args.strategy not in ("arena", "all"):
        raise CliInputError(
            f"--shared-state-chunks: only applies with --strategy arena (or all), not "
            f"--strategy {args.strategy}"
        )
    if not any(e.spec.kind is CacheKind.STATE for e in model.entries()):
        raise CliInputError(
            "--shared-state-chunks: only applies to models with recurrent-state layers; "
            f"{model.name} has none"
        )


def _window(spec: CacheSpec) -> str:
    sw = cast("SlidingWindowSpec", spec)
    return f"{sw.window}+{sw.sink_tokens} sinks" if sw.sink_tokens else str(sw.window)


def _chunk(spec: CacheSpec) -> str:
    return f"chunk {cast('ChunkedLocalSpec', spec).chunk_size}"


def _mixer(spec: CacheSpec) -> str:
    return f"state ({cast('StateSpec', spec).mixer.value})"


#: kind value -> the "window" cell; kinds not listed show "-".
_SPAN_CELL: dict[str, Callable[[CacheSpec], str]] = {
    "sliding_window": _window,
    "chunked_local": _chunk,
}
#: kind value -> the "kind" cell; kinds not listed show their kind value.
_KIND_CELL: dict[str, Callable[[CacheSpec], str]] = {"state": _mixer}


def _span(spec: CacheSpec) -> str:
    cell = _SPAN_CELL.get(spec.kind.value)
    return "-" if cell is None else cell(spec)


def _kind(spec: CacheSpec) -> str:
    cell = _KIND_CELL.get(spec.kind.value)
    return spec.kind.value if cell is None else cell(spec)


def _title(plan: Plan, *, strategy: bool = True) -> str:
    m = plan.model
    chosen = f"; strategy {plan.strategy.value}" if strategy else ""
    return (
        f"model {m.name} ({m.model_type}, {m.num_layers} layers, tp {m.tp_size}){chosen}; "
        f"memory {format_bytes_exact(plan.memory_bytes)}; "
        f"max_model_len {plan.max_model_len}"
    )


def _split_note(plan: Plan) -> str:
    """What ``--state-split`` did: the state groups the layers ended in (nothing when it
    split nothing)."""
    from hybridkv.specs import CacheKind

    states = [g for g in plan.layout.groups if g.spec.kind is CacheKind.STATE]
    if plan.options.state_split == 1 or not states:
        return ""
    layers = sum(g.num_members for g in states)
    return (
        f"; {layers} state layers in {len(states)} groups "
        f"(--state-split {plan.options.state_split})"
    )


def _header(plan: Plan) -> list[str]:
    layout = plan.layout
    lines = [
        _title(plan),
        f"hash block {layout.hash_block_size} tokens; schedule alignment "
        f"{layout.schedule_alignment} tokens" + _split_note(plan),
    ]
    if layout.arena is not None:
        host = layout.null_host
        null = "chunk 0 reserved"
        if host is not None:
            region = host.first * layout.groups[host.group_id].block_bytes
            null = (
                f"chunk 0: null blocks in its first {format_bytes(region)}, blocks "
                f"{host.first}..{host.end - 1} lent to group {host.group_id} for good"
            )
        tail = layout.tail_host
        lent = ""
        if tail is not None:
            lent = (
                f"; the last {format_bytes(layout.arena.tail_bytes)} past them: blocks "
                f"{tail.first}..{tail.end - 1} lent to group {tail.group_id} for good"
            )
        lines.append(
            f"arena: {layout.arena.num_chunks} chunks of {format_bytes(layout.arena.chunk_bytes)}"
            f" ({layout.arena.chunk_bytes} B), {null}{lent}"
        )
    else:
        for pool in layout.pools:
            lines.append(
                f"pool {pool.pool_id}: {pool.num_blocks} blocks of "
                f"{format_bytes_exact(pool.block_bytes)}, block 0 reserved, "
                f"groups {compact_ranges(pool.group_ids)}"
            )
    return lines


def group_table(plan: Plan) -> str:
    """One aligned row per group of ``plan``."""
    layout = plan.layout
    arena = layout.arena is not None
    headers = [
        "group",
        "kind",
        "window",
        "layers",
        "members",
        "block",
        "kernel",
        "page",
        "block bytes",
        "blocks/req",
        "blocks/chunk" if arena else "pool blocks",
    ]
    rows = []
    for g, need in zip(layout.groups, plan.capacity.blocks_per_request, strict=True):
        members = str(g.num_members)
        if g.padded_members:
            members += f"+{g.padded_members} pad"
        last = (
            layout.blocks_per_chunk(g.group_id) if arena else layout.pool_of(g.group_id).num_blocks
        )
        rows.append(
            [
                str(g.group_id),
                _kind(g.spec),
                _span(g.spec),
                compact_ranges(g.layers),
                members,
                str(g.block_size),
                str(g.kernel_block_size),
                format_bytes(g.page_bytes),
                format_bytes(g.block_bytes),
                str(need),
                str(last),
            ]
        )
    return render_table(headers, rows, align="rllllrrrrrr")


def plan_report(plan: Plan) -> str:
    """The human-readable report of one plan (what ``hybridkv plan`` prints)."""
    cap = plan.capacity
    w = plan.waste
    budget = plan.memory_bytes
    lines = [*_header(plan), "", group_table(plan), ""]
    lines.append(
        f"capacity       {cap.max_concurrent_requests} requests x {plan.max_model_len} tokens "
        f"= {cap.max_resident_tokens} tokens"
    )
    causes = ", ".join(
        f"{name} {format_bytes(value)}"
        for name, value in (
            ("padded_layers", w.padded_layers),
            ("padded_pages", w.padded_pages),
            ("chunk_tails", w.chunk_tails),
            ("reserved", w.reserved),
        )
    )
    lines.append(f"waste          {format_bytes(w.total)} ({percent(w.total / budget)}): {causes}")
    lines.append(
        f"physical need  {format_bytes(plan.physical_need.total)} of {format_bytes(budget)} "
        f"(utilisation {percent(plan.utilisation, 1)})"
    )
    lines.append(
        f"ledger         allocated {format_bytes(plan.allocated_bytes)}, waste "
        f"{format_bytes(w.total)}, free {format_bytes(plan.free_bytes)}"
    )
    lines.extend(f"note: {note}" for note in (*plan.model.notes, *plan.notes))
    return "\n".join(lines)


def comparison_report(comparison: StrategyComparison) -> str:
    """Every strategy and the naive estimate side by side."""
    first = comparison.plans[0]
    naive = comparison.naive
    lines = [_title(first, strategy=False), ""]
    headers = ["strategy", "requests", "tokens", "waste", "waste %", "utilisation %"]
    rows = [
        [
            p.strategy.value,
            str(p.capacity.max_concurrent_requests),
            str(p.capacity.max_resident_tokens),
            format_bytes(p.waste.total),
            percent(p.waste_fraction),
            percent(p.utilisation, 1),
        ]
        for p in comparison.plans
    ]
    rows.extend([f.strategy.value, "n/a", "n/a", "n/a", "n/a", "n/a"] for f in comparison.failures)
    rows.append(
        [
            "naive",
            str(naive.max_concurrent_requests),
            str(naive.max_concurrent_requests * naive.max_model_len),
            format_bytes(naive.waste_bytes),
            percent(naive.waste_fraction),
            percent(naive.utilisation, 1),
        ]
    )
    lines.append(render_table(headers, rows, align="lrrrrr"))
    lines.extend(f"{f.strategy.value}: {with_flag_names(f.reason)}" for f in comparison.failures)
    if comparison.plans:
        lines.extend(f"note: {note}" for note in comparison.plans[0].model.notes)
    lines.extend(f"note: {note}" for p in comparison.plans for note in p.notes)
    lines.append(
        "naive: every caching layer keeps every token; its waste is what it reserves for "
        "tokens no query reads"
    )
    return "\n".join(lines)
