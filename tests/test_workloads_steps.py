"""Step-driven workloads (the manager benchmarks' closed loop) and the unbounded-cache bound."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from hybridkv.workloads import (
    BranchingConfig,
    ConversationConfig,
    StepRequest,
    Workload,
    WorkloadError,
    WorkloadRequest,
    arrival_order,
    branching_workload,
    conversation_workload,
    ideal_hit_tokens,
    load_mooncake_trace,
    step_requests,
    step_summary,
)

ROOT = Path(__file__).resolve().parents[1]


def _fingerprint(reqs: Sequence[StepRequest]) -> str:
    h = hashlib.sha256()
    for r in reqs:
        fields = (r.request_id, r.prompt_token_ids, r.output_token_ids)
        h.update(repr((*fields, r.arrival_step, r.parent_id, r.think_steps)).encode())
    return h.hexdigest()[:16]


def _req(rid: str, prompt: Sequence[int], output: Sequence[int], step: int = 0) -> StepRequest:
    return StepRequest(
        request_id=rid,
        prompt_token_ids=tuple(prompt),
        output_token_ids=tuple(output),
        arrival_step=step,
    )


# ------------------------------------------------------------------------------- generators
def test_default_workloads_are_pinned() -> None:
    """docs/vllm.md and the benchmarks quote numbers measured on exactly these requests: a
    change here must come with re-measured numbers."""
    conv, branch = conversation_workload(), branching_workload()
    assert _fingerprint(conv) == "9b9175b2399e5fac"
    assert _fingerprint(branch) == "9ed7ee81ad66e626"
    # the "ideal" column of docs/vllm.md: 58.8% and 67.6% at block 16, 47.8% at block 1040
    assert ideal_hit_tokens(arrival_order(conv), 16) == 284_224
    assert ideal_hit_tokens(arrival_order(conv), 1040) == 230_880
    assert step_summary(conv)["prompt_tokens"] == 483_359
    assert ideal_hit_tokens(arrival_order(branch), 16) == 377_584
    assert step_summary(branch)["prompt_tokens"] == 558_563


def _generate(kind: str, seed: int) -> list[StepRequest]:
    if kind == "conversations":
        return conversation_workload(ConversationConfig(num_requests=50, seed=seed))
    return branching_workload(BranchingConfig(num_requests=50, seed=seed))


@pytest.mark.parametrize("kind", ["conversations", "branching"])
def test_generators_are_deterministic_in_the_seed(kind: str) -> None:
    a, b, c = _generate(kind, 3), _generate(kind, 3), _generate(kind, 4)
    assert a == b
    assert a != c
    assert len(a) == 50


@pytest.mark.parametrize(
    "reqs",
    [
        conversation_workload(ConversationConfig(num_requests=120, seed=1, followup_prob=0.6)),
        branching_workload(BranchingConfig(num_requests=120, seed=1, followup_prob=0.6)),
    ],
    ids=["conversations", "branching"],
)
def test_followups_resend_their_parent(reqs: list[StepRequest]) -> None:
    by_id = {r.request_id: r for r in reqs}
    followups = [r for r in reqs if r.parent_id is not None]
    assert len(followups) > 20
    for r in followups:
        parent = by_id[str(r.parent_id)]
        history = parent.prompt_token_ids + parent.output_token_ids
        assert r.prompt_token_ids[: len(history)] == history
        assert r.prompt_len > len(history)
        assert r.arrival_step >= parent.arrival_step
    assert all(r.prompt_len <= 4000 for r in reqs)
    assert [r.request_id for r in arrival_order(reqs)]  # ids unique, parents known


def test_conversations_continue_the_latest_turn() -> None:
    reqs = conversation_workload(ConversationConfig(num_requests=150, followup_prob=0.7))
    parents = [r.parent_id for r in reqs if r.parent_id is not None]
    assert len(parents) == len(set(parents))  # never two follow-ups of the same turn
    assert {r.think_steps for r in reqs if r.parent_id} == {8}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"num_requests": 0},
            "ConversationConfig: num_requests and num_prefixes must be >= 1, got 0 and 8",
        ),
        ({"followup_prob": 1.5}, "ConversationConfig: followup_prob must be in [0, 1], got 1.5"),
        (
            {"prompt_tokens": (4000, 500)},
            "ConversationConfig: prompt_tokens must be an inclusive range (lo, hi) with 1 <= lo "
            "<= hi, got (4000, 500)",
        ),
        (
            {"arrival_gap_steps": -1.0},
            "ConversationConfig: arrival_gap_steps must be >= 0 steps, got -1.0",
        ),
        ({"think_steps": -2}, "ConversationConfig: think_steps must be >= 0, got -2"),
        (
            {"prefix_tokens": (10, 2_000_000)},
            "ConversationConfig: prefix_tokens must stay below 1000000 tokens, got (10, 2000000)",
        ),
    ],
)
def test_conversation_config_errors(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(WorkloadError) as info:
        ConversationConfig(**kwargs)  # type: ignore[arg-type]
    assert str(info.value) == message


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"think_steps": (3, 1)},
            "BranchingConfig: think_steps must be an inclusive range (lo, hi) with 0 <= lo <= "
            "hi, got (3, 1)",
        ),
        (
            {"prefix_tokens": (256, 3990)},
            "BranchingConfig: the longest prefix plus 32 tokens must fit prompt_tokens, got "
            "prefix_tokens (256, 3990) and prompt_tokens (500, 4000)",
        ),
        ({"zipf_s": -1.0}, "BranchingConfig: zipf_s must be >= 0, got -1.0"),
    ],
)
def test_branching_config_errors(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(WorkloadError) as info:
        BranchingConfig(**kwargs)  # type: ignore[arg-type]
    assert str(info.value) == message


# ------------------------------------------------------------------------ requests and order
def test_step_request_validation() -> None:
    with pytest.raises(WorkloadError) as info:
        _req("a", [], [1])
    assert str(info.value) == (
        "request 'a': prompt_token_ids and output_token_ids must be non-empty, got 0 and 1 tokens"
    )
    with pytest.raises(WorkloadError) as info:
        _req("b", [1], [2], step=-1)
    assert str(info.value) == "request 'b': arrival_step must be >= 0, got -1"


def test_arrival_order_sorts_and_checks_ids() -> None:
    a, b, c = _req("b", [1], [2], step=3), _req("a", [1], [2], step=3), _req("z", [1], [2])
    assert [r.request_id for r in arrival_order([a, b, c])] == ["z", "a", "b"]
    with pytest.raises(WorkloadError) as info:
        arrival_order([a, a])
    assert str(info.value) == "workload: request_id 'b' appears twice"
    orphan = StepRequest(
        request_id="x", prompt_token_ids=(1,), output_token_ids=(2,), arrival_step=0, parent_id="p"
    )
    with pytest.raises(WorkloadError) as info:
        arrival_order([orphan])
    assert str(info.value) == "request 'x': parent_id 'p' names no request of the workload"


def test_step_requests_from_a_timed_workload() -> None:
    timed = Workload(
        "w",
        (
            WorkloadRequest("r0", 0.0, (1, 2), (3,)),
            WorkloadRequest("r1", 149.9, (4,), (5, 6)),
        ),
    )
    steps = step_requests(timed, ms_per_step=50.0)
    assert [(r.request_id, r.arrival_step, r.parent_id) for r in steps] == [
        ("r0", 0, None),
        ("r1", 2, None),
    ]
    assert steps[1].output_token_ids == (5, 6)
    with pytest.raises(WorkloadError) as info:
        step_requests(timed, ms_per_step=0)
    assert str(info.value) == "ms_per_step must be a positive number of ms, got 0"


def test_mooncake_as_step_requests(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    rows = [
        {"timestamp": 120, "input_length": 600, "output_length": 2, "hash_ids": [0, 1]},
        {"timestamp": 10, "input_length": 700, "output_length": 0, "hash_ids": [0, 2]},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    steps = step_requests(load_mooncake_trace(path), ms_per_step=50.0)
    assert [(r.request_id, r.arrival_step, r.output_len) for r in steps] == [
        ("trace-1", 0, 1),
        ("trace-0", 2, 2),
    ]


# ----------------------------------------------------------------------------- ideal bound
def test_ideal_hit_tokens_by_hand() -> None:
    first = _req("a", range(10), [100, 101, 102])
    # shares 8 prompt tokens and 2 of a's outputs: blocks of 4 cover [0, 12) of a's cached
    # sequence (13 tokens, the last output never cached): 12 tokens, but the hit stops at
    # prompt_len - 1 = 11 rounded down to whole blocks -> 8
    second = _req("b", [*range(10), 100, 101], [7])
    third = _req("c", [*range(10), 100, 101, 102, 103, 104], [9])
    assert ideal_hit_tokens([first, second], 4) == 8
    assert ideal_hit_tokens([first, third], 4) == 12
    assert ideal_hit_tokens([first, second], 1) == 11  # capped at prompt_len - 1
    assert ideal_hit_tokens([second, first], 4) == 8  # order matters only for who is first
    assert ideal_hit_tokens([first], 4) == 0
    with pytest.raises(WorkloadError) as info:
        ideal_hit_tokens([first], 0)
    assert str(info.value) == "ideal_hit_tokens: block_size must be >= 1, got 0"


# ------------------------------------------------------- the benchmarks' interpreter contract
def test_workloads_import_only_the_standard_library() -> None:
    code = (
        "import sys, hybridkv.workloads\n"
        "std = sys.stdlib_module_names\n"
        "bad = sorted({m.split('.')[0] for m in sys.modules} - std - {'hybridkv', '__main__'})\n"
        "print(bad)"
    )
    proc = subprocess.run(
        [sys.executable, "-S", "-c", code],
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT / "src")},
        capture_output=True,
        text=True,
        check=True,
    )
    assert proc.stdout.strip() == "[]", proc.stdout + proc.stderr


def test_vllm_driver_runs_without_hybridkv_installed() -> None:
    """The driver runs under vLLM's interpreter, which need not have hybridkv: ``-S`` drops
    site-packages (and this venv's editable install), so ``src/`` must come from the script."""
    script = ROOT / "benchmarks" / "vllm_driver.py"
    proc = subprocess.run(
        [sys.executable, "-S", str(script), "--help"],
        cwd=ROOT / "benchmarks",
        env={},
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "--workload {conversations,branching}" in proc.stdout
