"""``hybridkv run --disaggregate``: the same prompts through a prefill process and a decode
process (:mod:`hybridkv.engine.disaggregate`), with the same outputs and ``--verify``."""

from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING, Any

from hybridkv.cli.common import is_zero_size
from hybridkv.cli.run_prompts import RunInputError
from hybridkv.cli.run_report import output_line, verify_lines

if TYPE_CHECKING:
    from hybridkv.engine import CacheConfig

__all__ = ["reason_lines", "run_disaggregated"]


def reason_lines(reasons: dict[str, str], show: int = 4) -> list[str]:
    """One line per distinct reason requests were recomputed, most requests first:
    ``"  3 recomputed (r0, r4, r5): <reason>"`` (the first ``show`` request ids)."""
    by_reason: dict[str, list[str]] = {}
    for rid, reason in reasons.items():
        by_reason.setdefault(reason, []).append(rid)
    lines = []
    for reason, rids in sorted(by_reason.items(), key=lambda kv: -len(kv[1])):
        ids = ", ".join(rids[:show]) + (", ..." if len(rids) > show else "")
        lines.append(f"  {len(rids)} recomputed ({ids}): {reason}")
    return lines


def check_disaggregate_options(args: argparse.Namespace, defaults: dict[str, Any]) -> None:
    """Refuse, before anything loads, what ``--disaggregate`` cannot do (CPU engines over
    gloo) and the options its two processes do not take (each runs every request with the
    engine's default scheduler, on one thread), instead of ignoring them; ``defaults``: the
    parser's defaults, so an option is "given" when it differs from its default."""
    clash = [
        flag
        for flag, on in (
            ("--speculate", args.speculate),
            ("--host-memory", args.host_memory and not is_zero_size(args.host_memory)),
            ("--disk-cache", args.disk_cache),
            ("--write-through", args.write_through),
            ("--attention-sinks", args.attention_sinks),
            ("--device cuda", args.device != "cpu"),
        )
        if on
    ]
    if clash:
        raise RunInputError(f"--disaggregate: not with {', '.join(clash)} (CPU engines, gloo)")
    ignored = [
        "--" + name.replace("_", "-")
        for name in ("waves", "threads", "token_budget", "max_num_seqs", "admission", "compaction")
        if getattr(args, name) != defaults[name]
    ]
    if ignored:
        raise RunInputError(
            f"--disaggregate: not with {', '.join(ignored)} (the prefill and decode processes "
            "run every request with the engine's default scheduler, on one thread each)"
        )


def run_disaggregated(
    args: argparse.Namespace, cache: CacheConfig, prompts: list[list[int]], tokenizer: Any
) -> int:
    """``--disaggregate``: a prefill process and a decode process (see
    :mod:`hybridkv.engine.disaggregate`); the same outputs, summary and ``--verify``."""
    from dataclasses import replace

    from hybridkv.engine import verify_completions
    from hybridkv.engine.disaggregate import check_tp_sizes, run_disaggregated
    from hybridkv.engine.model_source import eos_token_ids
    from hybridkv.engine.models import load_model
    from hybridkv.engine.tp_shards import TPSplitError

    prefill_tp = 1 if args.prefill_tp is None else args.prefill_tp
    decode_tp = 1 if args.decode_tp is None else args.decode_tp
    try:  # before any process starts: a size the model's caches do not split is bad input
        check_tp_sizes(args.model, prefill_tp=prefill_tp, decode_tp=decode_tp)
    except TPSplitError as exc:
        field, _, rest = str(exc).partition(": ")
        raise RunInputError(f"--{field.replace('_', '-')} {rest}") from None
    if not args.quiet:
        print(f"prefill and decode processes for {args.model} ...", file=sys.stderr)
    eos = eos_token_ids(args.model)  # the single engine's stop rule (run_cmd._eos_ids)
    start = time.perf_counter()
    result = run_disaggregated(
        [args.model],
        [list(p) for p in prompts],
        max_tokens=args.max_tokens,
        eos_token_ids=eos,
        prefill_cache=cache,
        decode_cache=replace(cache, publish="computed"),
        seed=args.seed,
        prefill_tp=prefill_tp,
        decode_tp=decode_tp,
    )[args.model]
    elapsed = time.perf_counter() - start
    done = [result.completions[f"r{i}"] for i in range(len(prompts))]
    for c in done:
        print(output_line(c, tokenizer))
    tp = f" (tp {prefill_tp} -> {decode_tp}, emulated)" if prefill_tp > 1 or decode_tp > 1 else ""
    print(
        f"disaggregated{tp}: {result.imported} of {len(done)} requests decoded from the prefill "
        f"process's KV and state ({result.bytes_pulled} bytes pulled over gloo), "
        f"{result.recomputed} recomputed; {result.hit_tokens} prompt tokens hit the decode "
        f"side's own prefix cache and were not pulled; {sum(len(c.token_ids) for c in done)} "
        f"tokens generated in {elapsed:.1f} s (both processes started, models loaded, run)"
    )
    for line in reason_lines(result.reasons):
        print(line)
    for error in result.errors:  # what broke the connection, unless a reason above says it
        if error not in result.reasons.values():
            print(f"  {error}")
    if not args.verify:
        return 0
    reference = load_model(args.model, seed=args.seed)
    verdict = verify_completions(reference, done, eos)
    for line in verify_lines(verdict, "transformers' generate"):
        print(line)
    return 0 if verdict.ok else 1
