"""benchmarks/compare_vllm.py's repeated runs (``--repeat``): the pure merge of one side's
runs.  The head to head itself needs vLLM (docs/vllm.md) and is not run here."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _run(us: float, hit: float = 0.25, preemptions: int = 3) -> dict[str, Any]:
    return {
        "token_hit_rate": hit,
        "preemptions": preemptions,
        "peak_used_bytes": 1 << 30,
        "finished": 10,
        "rejected": 0,
        "steps": 100,
        "manager_us_per_step": us,
        "hash_us_per_step": us / 10,
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
    assert merged["hash_us_per_step"] == 20.0
    assert merged["calls"] == {"allocate_slots": {"us": 200.0}}
    assert merged["manager_us_per_step_runs"] == [300.0, 100.0, 200.0]
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
