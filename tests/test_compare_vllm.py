"""benchmarks/compare_vllm.py without vLLM: the pure merge of one side's repeated runs
(``--repeat``), the per-run summary and the time ratios (total time over the workload,
with and without hashing), ``--vllm-retention-interval``'s parsing and vLLM's rule for it,
the GC freeze around a run, the printed table, and hybridkv's adapter timing thread CPU
time.  The head to head itself needs vLLM (docs/vllm.md) and is not run here."""

from __future__ import annotations

import gc
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _run(us: float, hit: float = 0.25, preemptions: int = 3) -> dict[str, Any]:
    """A run's summary as :func:`compare_vllm._summary` makes it, 100 steps, ``us`` manager
    microseconds per step (hashing a tenth of it; CPU time half the wall time)."""
    return {
        "token_hit_rate": hit,
        "preemptions": preemptions,
        "peak_used_bytes": 1 << 30,
        "finished": 10,
        "rejected": 0,
        "steps": 100,
        "manager_ns": us * 100e3,
        "hash_ns": us * 10e3,
        "manager_cpu_ns": us * 50e3,
        "hash_cpu_ns": us * 5e3,
        "manager_us_per_step": us,
        "hash_us_per_step": us / 10,
        "manager_cpu_us_per_step": us / 2,
        "hash_cpu_us_per_step": us / 20,
        "calls": {"allocate_slots": {"us": us}},
        "wall_s": 2.0,
    }


