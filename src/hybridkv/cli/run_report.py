"""What ``hybridkv run`` prints: the layout, one line per request, the cache summary and the
verification result.  Pure string functions over engine results; nothing here prints.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hybridkv.engine import Completion, EngineStats, LLMEngine, VerifyResult

__all__ = ["describe", "output_line", "summary_lines", "verify_lines"]


def describe(engine: LLMEngine) -> list[str]:
    from hybridkv.units import format_bytes

    layout = engine.layout
    lines = [
        f"model {engine.name} ({engine.spec.model_type}): {layout.strategy.value} layout, "
        f"{format_bytes(engine.plan.memory_bytes)} budget, max_model_len "
        f"{engine.max_model_len}, schedule alignment {layout.schedule_alignment} tokens"
    ]
    for g in layout.groups:
        layers = ",".join(str(layer) for layer in g.layers)
        lines.append(
            f"  group {g.group_id} {g.spec.kind.value}: layers {layers}, block {g.block_size} "
            f"tokens (kernel {g.kernel_block_size}), {format_bytes(g.block_bytes)} per block"
        )
    return lines


def output_line(c: Completion, tokenizer: Any) -> str:
    text = (
        repr(tokenizer.decode(list(c.token_ids), skip_special_tokens=True))
        if tokenizer is not None
        else " ".join(str(t) for t in c.token_ids)
    )
    notes = [f"{len(c.prompt_token_ids)} prompt tokens", f"{c.num_cached_tokens} cached"]
    if c.num_preemptions:
        notes.append(f"preempted {c.num_preemptions}x")
    notes.append(c.finish_reason.value)
    return f"{c.request_id} ({', '.join(notes)}): {text}"


def _per_group(labels: tuple[str, ...], values: tuple[Any, ...], fmt: str = "{}") -> str:
    return ", ".join(f"{label} {fmt.format(v)}" for label, v in zip(labels, values, strict=True))


def summary_lines(
    stats: EngineStats, num_requests: int, *, whole_prefill: bool = False
) -> list[str]:
    """The run's summary.  ``whole_prefill``: the engine computes every prompt whole from
    token 0 (a Mamba1 model), so it looks up no prefix."""
    from hybridkv.cli.format import percent

    if stats.query_tokens:
        per_group = (
            "  hit rate per group (what each group alone could serve, of "
            f"{stats.query_tokens} tokens looked up, a request's every lookup counted: while "
            "it waits, and again after a preemption): "
            + ", ".join(
                f"{label} {percent(rate, 1)}"
                for label, rate in zip(stats.groups, stats.group_hit_rates, strict=True)
            )
        )
    elif whole_prefill:
        per_group = (
            "  hit rate per group: n/a (no prefix lookups: this model's recurrent state "
            "(Mamba1) cannot resume a prefill, so every prompt is computed whole)"
        )
    else:
        per_group = "  hit rate per group: n/a (no prefix lookups)"

    windowed = [
        (label, n)
        for label, n in zip(stats.groups, stats.window_blocks_released, strict=True)
        if label.split(":")[1] in ("sliding_window", "chunked_local")
    ]
    lines = [
        f"{num_requests} requests: {stats.generated_tokens} tokens generated in "
        f"{stats.seconds:.2f} s ({stats.tokens_per_second:.1f} tokens/s), {stats.steps} steps, "
        f"{stats.forward_passes} forward passes, up to {stats.max_batch_requests} requests "
        "per step",
        f"prefix cache: {stats.prefix_hit_tokens} of {stats.admitted_tokens} admitted prompt "
        f"tokens served from the cache ({percent(stats.hit_rate, 1)})",
        per_group,
        f"peak blocks per group: {_per_group(stats.groups, stats.peak_blocks)}",
    ]
    if windowed:
        lines.append(
            "window blocks released: " + ", ".join(f"{label} {n}" for label, n in windowed)
        )
    if stats.host_hit_tokens:
        lines.append(
            f"host tier: {stats.host_hit_tokens} of the {stats.prefix_hit_tokens} hit tokens read "
            "back from host memory"
        )
    if stats.disk_hit_tokens:
        lines.append(
            f"disk tier: {stats.disk_hit_tokens} of the {stats.prefix_hit_tokens} hit tokens read "
            "back from disk"
        )
    if stats.draft_tokens:
        lines.append(
            f"speculative decoding: {stats.accepted_draft_tokens} of {stats.draft_tokens} draft "
            f"tokens accepted ({percent(stats.draft_acceptance, 1)}), "
            f"{stats.rollback_passes} state rollback passes"
        )
    moved = (
        f" (compaction moved {stats.moved_blocks} blocks instead of preempting)"
        if stats.moved_blocks
        else ""
    )
    lines.append(f"preemptions: {stats.preemptions}{moved}")
    return lines


def verify_lines(result: VerifyResult, reference: str = "transformers' generate") -> list[str]:
    diff = (
        "" if result.max_logit_diff is None else f" (max |logit diff| {result.max_logit_diff:.1e})"
    )
    if result.ok:
        return [
            f"verify: all {result.num_requests} requests ({result.num_tokens} tokens) identical "
            f"to {reference}{diff}"
        ]
    lines = [
        f"verify: {len(result.mismatches)} of {result.num_requests} requests DIFFER from "
        f"{reference}{diff}"
    ]
    for m in result.mismatches:
        lines.append(
            f"  {m.request_id}: first difference at output token {m.position}: engine "
            f"{m.got}, transformers {m.want}"
        )
    return lines
