"""Plainly wrong arguments to the public entry points raise the library's typed errors.

Each message names the argument, shows the bad value and says what would be valid; a call on a
stateful object that raises leaves it exactly as it was (snapshot and invariants).  Before,
these calls crashed with AttributeError, TypeError, IndexError or InvariantError.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from hybridkv.cache import (
    ComputedBlocks,
    HasherError,
    KVCacheManager,
    LayoutMismatchError,
    Request,
    RequestLengthError,
    TierSpec,
    UnknownRequestError,
    compiled,
)
from hybridkv.errors import (
    ConfigError,
    HybridKVError,
    PlanError,
    RequestError,
    StorageError,
    UnknownModelError,
    brief_repr,
)
from hybridkv.models import catalog_config, catalog_entry, resolve_model, spec_from_config
from hybridkv.plan import (
    Plan,
    blocks_for_request,
    compare_strategies,
    group_entries,
    make_plan,
    spec_blocks_for_request,
)
from hybridkv.sim import ModelProfile, SimConfig, SimulationError, load_model_config, plan_for
from hybridkv.sim import simulate as run_simulation
from hybridkv.specs import ModelSpec
from hybridkv.workloads import (
    SyntheticOptions,
    WorkloadError,
    load_mooncake_trace,
    load_workload,
    synthetic_workload,
)

MODEL = "gpt-oss-20b"
GiB = 1 << 30

Call = Callable[[], object]


@pytest.fixture(scope="module")
def model() -> ModelSpec:
    return resolve_model(MODEL)


@pytest.fixture(scope="module")
def plan(model: ModelSpec) -> Plan:
    return make_plan(model, memory_bytes=GiB, max_model_len=4096)


def _raises(exc: type[Exception], call: Call, *fragments: str) -> str:
    """Run ``call``, expecting exactly ``exc`` with every fragment in its message."""
    with pytest.raises(HybridKVError) as info:
        call()
    assert type(info.value) is exc, f"{type(info.value).__name__}: {info.value}"
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    return message


# -- helpers -------------------------------------------------------------------------------------
def test_brief_repr_shows_the_type_and_cuts_a_huge_value() -> None:
    assert brief_repr("gpt-oss-20b") == "'gpt-oss-20b' (str)"
    shown = brief_repr(list(range(10_000)))
    assert len(shown) < 100 and shown.endswith("... (list)")


# -- plan ----------------------------------------------------------------------------------------
def test_make_plan_given_a_model_name_says_to_resolve_it() -> None:
    message = _raises(
        PlanError,
        lambda: make_plan(MODEL, memory_bytes=GiB, max_model_len=4096),  # type: ignore[arg-type]
        "model: expected a ModelSpec",
        "'gpt-oss-20b' (str)",
        f"resolve_model('{MODEL}')",
    )
    assert "Traceback" not in message


@pytest.mark.parametrize("bad", [None, 3, {"model_type": "gpt_oss"}])
def test_plan_entry_points_refuse_what_is_not_a_model_spec(bad: Any) -> None:
    shown = brief_repr(bad)
    kwargs: dict[str, Any] = {"memory_bytes": GiB, "max_model_len": 4096}
    _raises(PlanError, lambda: make_plan(bad, **kwargs), "model:", shown, "ModelSpec")
    _raises(PlanError, lambda: compare_strategies(bad, **kwargs), "model:", shown)
    _raises(PlanError, lambda: group_entries(bad), "model:", shown)


@pytest.mark.parametrize("strategy", ["pools", "arena"])
def test_pool_ratios_that_are_not_a_sequence(model: ModelSpec, strategy: str) -> None:
    _raises(
        PlanError,
        lambda: make_plan(
            model,
            memory_bytes=GiB,
            max_model_len=4096,
            strategy=strategy,
            pool_ratios=3,  # type: ignore[arg-type]
        ),
        "pool_ratios:",
        "3 (int)",
        "sequence of positive numbers",
    )


def test_compare_strategies_spends_an_iterator_of_ratios_once(model: ModelSpec) -> None:
    given = compare_strategies(
        model,
        memory_bytes=GiB,
        max_model_len=4096,
        pool_ratios=iter([1.0, 3.0]),  # type: ignore[arg-type]
    )
    listed = compare_strategies(model, memory_bytes=GiB, max_model_len=4096, pool_ratios=[1, 3])
    assert not given.failures and not listed.failures
    assert given.plan("pools").layout == listed.plan("pools").layout


def test_block_counts_refuse_what_is_not_a_group_or_spec(plan: Plan) -> None:
    _raises(
        PlanError,
        lambda: blocks_for_request("full", 4),  # type: ignore[arg-type]
        "group: expected a GroupPlan",
        "'full' (str)",
    )
    _raises(
        PlanError,
        lambda: spec_blocks_for_request(["full"], 16, 4),  # type: ignore[arg-type]
        "spec: expected a CacheSpec",
        "['full'] (list)",
    )
    group = plan.layout.groups[1]
    assert blocks_for_request(group, 4096) == spec_blocks_for_request(
        group.spec, group.block_size, 4096
    )


# -- models --------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [None, 3, ["config.json"]])
def test_spec_from_config_of_a_wrong_type(bad: object) -> None:
    _raises(
        ConfigError,
        lambda: spec_from_config(bad),  # type: ignore[arg-type]
        "config: expected a config dict, a path",
        brief_repr(bad),
    )


@pytest.mark.parametrize("bad", [None, 3])
def test_catalog_lookups_of_a_non_string(bad: object) -> None:
    for call in (catalog_entry, catalog_config):
        _raises(
            UnknownModelError,
            lambda: call(bad),  # type: ignore[arg-type]  # noqa: B023
            "name: expected a catalog name",
            brief_repr(bad),
            MODEL,
        )


def test_resolve_model_reads_a_path_object(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(catalog_config(MODEL)))
    by_path = resolve_model(tmp_path)
    assert by_path.layers == resolve_model(str(tmp_path)).layers
    assert by_path.layers == resolve_model(tmp_path / "config.json").layers
    missing = tmp_path / "missing" / "config.json"
    _raises(UnknownModelError, lambda: resolve_model(missing), str(missing), "does not exist")
    # A Path is always a path: one named like a catalog model is not read from the catalog.
    _raises(UnknownModelError, lambda: resolve_model(Path(MODEL)), f"{MODEL!r}")


# -- workloads -----------------------------------------------------------------------------------
def _trace(tmp_path: Path, n: int = 3) -> Path:
    path = tmp_path / "trace.jsonl"
    lines = (
        json.dumps({"timestamp": i, "input_length": 600, "output_length": 2, "hash_ids": [0, i]})
        for i in range(n)
    )
    path.write_text("\n".join(lines) + "\n")
    return path


def test_load_workload_takes_a_path_object(tmp_path: Path) -> None:
    path = _trace(tmp_path)
    by_path = load_workload(path)
    assert by_path.requests == load_workload(str(path)).requests
    assert len(by_path) == 3 and len(load_workload(path, num_requests=2)) == 2
    _raises(WorkloadError, lambda: load_workload(tmp_path / "nope.jsonl"), "nope.jsonl")


@pytest.mark.parametrize("bad", [None, 3, b"synthetic:chat", ["synthetic:chat"]])
def test_load_workload_of_a_wrong_type(bad: object) -> None:
    _raises(
        WorkloadError,
        lambda: load_workload(bad),  # type: ignore[arg-type]
        "trace: expected a Mooncake-format trace file (a str or os.PathLike) or synthetic:NAME",
        brief_repr(bad),
    )


@pytest.mark.parametrize("bad", ["10", 0, -1, 2.5, True])
def test_load_workload_num_requests(bad: object) -> None:
    """0 used to give 400 synthetic requests; a string crashed the comparison."""
    for spec in ("synthetic:chat", "/no/such/trace.jsonl"):
        _raises(
            WorkloadError,
            lambda: load_workload(spec, num_requests=bad),  # type: ignore[arg-type]  # noqa: B023
            "num_requests must be an integer >= 1 (or None",
            brief_repr(bad),
        )


def test_load_workload_seed() -> None:
    _raises(
        WorkloadError,
        lambda: load_workload("synthetic:chat", seed="7"),  # type: ignore[arg-type]
        "seed must be an integer",
        "'7' (str)",
    )


def test_load_mooncake_trace_arguments(tmp_path: Path) -> None:
    path = _trace(tmp_path)
    _raises(
        WorkloadError,
        lambda: load_mooncake_trace(None),  # type: ignore[arg-type]
        "trace: expected a path",
        "None (NoneType)",
    )
    _raises(
        WorkloadError,
        lambda: load_mooncake_trace(path, limit="2"),  # type: ignore[arg-type]
        "trace: limit must be an integer >= 1 (or None), got '2' (str)",
    )
    _raises(
        WorkloadError,
        lambda: load_mooncake_trace(path, source_block=None),  # type: ignore[arg-type]
        "trace: source_block must be an integer >= 1, got None (NoneType)",
    )
    assert len(load_mooncake_trace(path, limit=2)) == 2


@pytest.mark.parametrize(
    ("opts", "fragment"),
    [
        (SyntheticOptions(num_requests="5"), "num_requests must be a positive integer, got '5'"),  # type: ignore[arg-type]
        (SyntheticOptions(seed=1.5), "seed must be an integer, got 1.5 (float)"),  # type: ignore[arg-type]
        (SyntheticOptions(session_gap_ms=-1.0), "session_gap_ms must be a finite number"),
        (SyntheticOptions(turn_gap_ms=math.nan), "turn_gap_ms must be a finite number"),
    ],
)
def test_synthetic_options_are_checked(opts: SyntheticOptions, fragment: str) -> None:
    _raises(WorkloadError, lambda: synthetic_workload("chat", opts), fragment)


def test_synthetic_workload_arguments() -> None:
    _raises(
        WorkloadError,
        lambda: synthetic_workload("chat", 3),  # type: ignore[arg-type]
        "opts must be a SyntheticOptions",
        "3 (int)",
    )
    _raises(
        WorkloadError,
        lambda: synthetic_workload(["chat"]),  # type: ignore[arg-type]
        "unknown synthetic workload ['chat']",
        "valid: agent, chat",
    )


# -- sim -----------------------------------------------------------------------------------------
def test_simulate_arguments_of_the_wrong_type(model: ModelSpec) -> None:
    profile: Any = ModelProfile.from_config(load_model_config(MODEL))
    workload: Any = load_workload("synthetic:chat", num_requests=2)
    config: Any = SimConfig(memory_bytes=GiB, max_model_len=4096)
    sim: Any = model
    none: Any = None
    name: Any = "synthetic:chat"
    mapping: Any = {"memory_bytes": 1}
    cases: list[tuple[str, str, Call]] = [
        (
            "profile: expected a ModelProfile",
            "None (NoneType)",
            lambda: run_simulation(sim, none, workload, config),
        ),
        (
            "workload: expected a Workload",
            "'synthetic:chat' (str)",
            lambda: run_simulation(sim, profile, name, config),
        ),
        (
            "config: expected a SimConfig",
            "{'memory_bytes': 1} (dict)",
            lambda: run_simulation(sim, profile, workload, mapping),
        ),
        ("config: expected a SimConfig", "None (NoneType)", lambda: plan_for(sim, none)),
    ]
    for field, shown, call in cases:
        _raises(SimulationError, call, field, shown)
    _raises(
        PlanError,
        lambda: run_simulation(MODEL, profile, workload, config),  # type: ignore[arg-type]
        "model: expected a ModelSpec",
    )


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("use_arrivals", "yes", "use_arrivals: must be True or False, got 'yes' (str)"),
        ("compaction", 1, "compaction: must be True or False, got 1 (int)"),
        ("checkpoint_before_end", "x", "checkpoint_before_end: must be True, False or None"),
        ("timeline_points", 0, "timeline_points: must be a positive integer, got 0 (int)"),
        ("timeline_points", 2.0, "timeline_points: must be a positive integer, got 2.0"),
        ("label", 5, "label: must be a string or None, got 5 (int)"),
    ],
)
def test_sim_config_fields_only_it_sees(field: str, value: Any, message: str) -> None:
    # the other fields are make_plan's, KVCacheManager's or SchedulerConfig's, checked there
    with pytest.raises(SimulationError) as exc:
        SimConfig(memory_bytes=GiB, max_model_len=4096, **{field: value})
    assert message in str(exc.value)


def test_sim_model_config_arguments(tmp_path: Path) -> None:
    _raises(
        UnknownModelError,
        lambda: load_model_config(None),  # type: ignore[arg-type]
        "model: expected a catalog name",
        "None (NoneType)",
    )
    (tmp_path / "config.json").write_text(json.dumps(catalog_config(MODEL)))
    assert load_model_config(tmp_path) == load_model_config(MODEL)
    _raises(
        ConfigError,
        lambda: ModelProfile.from_config(None),  # type: ignore[arg-type]
        "config: expected a Hugging Face config dict",
        "None (NoneType)",
    )


# -- cache: construction -------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("tiers", "fragments"),
    [
        ([1], ("tiers[0]: expected a TierSpec", "1 (int)")),
        ([TierSpec("host", GiB), "disk"], ("tiers[1]: expected a TierSpec", "'disk' (str)")),
        (1, ("tiers: expected a sequence of TierSpec", "1 (int)")),
        ("host", ("tiers: expected a sequence of TierSpec", "'host' (str)")),
        (TierSpec("host", GiB), ("tiers: expected a sequence of TierSpec", "(TierSpec)")),
    ],
)
def test_manager_tiers_that_are_not_tier_specs(
    plan: Plan, tiers: object, fragments: tuple[str, ...]
) -> None:
    _raises(PlanError, lambda: KVCacheManager(plan.layout, tiers=tiers), *fragments)  # type: ignore[arg-type]


def test_manager_hasher_of_a_wrong_type(plan: Plan) -> None:
    if compiled():  # the compiled build checks the annotated type at the call
        with pytest.raises(TypeError):
            KVCacheManager(plan.layout, hasher=3)  # type: ignore[arg-type]
        return
    _raises(
        HasherError,
        lambda: KVCacheManager(plan.layout, hasher=3),  # type: ignore[arg-type]
        "hasher: expected a BlockHasher or a name",
        "3 (int)",
    )


# -- cache: calls on a live manager --------------------------------------------------------------
@pytest.fixture
def live(plan: Plan) -> Iterator[tuple[KVCacheManager, Request]]:
    """A manager holding one allocated, computed request ``r0``; checked unchanged after."""
    mgr = KVCacheManager(plan.layout, tiers=[TierSpec("host", GiB)])
    req = mgr.make_request("r0", list(range(100)))
    assert mgr.allocate_slots(req, 100) is not None
    req.num_computed_tokens = 100
    mgr.check_invariants()
    yield mgr, req
    mgr.check_invariants()


#: (exception, fragments of its message, the call, whether the argument's annotated type is
#: wrong: the compiled build then raises TypeError at the call instead)
Case = tuple[type[HybridKVError], tuple[str, ...], Callable[[Any, Any], object], bool]

CASES: dict[str, Case] = {
    "free-unhashable": (
        UnknownRequestError,
        ("free: request_id must be a str", "[1] (list)"),
        lambda m, r: m.free([1]),
        True,
    ),
    "free-none": (
        UnknownRequestError,
        ("free: request_id", "None (NoneType)"),
        lambda m, r: m.free(None),
        True,
    ),
    "preempt-unhashable": (
        UnknownRequestError,
        ("preempt: request_id", "[1] (list)"),
        lambda m, r: m.preempt([1]),
        True,
    ),
    "get_block_ids-unhashable": (
        UnknownRequestError,
        ("get_block_ids: request_id", "['r0'] (list)"),
        lambda m, r: m.get_block_ids(["r0"]),
        True,
    ),
    "has_blocks-unhashable": (
        UnknownRequestError,
        ("has_blocks: request_id", "{'r0'} (set)"),
        lambda m, r: m.has_blocks({"r0"}),
        True,
    ),
    "drop_unread-none": (
        UnknownRequestError,
        ("drop_unread: request_id", "None (NoneType)"),
        lambda m, r: m.drop_unread(None, 1),
        True,
    ),
    "is_allocated-group-past-end": (
        LayoutMismatchError,
        ("is_allocated: group_id 99 is not a group", "valid: 0..1"),
        lambda m, r: m.is_allocated(99, 1),
        False,
    ),
    "is_allocated-group-negative": (
        LayoutMismatchError,
        ("is_allocated: group_id -1 is not a group", "valid: 0..1"),
        lambda m, r: m.is_allocated(-1, 1),
        False,
    ),
    "is_allocated-group-str": (
        LayoutMismatchError,
        ("is_allocated: group_id must be an integer", "'0' (str)"),
        lambda m, r: m.is_allocated("0", 1),
        True,
    ),
    "is_allocated-block-str": (
        LayoutMismatchError,
        ("is_allocated: block_id must be an integer", "'1' (str)"),
        lambda m, r: m.is_allocated(0, "1"),
        True,
    ),
    "chunk_owner-past-end": (
        LayoutMismatchError,
        ("chunk_owner: chunk 1000000000 is not a chunk", "valid: [0, "),
        lambda m, r: m.chunk_owner(10**9),
        False,
    ),
    "chunk_owner-negative": (
        LayoutMismatchError,
        ("chunk_owner: chunk -1 is not a chunk", "valid: [0, "),
        lambda m, r: m.chunk_owner(-1),
        False,
    ),
    "chunk_owner-str": (
        LayoutMismatchError,
        ("chunk_owner: chunk must be an integer", "'3' (str)"),
        lambda m, r: m.chunk_owner("3"),
        True,
    ),
    "pool-chunk_owner-past-end": (
        LayoutMismatchError,
        ("chunk_owner: chunk 1000000000 is not a chunk",),
        lambda m, r: m.pool.chunk_owner(10**9),
        False,
    ),
    "new_computed_blocks-int": (
        RequestError,
        ("new_computed_blocks: expected the ComputedBlocks", "3 (int)"),
        lambda m, r: m.allocate_slots(
            m.make_request("r1", list(range(40))), 8, new_computed_blocks=3
        ),
        True,
    ),
    "tier_blocks-none": (
        RequestError,
        ("tier_blocks: computed must be the ComputedBlocks", "None (NoneType)"),
        lambda m, r: m.tier_blocks(r, None),
        True,
    ),
    "compact-pinned-int": (
        RequestError,
        ("compact: pinned must be a collection of request ids", "3 (int)"),
        lambda m, r: m.compact(r, 0, pinned=3),
        False,
    ),
    "compact-pinned-str": (
        RequestError,
        ("compact: pinned must be a collection", "'r0' (str)"),
        lambda m, r: m.compact(r, 0, pinned="r0"),
        False,
    ),
    "compact-pinned-item": (
        UnknownRequestError,
        ("compact: pinned: request_id must be a str", "3 (int)"),
        lambda m, r: m.compact(r, 0, pinned=[3]),
        True,  # annotated: the compiled build refuses it at the call
    ),
    "protect-session-none": (
        RequestError,
        ("protect: session must be a non-empty str", "None (NoneType)"),
        lambda m, r: m.protect("r0", None),
        True,
    ),
    "protect-id-list": (
        UnknownRequestError,
        ("protect: request_id", "['r0'] (list)"),
        lambda m, r: m.protect(["r0"], "s"),
        True,
    ),
    "unprotect-list": (
        RequestError,
        ("unprotect: session must be a str", "['s'] (list)"),
        lambda m, r: m.unprotect(["s"]),
        True,
    ),
    "discard-group-past-end": (
        LayoutMismatchError,
        ("discard_tier_block: group_id 99 is not a group",),
        lambda m, r: m.discard_tier_block(99, 5),
        False,
    ),
    "discard-group-str": (
        LayoutMismatchError,
        ("discard_tier_block: group_id must be an integer", "'a' (str)"),
        lambda m, r: m.discard_tier_block("a", 5),
        True,
    ),
    "discard-hash-str": (
        LayoutMismatchError,
        ("discard_tier_block: block_hash must be an integer", "'x' (str)"),
        lambda m, r: m.discard_tier_block(0, "x"),
        True,
    ),
    "adopt-entries-int": (
        StorageError,
        ("adopt_tier_entries: entries must be a sequence", "3 (int)", "nothing adopted"),
        lambda m, r: m.adopt_tier_entries("host", 3),
        True,  # annotated: the compiled build refuses it at the call
    ),
    "mm_items-int": (
        RequestError,
        ("Request(r1).mm_items: item 0 is 3 (int)", "MultiModalItem(identifier"),
        lambda m, r: m.make_request("r1", [1, 2], mm_items=[3]),
        False,
    ),
    "mm_items-bad-offset": (
        RequestError,
        ("Request(r1).mm_items: item 0 is ('img', '0', 1) (tuple)",),
        lambda m, r: m.make_request("r1", [1, 2], mm_items=[("img", "0", 1)]),
        False,
    ),
    "mm_items-not-sequence": (
        RequestError,
        ("Request(r1).mm_items: expected a sequence", "5 (int)"),
        lambda m, r: m.make_request("r1", [1, 2], mm_items=5),
        False,
    ),
    # found by review: a junction of None failed inside the allocation, after the request
    # had taken blocks; an object's repr (another in every process) keyed the hashes
    "new_computed_blocks-junction-none": (
        RequestLengthError,
        ("new_computed_blocks.junction_tokens must be an integer", "None (NoneType)"),
        lambda m, r: _allocate_with_junction(m, None),
        True,
    ),
    "new_computed_blocks-junction-past-end": (
        RequestLengthError,
        ("new_computed_blocks.junction_tokens 1000000000 outside [",),
        lambda m, r: _allocate_with_junction(m, 10**9),
        False,
    ),
    "lora_id-object": (
        RequestError,
        ("Request.lora_id: must be an int, a str or None", "(object)"),
        lambda m, r: m.make_request("r1", [1, 2], lora_id=object()),
        True,
    ),
    "cache_salt-int": (
        RequestError,
        ("Request.cache_salt: must be a str or None", "123 (int)"),
        lambda m, r: m.make_request("r1", [1, 2], cache_salt=123),
        True,
    ),
    "hasher-str": (
        RequestError,
        ("Request.hasher: must be a BlockHasher", "'xxh3' (str)"),
        lambda m, r: Request("r1", [1, 2], hash_block_size=4, hasher="xxh3"),
        True,
    ),
}


def test_a_bool_block_size_is_refused_by_the_pure_build() -> None:
    # The compiled build reads a bool passed for an int as 0 / 1 (setup.py says so).
    if compiled():
        assert Request("r1", [1, 2], hash_block_size=True).hash_block_size == 1
        return
    _raises(
        RequestError,
        lambda: Request("r1", [1, 2], hash_block_size=True),
        "Request.hash_block_size: must be a positive integer, got True",
    )


def _allocate_with_junction(mgr: KVCacheManager, junction: Any) -> Any:
    none = ComputedBlocks(tuple(() for _ in mgr.num_free_blocks), 0, junction)  # no hit
    r1 = mgr.make_request("r1", list(range(40)))
    return mgr.allocate_slots(r1, 8, new_computed_blocks=none)


@pytest.mark.parametrize("name", list(CASES))
def test_bad_calls_on_a_live_manager_change_nothing(
    live: tuple[KVCacheManager, Request], name: str
) -> None:
    mgr, req = live
    exc, fragments, call, wrong_type = CASES[name]
    before = mgr.snapshot()
    free_before = mgr.num_free_blocks
    if compiled() and wrong_type:
        with pytest.raises((TypeError, exc)):
            call(mgr, req)
    else:
        _raises(exc, lambda: call(mgr, req), *fragments)
    assert mgr.snapshot() == before
    assert mgr.num_free_blocks == free_before
    assert mgr.has_blocks("r0") and not mgr.has_blocks("r1")


def test_the_valid_calls_still_answer(live: tuple[KVCacheManager, Request]) -> None:
    mgr, req = live
    table = mgr.get_block_ids("r0")
    block = table[1][0]
    assert mgr.is_allocated(1, block) and not mgr.is_allocated(1, 10**9)
    assert mgr.chunk_owner(mgr.pool.chunk_of(1, block)) == 1
    assert mgr.compact(req, 0, pinned={"r0"}) == ()
    assert mgr.protect("r0", "session") > 0 and mgr.unprotect("session")
    assert mgr.discard_tier_block(0, 5) is False
    mgr.free("r0")
    assert not mgr.has_blocks("r0")
    mgr.check_invariants()


def test_chunk_owner_of_a_layout_without_chunks(model: ModelSpec) -> None:
    layout = make_plan(model, memory_bytes=GiB, max_model_len=4096, strategy="uniform").layout
    mgr = KVCacheManager(layout)
    before = mgr.snapshot()
    _raises(LayoutMismatchError, lambda: mgr.chunk_owner(0), "uniform strategy has no chunks")
    assert mgr.snapshot() == before
    mgr.check_invariants()
