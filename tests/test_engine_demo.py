"""``hybridkv run``'s engine side: two waves through plan, storage, manager and runner."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import pytest
import torch

from hybridkv.engine.demo import add_arguments, run_demo, run_from_args
from hybridkv.engine.errors import BatchError, ModelSourceError


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_default_run_matches_transformers() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    report = run_from_args(parser.parse_args(["--requests", "2", "--max-new-tokens", "5"]))
    assert report.model == "lfm3" and report.strategy == "arena"
    assert report.num_requests == 4 and report.generated_tokens == 20
    # the second wave's two requests each hit the 16-token shared prefix
    assert report.prefix_hit_tokens == 32
    assert report.matches_reference is True
    assert report.max_logit_diff is not None and report.max_logit_diff < 1e-4
    assert [g.split(",")[0] for g in report.groups] == [
        "group 0: state",
        "group 1: sliding_window",
        "group 2: full_attention",
    ]
    assert "identical to transformers' greedy tokens" in report.format()
    assert report.to_dict()["steps"] == report.steps


def test_run_without_check_and_bad_input() -> None:
    report = run_demo("llama", num_requests=1, max_new_tokens=2, strategy="pools", check=False)
    assert report.matches_reference is None and "not checked" in report.format()
    with pytest.raises(BatchError, match="must be >= 1"):
        run_demo("llama", num_requests=0)
    with pytest.raises(ModelSourceError, match="neither a tiny model"):
        run_demo("no-such-model")
