"""make_plan and compare_strategies: validation, JSON round trip, the naive baseline."""

from __future__ import annotations

import pytest

from hybridkv.errors import PlanError, SpecError
from hybridkv.plan import Plan, Strategy, compare_strategies, make_plan
from hybridkv.specs import ModelSpec
from test_plan_factories import chunked, full, mla, model, sliding, state, swa_full_model


def every_kind_model() -> ModelSpec:
    """Full, sliding with sinks, chunked, MLA, state, a no-cache layer and a two-cache layer."""
    ssm = state((3, 8), (2, 4, 8), mixer="gated_deltanet")
    return model(
        [full(), sliding(8, sinks=2), None, chunked(8), mla(), (sliding(8, sinks=2), ssm), ssm],
        max_position_embeddings=4096,
    )


@pytest.mark.parametrize("strategy", list(Strategy))
def test_json_round_trip(strategy: Strategy) -> None:
    plan = make_plan(
        every_kind_model(),
        memory_bytes=1 << 20,
        max_model_len=100,
        strategy=strategy,
        block_size=4,
        chunk_alignment=512,
    )
    again = Plan.from_json(plan.to_json())
    assert again == plan
    assert Plan.from_dict(plan.to_dict()) == plan
    assert plan.to_dict()["utilisation"] == plan.utilisation


def test_from_json_rejects_bad_input() -> None:
    with pytest.raises(PlanError, match="plan: not valid JSON"):
        Plan.from_json("{")
    with pytest.raises(PlanError, match="plan: JSON nested too deeply"):
        Plan.from_json("[" * 100_000 + "]" * 100_000)
    with pytest.raises(PlanError, match="plan: expected a JSON object"):
        Plan.from_json("[1]")
    with pytest.raises(PlanError, match=r"plan: invalid plan data \(KeyError: 'model'"):
        Plan.from_json('{"strategy": "arena"}')
    with pytest.raises(SpecError, match="ModelSpec: missing field 'layers'"):
        Plan.from_json('{"model": {}}')
    good = make_plan(swa_full_model(), memory_bytes=1 << 24, max_model_len=8).to_dict()
    good["model"]["layers"][0]["caches"][0]["kind"] = "bogus"
    with pytest.raises(SpecError, match=r"spec\.kind"):
        Plan.from_dict(good)


def test_strategy_by_name() -> None:
    plan = make_plan(swa_full_model(), memory_bytes=1 << 24, max_model_len=8, strategy="pools")
    assert plan.strategy is Strategy.POOLS


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"memory_bytes": 0}, r"^memory_bytes: must be a positive integer, got 0"),
        ({"memory_bytes": -5}, r"^memory_bytes: must be a positive integer, got -5"),
        ({"memory_bytes": 1.5}, r"^memory_bytes: must be a positive integer, got 1.5"),
        ({"max_model_len": 0}, r"^max_model_len: must be a positive integer, got 0"),
        ({"max_model_len": 1 << 25}, r"^max_model_len: 33554432 is larger than the maximum"),
        ({"block_size": 0}, r"^block_size: must be a positive integer, got 0"),
        ({"block_size": 16, "kernel_block_size": 3}, r"^kernel_block_size: 3 does not divide"),
        ({"state_block_size": -1}, r"^state_block_size: must be a positive integer"),
        ({"chunk_alignment": 0}, r"^chunk_alignment: must be a positive integer"),
        ({"strategy": "paged"}, r"^strategy: unknown strategy 'paged'; valid: arena, uniform"),
        ({"pool_ratios": [1.0, 1.0]}, r"^pool_ratios: only the pools strategy takes ratios"),
        ({"strategy": "pools", "pool_ratios": "1,1"}, r"^pool_ratios: expected a sequence"),
        ({"strategy": "pools", "pool_ratios": [1.0]}, r"^pool_ratios: got 1 ratios \[1.0\]"),
        ({"strategy": "pools", "pool_ratios": [1.0, 0]}, r"^pool_ratios: every ratio"),
    ],
)
def test_bad_input_raises_plan_error(kwargs: dict[str, object], message: str) -> None:
    args: dict[str, object] = {"memory_bytes": 1 << 16, "max_model_len": 32}
    args.update(kwargs)
    with pytest.raises(PlanError, match=message):
        make_plan(swa_full_model(), **args)  # type: ignore[arg-type]


