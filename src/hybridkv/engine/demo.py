"""An end-to-end run for ``hybridkv run``: plan, storage, cache manager, runner, and a check.

:func:`run_demo` loads a model (a tiny built-in one by default, or a local checkpoint), plans
its cache with :func:`hybridkv.plan.make_plan`, backs it with
:class:`hybridkv.storage.KVCacheStorage`, admits requests through
:class:`hybridkv.cache.KVCacheManager` and decodes them greedily with the
:class:`~hybridkv.engine.runner.ModelRunner`, in two waves: the first with unrelated prompts
of mixed lengths, the second with prompts sharing the first wave's first
``shared_prefix`` tokens, so the second wave starts from prefix-cache hits (and state
checkpoints, for recurrent models).  With ``check`` every request is compared with
transformers' own greedy decoding.

The CLI wiring is two calls: :func:`add_arguments` on the subcommand's parser and
:func:`run_from_args`, whose :class:`RunReport` formats itself (``format()``) or serialises
(``to_dict()``).  Nothing here prints.
"""

from __future__ import annotations

import argparse
import logging
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from hybridkv.engine.errors import BatchError
from hybridkv.engine.generate import Generation, PagedGenerator, reference_chunked
from hybridkv.engine.manager_bridge import ManagerCache
from hybridkv.engine.models import DEFAULT_TINY_MODEL, TINY_MODELS, load_model, reference_copy
from hybridkv.engine.probe import probe_model, probe_model_spec
from hybridkv.engine.runner import ModelRunner
from hybridkv.engine.views import StorageViews
from hybridkv.units import parse_bytes