@pytest.fixture
def compare_vllm(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.syspath_prepend(str(BENCH))
    import compare_vllm

    return compare_vllm


def test_the_median_run_gives_the_times_and_every_run_is_listed(compare_vllm: Any) -> None:
    merged = compare_vllm.merge_runs([_run(300.0), _run(100.0), _run(200.0)], "hybridkv")
    assert merged["manager_us_per_step"] == 200.0
    # every time comes from that same run: totals, hashing and CPU time too
    assert merged["hash_us_per_step"] == 20.0
    assert merged["manager_ns"] == 200.0 * 100e3
    assert merged["hash_ns"] == 200.0 * 10e3
    assert merged["manager_cpu_ns"] == 200.0 * 50e3
    assert merged["hash_cpu_ns"] == 200.0 * 5e3
    assert merged["manager_cpu_us_per_step"] == 100.0
    assert merged["hash_cpu_us_per_step"] == 10.0
    assert merged["calls"] == {"allocate_slots": {"us": 200.0}}
    assert merged["manager_us_per_step_runs"] == [300.0, 100.0, 200.0]
    assert merged["hash_us_per_step_runs"] == [30.0, 10.0, 20.0]
    assert merged["wall_s"] == 6.0
    assert merged["preemptions"] == 3
    # an even count takes the lower middle: a run that happened, not an average
    assert (
        compare_vllm.merge_runs([_run(4.0), _run(1.0), _run(3.0), _run(2.0)], "x")[
            "manager_us_per_step"
        ]
        == 2.0
    )
    assert compare_vllm.merge_runs([_run(7.0)], "x")["manager_us_per_step_runs"] == [7.0]


@pytest.mark.parametrize(
    ("key", "other"),
    [("token_hit_rate", _run(1.0, hit=0.5)), ("preemptions", _run(1.0, preemptions=4))],
)
def test_runs_that_decide_differently_are_refused(
    compare_vllm: Any, key: str, other: dict[str, Any]
) -> None:
    with pytest.raises(RuntimeError, match=f"vLLM: {key} differs between repeated runs"):
        compare_vllm.merge_runs([_run(1.0), other], "vLLM")
    with pytest.raises(ValueError, match="no runs"):
        compare_vllm.merge_runs([], "vLLM")


def test_repeat_below_one_is_refused_before_any_run(
    compare_vllm: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    # refused whether or not vLLM is importable here (it is checked first)
    assert compare_vllm.main(["--repeat", "0"]) == 2
    assert "--repeat must be at least 1, got 0" in capsys.readouterr().err


def test_without_state_keeps_every_layer_and_cache_but_the_state(compare_vllm: Any) -> None:
    """``--ceiling``'s model: the same layers, attention caches unchanged, every state cache
    gone (a layer left with nothing stores NoCacheSpec); a model without state has none."""
    from hybridkv.models import resolve_model
    from hybridkv.plan import make_plan
    from hybridkv.specs import LayerSpec, ModelSpec, NoCacheSpec, StateSpec

    jamba = resolve_model("Jamba-v0.1")
    bare = compare_vllm.without_state(jamba)
    assert bare.num_layers == jamba.num_layers == 32
    for old, new in zip(jamba.layers, bare.layers, strict=True):
        kept = tuple(c for c in old.caches if not isinstance(c, StateSpec))
        assert new.caches == (kept or (NoCacheSpec(),))
        assert (new.index, new.layer_type, new.tag) == (old.index, old.layer_type, old.tag)
    assert sum(1 for _, _, s in bare.entries()) == 4  # Jamba's four attention layers
    plan = make_plan(bare, memory_bytes=1 << 30, max_model_len=4096)
    assert [g.spec.kind.value for g in plan.layout.groups] == ["full_attention"]
    assert compare_vllm.without_state(resolve_model("gpt-oss-20b")) is None
    # a layer holding attention and state at once keeps its attention
    both = jamba.layers[4].caches + jamba.layers[0].caches
    mixed = ModelSpec(
        name="mixed",
        model_type="test",
        layers=(LayerSpec(index=0, layer_type="hybrid", caches=both),),
    )
    assert compare_vllm.without_state(mixed).layers[0].caches == jamba.layers[4].caches


def test_summary_totals_and_per_step_times_from_known_timings(compare_vllm: Any) -> None:
    """Manager time is the MANAGER_OPS (admission_check included), hashing the "hash" op;
    totals in ns, per step over this run's own steps; thread CPU time the same way (an op
    missing from ``cpu_ns``, as admission_check on vLLM's side, counts 0)."""
    timings = {
        "get_computed_blocks": [1000, 2000],
        "allocate_slots": [3000],
        "free": [4000],
        "end_step": [0, 0],
        "admission_check": [500],
        "hash": [7000, 3000],
    }
    cpu_ns = {"get_computed_blocks": 2000, "allocate_slots": 1000, "free": 1000, "hash": 6000}
    metrics = {
        "token_hit_rate": 0.5,
        "preemptions": 1,
        "peak_used_bytes": 123,
        "finished": 2,
        "rejected": 0,
        "steps": 4,
        "wall_s": 0.1,
    }
    s = compare_vllm._summary(metrics, timings, cpu_ns)
    assert s["manager_ns"] == 10_500
    assert s["hash_ns"] == 10_000
    assert s["manager_cpu_ns"] == 4000
    assert s["hash_cpu_ns"] == 6000
    assert s["manager_us_per_step"] == pytest.approx(10.5 / 4)
    assert s["hash_us_per_step"] == pytest.approx(10.0 / 4)
    assert s["manager_cpu_us_per_step"] == pytest.approx(1.0)
    assert s["hash_cpu_us_per_step"] == pytest.approx(1.5)
    assert s["calls"]["hash"]["calls"] == 2
    assert s["calls"]["hash"]["cpu_mean_us"] == pytest.approx(3.0)
    assert s["calls"]["admission_check"]["cpu_mean_us"] == 0.0
    assert {k: s[k] for k in compare_vllm.DECISIONS} == {
        k: metrics[k] for k in compare_vllm.DECISIONS
    }


def test_time_ratios_are_of_total_time_not_of_per_step_time(compare_vllm: Any) -> None:
    """hybridkv takes twice vLLM's steps here: its per-step time is a quarter of vLLM's but
    its total time half of it, and the ratio is the total's."""
    vllm = {**_run(20.0), "steps": 100, "manager_ns": 2e6, "hash_ns": 1e6}
    vllm.update(manager_cpu_ns=1e6, hash_cpu_ns=1e6)
    ours = {**_run(5.0), "steps": 200, "manager_ns": 1e6, "hash_ns": 2e6}
    ours.update(manager_cpu_ns=1.5e6, hash_cpu_ns=0.5e6)
    r = compare_vllm.time_ratios(vllm, ours)
    assert r["manager_time"] == pytest.approx(0.5)
    assert r["manager_time_with_hash"] == pytest.approx(1.0)  # (1 + 2) / (2 + 1)
    assert r["manager_cpu_time"] == pytest.approx(1.5)
    assert r["manager_cpu_time_with_hash"] == pytest.approx(1.0)
    zero = {**vllm, "manager_ns": 0, "hash_ns": 0, "manager_cpu_ns": 0, "hash_cpu_ns": 0}
    assert set(compare_vllm.time_ratios(zero, ours).values()) == {None}


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("default", "default"),
        ("Default", "default"),
        ("none", None),
        ("None", None),
        ("512", 512),
        (" 16 ", 16),
        ("1056", 1056),
    ],
)
def test_retention_interval_values(compare_vllm: Any, text: str, value: Any) -> None:
    assert compare_vllm.parse_retention_interval(text) == value


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("0", "must be a positive integer"),
        ("-16", "must be a positive integer"),
        ("abc", "is not 'default', 'none' or a positive integer"),
        ("1.5", "is not 'default', 'none' or a positive integer"),
        ("", "is not 'default', 'none' or a positive integer"),
    ],
)
def test_bad_retention_interval_is_one_line_and_exit_2_before_any_run(
    compare_vllm: Any, capsys: pytest.CaptureFixture[str], text: str, why: str
) -> None:
    with pytest.raises(ValueError, match=why):
        compare_vllm.parse_retention_interval(text)
    # refused whether or not vLLM is importable here (it is checked first)
    assert compare_vllm.main(["--vllm-retention-interval", text, "--out", "/dev/null"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("compare_vllm: --vllm-retention-interval: ")
    assert why in err
    assert err.count("\n") == 1


@pytest.mark.parametrize(
    ("interval", "block", "kinds", "refused"),
    [
        (None, 16, ["full"], None),
        (None, 1056, ["full", "mamba"], None),
        (0, 16, ["full"], None),
        (0, 16, ["sliding", "full"], None),
        (512, 16, ["sliding", "full"], None),
        (520, 16, ["sliding", "full"], "multiple of its scheduler block size \\(16\\)"),
        (512, 1056, ["full", "mamba"], "multiple of its scheduler block size \\(1056\\)"),
        (2112, 1056, ["full", "mamba"], None),
        (512, 16, ["full"], "no sliding-window or Mamba group"),
        (512, 16, ["mla"], "no sliding-window or Mamba group"),
    ],
)
def test_vllm_retention_interval_rule(
    compare_vllm: Any, interval: int | None, block: int, kinds: list[str], refused: str | None
) -> None:
    """vllm_setup's copy of vLLM 0.33's check (kv_cache_coordinator), made before any
    manager is built; where vLLM is importable, vLLM's own function must agree."""
    import vllm_setup

    error = vllm_setup.retention_interval_error(interval, block, kinds)
    if refused is None:
        assert error is None
    else:
        assert error is not None
        assert "\n" not in error
        assert re.search(refused, error)
    try:
        from vllm.v1.core import kv_cache_coordinator as coordinator
        from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec
    except ImportError:
        return
    spec = {"full": FullAttentionSpec, "mla": FullAttentionSpec, "sliding": SlidingWindowSpec}
    spec["mamba"] = MambaSpec
    config = SimpleNamespace(
        kv_cache_groups=[SimpleNamespace(kv_cache_spec=object.__new__(spec[k])) for k in kinds]
    )
    try:
        coordinator._validate_prefix_cache_retention_interval(interval, block, config)
    except ValueError:
        assert refused is not None
    else:
        assert refused is None


def test_run_frozen_freezes_the_heap_for_the_run_only(
    compare_vllm: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both sides run through ``_run_frozen``: collect + freeze before, unfreeze after,
    also when the run raises."""
    seen: list[int] = []

    def fake_run(adapter: Any, requests: Any, token_budget: int, **kw: Any) -> dict[str, Any]:
        seen.append(gc.get_freeze_count())
        if adapter == "boom":
            raise RuntimeError("boom")
        return {"steps": 1, "max_model_len": kw["max_model_len"]}

    monkeypatch.setattr(compare_vllm.vd, "run_minimal_scheduler", fake_run)
    gc.unfreeze()
    assert compare_vllm._run_frozen("ok", [], 8, 64) == {"steps": 1, "max_model_len": 64}
    assert seen[-1] > 0
    assert gc.get_freeze_count() == 0
    with pytest.raises(RuntimeError, match="boom"):
        compare_vllm._run_frozen("boom", [], 8, 64)
    assert seen[-1] > 0
    assert gc.get_freeze_count() == 0


def test_printed_table_shows_retention_hashing_and_total_time_ratios(
    compare_vllm: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    vllm = {**_run(20.0), "retention_interval": "default", "prefix_cache_retention_interval": 0}
    vllm["manager_us_per_step_runs"] = [20.0]
    ours = {**_run(5.0), "strategy": "arena", "manager_us_per_step_runs": [5.0]}
    ratios = {"hit_rate": 1.0, **compare_vllm.time_ratios(vllm, ours)}
    result = {"model": "m", "memory_bytes": 64 << 30, "vllm": vllm, "hybridkv": ours}
    compare_vllm._print({**result, "ratios": ratios})
    out = capsys.readouterr().out.splitlines()
    assert out[1] == "m at 64.0 GiB; vLLM prefix_cache_retention_interval: default (0)"
    assert out[2].split()[-4:] == ["mgr", "us/step", "hash", "us/step"]
    assert out[3].split()[-2:] == ["20.0", "2.0"]
    assert out[4].split()[-2:] == ["5.0", "0.5"]
    assert out[5] == (
        "  hybridkv / vLLM: hit rate 1.00x; total time over the workload: "
        "manager 0.25x, manager + hashing 0.25x"
    )
    compare_vllm._print(
        {**result, "vllm": {**vllm, "retention_interval": "none"}, "ratios": ratios}
    )
    assert "vLLM prefix_cache_retention_interval: none" in capsys.readouterr().out


def test_hybridkv_adapter_times_thread_cpu_as_vllms_does(compare_vllm: Any) -> None:
    """The hybridkv side (no vLLM needed) through the shared loop: thread CPU time per op
    next to the wall times, into the summary's CPU fields."""
    from hybridkv.cache import KVCacheManager
    from hybridkv.models import resolve_model
    from hybridkv.plan import make_plan
    from hybridkv.workloads import ConversationConfig, conversation_workload

    plan = make_plan(resolve_model("gpt-oss-20b"), memory_bytes=1 << 30, max_model_len=8192)
    adapter = compare_vllm.HybridkvAdapter(
        KVCacheManager(plan.layout, hasher="sha256"), token_budget=2048
    )
    requests = conversation_workload(
        ConversationConfig(num_requests=6, prompt_tokens=(200, 600), output_tokens=(4, 8))
    )
    metrics = compare_vllm._run_frozen(adapter, requests, 2048, 8192)
    assert set(adapter.cpu_ns) == set(adapter.timings)
    for op in ("hash", "get_computed_blocks", "allocate_slots", "free"):
        assert adapter.timings[op], op
        assert adapter.cpu_ns[op] > 0, op
    s = compare_vllm._summary(metrics, adapter.timings, adapter.cpu_ns)
    assert s["manager_cpu_ns"] == sum(adapter.cpu_ns[op] for op in compare_vllm.MANAGER_OPS)
    assert s["hash_cpu_ns"] == adapter.cpu_ns["hash"] > 0
    assert s["manager_cpu_us_per_step"] > 0