def test_model_without_caching_layers() -> None:
    with pytest.raises(PlanError, match="no caching layers"):
        make_plan(model([None]), memory_bytes=1 << 20, max_model_len=32)


def test_compare_strategies_side_by_side() -> None:
    result = compare_strategies(
        swa_full_model(), memory_bytes=17384, max_model_len=32, block_size=4, chunk_alignment=1024
    )
    assert [p.strategy for p in result.plans] == list(Strategy)
    assert result.failures == ()
    assert [p.capacity.max_concurrent_requests for p in result.plans] == [
        5,
        5,
        4,
    ]  # pools reserves a prefill chunk for the window
    assert result.plan("uniform").waste.total == 256 + 232
    naive = result.naive
    # Every layer keeps 32 tokens of 32 bytes: 4096 per request; exactly 2560 are read.
    assert (naive.bytes_per_request, naive.exact_bytes_per_request) == (4096, 2560)
    assert naive.max_concurrent_requests == 4
    assert naive.waste_bytes == 4 * 1536
    assert naive.physical_need == 4 * 2560
    assert naive.utilisation == 10240 / 17384
    data = result.to_dict()
    assert set(data["plans"]) == {"arena", "uniform", "pools"}
    assert data["naive"]["max_concurrent_requests"] == 4


def test_compare_records_a_failing_strategy() -> None:
    # 3328 bytes hold one request with uniform (13 blocks) but not with the arena (4 KiB).
    result = compare_strategies(
        swa_full_model(), memory_bytes=3328, max_model_len=32, block_size=4, chunk_alignment=1024
    )
    assert [p.strategy for p in result.plans] == [Strategy.UNIFORM]
    assert [f.strategy for f in result.failures] == [Strategy.ARENA, Strategy.POOLS]
    assert "holds no request" in result.failures[0].reason
    with pytest.raises(PlanError, match="strategy: arena failed"):
        result.plan(Strategy.ARENA)


def test_compare_raises_when_every_strategy_fails() -> None:
    with pytest.raises(PlanError, match="holds no request"):
        compare_strategies(swa_full_model(), memory_bytes=100, max_model_len=32)


def test_compare_validates_shared_input_first() -> None:
    with pytest.raises(PlanError, match=r"^kernel_block_size"):
        compare_strategies(
            swa_full_model(), memory_bytes=1 << 20, max_model_len=32, kernel_block_size=5
        )


def test_naive_counts_states_as_states() -> None:
    m = model([full(), state((25,))])
    result = compare_strategies(m, memory_bytes=1 << 20, max_model_len=10, block_size=2)
    assert result.naive.bytes_per_request == 10 * 32 + 100
    assert result.naive.waste_bytes == 0


def test_plan_does_not_touch_the_model() -> None:
    m = every_kind_model()
    before = m.to_dict()
    make_plan(m, memory_bytes=1 << 20, max_model_len=64, block_size=4, chunk_alignment=512)
    assert m.to_dict() == before


@pytest.mark.parametrize("strategy", list(Strategy))
def test_blocks_longer_than_max_model_len_get_a_note(strategy: Strategy) -> None:
    m = model([full(), state((3, 8), (2, 4, 8), mixer="gated_deltanet")])
    plan = make_plan(m, memory_bytes=1 << 24, max_model_len=16, strategy=strategy, block_size=64)
    assert [n for n in plan.notes if n.startswith("block_size")] == [
        "block_size 64 tokens is more than max_model_len 16: a request fills at most 25% of "
        "each block it holds; a block_size of at most 16 leaves less of it empty"
    ]
    # a state group's block is a checkpoint interval: longer than max_model_len is no note
    fits = make_plan(
        m,
        memory_bytes=1 << 24,
        max_model_len=16,
        strategy=strategy,
        block_size=16,
        state_block_size=64,
    )
    assert not [n for n in fits.notes if n.startswith("block_size")]