__all__ = ["RunReport", "add_arguments", "run_demo", "run_from_args"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class RunReport:
    """What :func:`run_demo` did and whether it matched transformers.

    ``max_logit_diff`` and ``matches_reference`` are ``None`` when ``check`` was off.
    ``prefix_hit_tokens`` is the sum of the second wave's prefix-cache hits (tokens).
    """

    model: str
    model_type: str
    strategy: str
    groups: list[str]
    num_requests: int
    generated_tokens: int
    steps: int
    forward_passes: int
    prefix_hit_tokens: int
    seconds: float
    matches_reference: bool | None
    max_logit_diff: float | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def format(self) -> str:
        """A few human-readable lines."""
        check = (
            "not checked"
            if self.matches_reference is None
            else (
                f"{'identical to' if self.matches_reference else 'DIFFERENT from'} transformers' "
                f"greedy tokens, max |logit diff| {self.max_logit_diff:.2e}"
            )
        )
        lines = [
            f"model {self.model} ({self.model_type}), {self.strategy} layout:",
            *(f"  {g}" for g in self.groups),
            f"{self.num_requests} requests, {self.generated_tokens} generated tokens in "
            f"{self.steps} steps ({self.forward_passes} forward passes), "
            f"{self.prefix_hit_tokens} prompt tokens served from the prefix cache, "
            f"{self.seconds:.2f} s",
            check,
        ]
        return "\n".join(lines)


def _prompt(gen: torch.Generator, length: int, vocab: int) -> list[int]:
    return [int(t) for t in torch.randint(0, vocab, (length,), generator=gen)]


def run_demo(
    model: str = DEFAULT_TINY_MODEL,
    *,
    num_requests: int = 3,
    max_new_tokens: int = 8,
    shared_prefix: int = 16,
    block_size: int = 4,
    kernel_block_size: int | None = None,
    state_block_size: int = 8,
    chunk_size: int = 8,
    strategy: str = "arena",
    memory: str | int = "8MiB",
    seed: int = 0,
    check: bool = True,
) -> RunReport:
    """Run the two waves (see the module docstring) and report.

    Raises :class:`BatchError` for non-positive counts, and the errors of the layers it calls
    (:class:`~hybridkv.engine.errors.ModelSourceError` for an unknown model,
    :class:`~hybridkv.errors.PlanError` for a budget that holds no request, ...).
    """
    from hybridkv.cache import KVCacheManager
    from hybridkv.plan import make_plan
    from hybridkv.storage import KVCacheStorage

    if num_requests < 1 or max_new_tokens < 1 or shared_prefix < 1 or chunk_size < 1:
        raise BatchError(
            "run: num_requests, max_new_tokens, shared_prefix and chunk_size must be >= 1, got "
            f"{num_requests}, {max_new_tokens}, {shared_prefix}, {chunk_size}"
        )
    start = time.perf_counter()
    net = load_model(model, seed=seed)
    ref = reference_copy(net) if check else None
    probe = probe_model(net)
    spec = probe_model_spec(probe, name=model)
    max_len = 2 * shared_prefix + 2 * num_requests + max_new_tokens + 8
    plan = make_plan(
        spec,
        memory_bytes=parse_bytes(memory, field="memory"),
        max_model_len=max_len,
        strategy=strategy,
        block_size=block_size,
        kernel_block_size=kernel_block_size,
        state_block_size=state_block_size,
        chunk_alignment=4096,
    )
    layout = plan.layout
    storage = KVCacheStorage(layout)
    runner = ModelRunner(net, layout, StorageViews(storage), probe=probe)
    cache = ManagerCache(KVCacheManager(layout, max_model_len=max_len))
    gen = PagedGenerator(runner, cache)
    vocab = int(net.config.get_text_config(decoder=True).vocab_size)
    rng = torch.Generator().manual_seed(seed)
    first = {f"w1-{i}": _prompt(rng, shared_prefix + 1 + 2 * i, vocab) for i in range(num_requests)}
    for rid, p in first.items():
        gen.add(rid, p, max_new_tokens, chunk_size=chunk_size)
    gen.run()
    second = {
        f"w2-{i}": p[:shared_prefix] + _prompt(rng, 1 + i, vocab)
        for i, p in enumerate(first.values())
    }
    for rid, p in second.items():
        gen.add(rid, p, max_new_tokens, chunk_size=chunk_size)
    results = gen.run()
    matches: bool | None = None
    diff: float | None = None
    if ref is not None:
        matches, diff = True, 0.0
        for rid, p in {**first, **second}.items():
            got: Generation = results[rid]
            # transformers with its own cache, computing the same chunks (prefix hits end on
            # chunk boundaries here: shared_prefix is a multiple of every block size)
            want = reference_chunked(ref, p, chunk_size, max_new_tokens)
            matches &= got.tokens == want.tokens
            for a, b in zip(got.logits, want.logits, strict=True):
                diff = max(diff, float((a - b).abs().max()))
    report = RunReport(
        model=model,
        model_type=probe.model_type,
        strategy=layout.strategy.value,
        groups=[
            f"group {g.group_id}: {g.spec.kind.value}, layers {list(g.layers)}, block "
            f"{g.block_size} (kernel {g.kernel_block_size}), {g.block_bytes} B per block"
            for g in layout.groups
        ],
        num_requests=2 * num_requests,
        generated_tokens=sum(len(r.tokens) for r in results.values()),
        steps=len(gen.steps),
        forward_passes=sum(s.num_passes for s in gen.steps),
        prefix_hit_tokens=sum(cache.hits[rid] for rid in second),
        seconds=time.perf_counter() - start,
        matches_reference=matches,
        max_logit_diff=diff,
    )
    logger.info("run: %s", report.to_dict())
    return report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``hybridkv run`` options."""
    parser.add_argument(
        "--model",
        default=DEFAULT_TINY_MODEL,
        help=f"tiny model ({', '.join(sorted(TINY_MODELS))}) or a checkpoint directory "
        f"(default {DEFAULT_TINY_MODEL}: short conv + sliding + full attention)",
    )
    parser.add_argument("--requests", type=int, default=3, help="requests per wave (default 3)")
    parser.add_argument("--max-new-tokens", type=int, default=8, help="tokens to generate")
    parser.add_argument("--block-size", type=int, default=4, help="attention block (tokens)")
    parser.add_argument("--kernel-block-size", type=int, default=None, help="kernel block")
    parser.add_argument(
        "--state-block-size", type=int, default=8, help="state checkpoint interval (tokens)"
    )
    parser.add_argument("--strategy", default="arena", choices=("arena", "pools", "uniform"))
    parser.add_argument("--memory", default="8MiB", help="cache memory budget (default 8MiB)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-check", action="store_true", help="skip the transformers check")


def run_from_args(args: argparse.Namespace) -> RunReport:
    """:func:`run_demo` with the options of :func:`add_arguments`."""
    return run_demo(
        args.model,
        num_requests=args.requests,
        max_new_tokens=args.max_new_tokens,
        block_size=args.block_size,
        kernel_block_size=args.kernel_block_size,
        state_block_size=args.state_block_size,
        strategy=args.strategy,
        memory=args.memory,
        seed=args.seed,
        check=not args.no_check,
    )
