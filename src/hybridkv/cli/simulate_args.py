"""The options of ``hybridkv simulate`` (:func:`add_arguments`) and their defaults; what
they do is :mod:`hybridkv.cli.simulate_cmd`'s."""

from __future__ import annotations

import argparse

from hybridkv.cache import (
    CHECKPOINT_ADMISSION,
    CHECKPOINT_LIFE,
    CHECKPOINT_WHEN_FULL,
    PUBLISH_MODES,
    TIER_ADMISSION,
    WINDOW_RETENTION,
)
from hybridkv.cache.pool_base import DEFAULT_CHANCES, DEFAULT_WINDOW_CHANCES
from hybridkv.cache.tier_sessions import DEFAULT_PROTECT_SHARE
from hybridkv.cli.common import (
    add_admission,
    add_block_options,
    add_kv_cache_dtype,
    add_max_model_len,
    add_memory,
    add_model,
    add_mtp,
    add_pool_options,
    add_tp,
)
from hybridkv.models.catalog import DEFAULT_MODEL
from hybridkv.sim.simulator import PROTECT_MODES

__all__ = ["ACCELERATORS", "DEFAULT_TRACE", "DEFAULT_WINDOW_RETENTION", "add_arguments"]

#: The demo's workload: tool-use loops re-sending a growing context (long shared prefixes).
DEFAULT_TRACE = "synthetic:agent"
#: ``--window-retention`` when not given (the manager's own default).
DEFAULT_WINDOW_RETENTION = "tails"
#: The accelerator cost models ``--accelerator`` names.
ACCELERATORS = ("h100", "h200", "a100")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from hybridkv.sim.report import COLUMNS

    # what each column of the printed table means (the HTML report's legend, here too)
    parser.epilog = "table columns: " + "; ".join(f"{k}: {v}" for k, v in COLUMNS.items())
    add_model(parser, default_help=DEFAULT_MODEL)
    parser.add_argument(
        "--trace",
        default=DEFAULT_TRACE,
        metavar="FILE|synthetic:NAME",
        help="a Mooncake-format trace (.jsonl, or .jsonl.gz), or a seeded workload: "
        "synthetic:chat, synthetic:agent, synthetic:docs or synthetic:mixed",
    )
    add_memory(parser)
    parser.add_argument(
        "--strategy",
        default=None,
        choices=["arena", "uniform", "pools", "all"],
        help="memory layout, or all of them side by side (default: all; arena with "
        "--disaggregate, which simulates one)",
    )
    parser.add_argument(
        "--requests",
        type=int,
        default=None,
        metavar="N",
        help="use the first N requests (default: all of a trace, 400 of a synthetic workload)",
    )
    parser.add_argument(
        "--host-memory",
        default=None,
        metavar="SIZE",
        help="a host-memory tier below the device: blocks the device evicts are written back "
        "to it and hits read them back; a comma-separated list (0 = none) sweeps the sizes "
        "with one --strategy, and --report plots hit rate and TTFT against them (default: none)",
    )
    parser.add_argument(
        "--disk-memory",
        default=None,
        metavar="SIZE",
        help="a disk tier below the host tier (or the device): what the tier above evicts "
        "(default: none)",
    )
    parser.add_argument(
        "--write-through",
        choices=("host", "disk"),
        default=None,
        help="that tier (--host-memory or --disk-memory) also takes every block the device "
        "publishes once its step ran, not only what the tier above evicts (default: "
        "write-back on eviction only)",
    )
    parser.add_argument(
        "--disaggregate",
        action="store_true",
        help="a prefill instance and a decode instance (each with --memory, or the prefill "
        "one with --prefill-memory) joined by a --link-bandwidth link; prints prefill and "
        "decode hit rates, bytes moved, TTFT and TPOT (default: one instance).  One "
        "--strategy (arena unless given); not with --report, --host-memory, --disk-memory "
        "or --protect",
    )
    parser.add_argument(
        "--prefill-memory",
        default=None,
        metavar="SIZE",
        help="with --disaggregate: the prefill instance's KV budget (default: --memory)",
    )
    parser.add_argument(
        "--link-bandwidth",
        default=None,
        metavar="SIZE",
        help="with --disaggregate: bytes per second between the instances, e.g. 50GB or "
        "50GB/s (the default: a 400 Gb/s RDMA link; a lowercase b, as in 400Gb, is bits and "
        "refused)",
    )
    add_max_model_len(parser)
    add_block_options(parser, kernel=True)
    add_pool_options(parser)
    parser.add_argument(
        "--token-budget", type=int, default=8192, metavar="TOKENS", help="tokens per step"
    )
    parser.add_argument(
        "--max-num-seqs", type=int, default=256, metavar="N", help="running requests at most"
    )
    add_tp(parser)
    add_kv_cache_dtype(parser)
    add_mtp(parser)
    parser.add_argument(
        "--accelerator",
        default="h100",
        choices=ACCELERATORS,
        help="the cost model's accelerator (step times, TTFT, throughput)",
    )
    parser.add_argument(
        "--no-arrivals", action="store_true", help="ignore arrival times: all requests at once"
    )
    parser.add_argument(
        "--window-retention",
        default=DEFAULT_WINDOW_RETENTION,
        choices=list(WINDOW_RETENTION),
        help="sliding-window blocks cached: only the windows a hit at a likely position reads "
        "(prompt end, hit, junction, computed end), or all",
    )
    parser.add_argument(
        "--publish",
        default="scheduled",
        choices=list(PUBLISH_MODES),
        help="attention blocks join the prefix cache when their step is scheduled (requests "
        "of the same step hit them) or once computed",
    )
    add_admission(parser)
    parser.add_argument(
        "--checkpoint-when-full",
        default=None,
        choices=list(CHECKPOINT_WHEN_FULL),
        help="when the cache cannot also hold a step's state checkpoint: refuse the step "
        "(a request is preempted), skip minor checkpoints (not at a junction or prompt end) "
        "on running requests, or skip any (default: skip_minor on arena, refuse on uniform, "
        "skip on pools)",
    )
    parser.add_argument(
        "--checkpoint-admission",
        default=None,
        choices=list(CHECKPOINT_ADMISSION),
        help="recurrent-state checkpoints saved: where their reason (junction, prompt end, "
        "chunk end, decode) has served at least the cache's average hit tokens per byte, or "
        "at every aligned step end (default: yield)",
    )
    parser.add_argument(
        "--tier-admission",
        default=None,
        choices=list(TIER_ADMISSION),
        help="with --host-memory: a state checkpoint the device evicts whose reason the "
        "checkpoint admission does not save now skips the host tier (to --disk-memory if "
        "given), or every checkpoint goes to the host tier (default: yield)",
    )
    parser.add_argument(
        "--protect",
        default=None,
        choices=list(PROTECT_MODES),
        help="with --host-memory or --disk-memory: 'oracle' plays a client that knows which "
        "requests a later one continues (read off the whole trace) and protects their "
        "prefixes in the lower tiers until then (KVCacheManager.protect); default none",
    )
    parser.add_argument(
        "--protect-share",
        type=float,
        default=None,
        metavar="FRACTION",
        help="with --protect: the share of each lower tier protected sessions may fill; past "
        "it the least recently protected session ends (default "
        f"{DEFAULT_PROTECT_SHARE})",
    )
    parser.add_argument(
        "--eviction",
        default="lru",
        choices=["lru", "2q"],
        help="order of the free-list pools (uniform, pools, and arenas whose chunk is every "
        "group's block or with one group): least recently used, or 2Q (blocks used once wait "
        "on a short probation; only blocks that served a hit or came back soon after their "
        "eviction join the LRU)",
    )
    parser.add_argument(
        "--dead-tails",
        default="auto",
        choices=["auto", "drop", "keep"],
        help="a freed request's attention blocks past the longest hit its tokens have (no "
        "state checkpoint or window serves them): drop them from the cache, keep them in its "
        "LRU, or auto (default): drop without --host-memory / --disk-memory",
    )
    parser.add_argument(
        "--checkpoint-life",
        default=None,
        choices=list(CHECKPOINT_LIFE),
        help="how long a recurrent-state checkpoint stays cached: kv, as long as the KV it "
        "ends (refreshed when its request ends, dropped with the attention block ending where "
        "it does); alone, it ages from when it was saved; or auto (default): kv without "
        "--host-memory / --disk-memory",
    )
    parser.add_argument(
        "--second-chance",
        type=int,
        default=DEFAULT_CHANCES,
        metavar="K",
        help="chances a cached block that served hits holds at most: each hit gives one, each "
        f"time it comes up for eviction it spends one instead (0 off; default {DEFAULT_CHANCES})",
    )
    parser.add_argument(
        "--window-chances",
        type=int,
        default=None,
        metavar="K",
        help="the same for blocks of sliding-window and local-chunk groups (default: "
        f"max(--second-chance, {DEFAULT_WINDOW_CHANCES}), 0 when --second-chance is 0)",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of a synthetic workload (--trace synthetic:NAME)"
    )
    parser.add_argument(
        "--report",
        default=None,
        metavar="DIR",
        help="also write report.json, PNG plots and index.html into DIR, created if missing "
        "(default: no report)",
    )
    parser.add_argument("--json", action="store_true", help="print the summaries as JSON")
    parser.add_argument("--quiet", action="store_true", help="no progress or warnings on stderr")
