"""Batch descriptions: construction checks, checks against the layout, and atomicity."""

from __future__ import annotations

import functools
import re
from typing import Any

import pytest
import torch

from hybridkv.engine.batch import RequestStep, SlotCopy, StateIO, StepBatch
from hybridkv.engine.errors import BatchError, EngineError
from hybridkv.engine.layouts import fixed_layout
from hybridkv.engine.models import load_model
from hybridkv.engine.probe import ModelProbe, probe_model, probe_model_spec
from hybridkv.engine.runner import ModelRunner
from hybridkv.engine.views import DenseKVViews

pytestmark = pytest.mark.usefixtures("one_thread")


@functools.cache
def _lfm2() -> tuple[Any, ModelProbe]:
    model = load_model("lfm2")
    return model, probe_model(model)


def make_runner() -> ModelRunner:
    """lfm2: group 0 = conv state (layers 0, 2), group 1 = full attention (layers 1, 3)."""
    model, probe = _lfm2()
    layout = fixed_layout(probe_model_spec(probe), block_size=4, num_blocks=8)
    views = DenseKVViews(layout)
    runner = ModelRunner(model, layout, views, probe=probe)
    gen = torch.Generator().manual_seed(0)
    for layer in (1, 3):
        for t in views.attention_kv(layer, 0):
            t.copy_(torch.randn(t.shape, generator=gen))
    for layer in (0, 2):
        t = views.state(layer, 0, "conv")
        t.copy_(torch.randn(t.shape, generator=gen))
    return runner


def snapshot(runner: ModelRunner) -> list[torch.Tensor]:
    views = runner.views
    out = [t.clone() for layer in (1, 3) for t in views.attention_kv(layer, 0)]
    return out + [views.state(layer, 0, "conv").clone() for layer in (0, 2)]


def step(rid: str = "r", **kw: Any) -> RequestStep:
    base: dict[str, Any] = {
        "token_ids": (5, 6, 7),
        "num_computed": 0,
        "block_tables": {1: (1,)},
        "states": {0: StateIO(read_slot=None, write_slot=1)},
    }
    return RequestStep(request_id=rid, **{**base, **kw})


def test_request_step_defaults_and_properties() -> None:
    r = step(
        num_computed=4, block_tables={1: (1, 2)}, states={0: StateIO(read_slot=1, write_slot=1)}
    )
    assert (r.num_new, r.end, r.rope_positions) == (3, 7, (4, 5, 6))
    assert StateIO(read_slot=2, write_slot=3, copies_before=(SlotCopy(src=4, dst=2),)).slots == (
        2,
        3,
        4,
        2,
    )


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"token_ids": ()}, "at least one new token"),
        ({"num_computed": -1}, "num_computed: must be an integer >= 0, got -1"),
        ({"token_ids": (1, -2)}, "token_ids[...]: must be an integer >= 0, got -2"),
        ({"positions": (0, 1)}, "2 positions for 3 tokens"),
        ({"block_tables": {1: (1, -3)}}, "block_tables[1][...]: must be an integer >= 0"),
        (
            {"num_computed": 4, "states": {0: StateIO(read_slot=None, write_slot=1)}},
            "None (zero state) is only valid with num_computed 0, got num_computed 4",
        ),
    ],
)
def test_request_step_rejects_bad_fields(kw: dict[str, Any], message: str) -> None:
    with pytest.raises(BatchError, match=re.escape(message)):
        step(**kw)


def test_batch_and_copies_reject_bad_fields() -> None:
    with pytest.raises(BatchError, match="at least one request"):
        StepBatch(requests=())
    with pytest.raises(BatchError, match="request id 'r' appears twice"):
        StepBatch(requests=(step(), step()))
    with pytest.raises(BatchError, match="src and dst are the same slot 3"):
        SlotCopy(src=3, dst=3)
    with pytest.raises(BatchError, match=re.escape("StateIO.write_slot: must be an integer >= 0")):
        StateIO(read_slot=None, write_slot=-1)


@pytest.mark.parametrize(
    ("requests", "message"),
    [
        ((step(block_tables={}),), "block_tables has groups []; the model's token groups are [1]"),
        ((step(states={}),), "states has groups []; the model's state groups are [0]"),
        ((step(block_tables={1: (0,)}),), "token 0 (written) is in block index 0"),
        ((step(block_tables={1: (8,)}),), "block id 8 is outside [0, 8)"),
        (
            (step(states={0: StateIO(read_slot=None, write_slot=8)}),),
            "names slot 8; valid slots are 1..7 (0 is the null block)",
        ),
        (
            (step(states={0: StateIO(read_slot=None, write_slot=0)}),),
            "names slot 0; valid slots are 1..7",
        ),
        (
            (step(states={0: StateIO(read_slot=2, write_slot=1)}),),
            "read_slot is 2 but num_computed is 0",
        ),
        (
            (step("a"), step("b", states={0: StateIO(read_slot=None, write_slot=2)})),
            "both write new tokens into block 1",
        ),
        ((step("a"), step("b", block_tables={1: (2,)})), "both write slot 1"),
    ],
)
def test_runner_rejects_batches_that_do_not_fit_and_writes_nothing(
    requests: tuple[RequestStep, ...], message: str
) -> None:
    runner = make_runner()
    before = snapshot(runner)
    with pytest.raises(BatchError, match=re.escape(message)):
        runner.execute(StepBatch(requests=requests))
    for a, b in zip(before, snapshot(runner), strict=True):
        assert torch.equal(a, b)


class _FailingViews:
    """Views whose second attention layer is missing: the forward fails mid-pass."""

    def __init__(self, inner: DenseKVViews) -> None:
        self.inner = inner

    def attention_kv(self, layer: int, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        if layer == 3:
            raise EngineError("attention_kv: layer 3 unavailable")
        return self.inner.attention_kv(layer, slot)

    def mla_latent(self, layer: int, slot: int) -> torch.Tensor:
        return self.inner.mla_latent(layer, slot)

    def state(self, layer: int, slot: int, name: str) -> torch.Tensor:
        return self.inner.state(layer, slot, name)


def test_a_failing_pass_restores_the_state_slots() -> None:
    runner = make_runner()
    assert isinstance(runner.views, DenseKVViews)
    states = [runner.views.state(layer, 0, "conv").clone() for layer in (0, 2)]
    runner.views = _FailingViews(runner.views)
    io = StateIO(read_slot=2, write_slot=3, copies_before=(SlotCopy(src=5, dst=2),))
    request = step(num_computed=4, block_tables={1: (1, 2)}, states={0: io})
    with pytest.raises(EngineError, match="layer 3 unavailable"):
        runner.execute(StepBatch(requests=(request,)))
    for layer, want in zip((0, 2), states, strict=True):
        assert torch.equal(runner.views.state(layer, 0, "conv"), want)


def test_copies_and_state_writes_happen_in_order() -> None:
    runner = make_runner()
    views = runner.views
    conv0 = views.state(0, 0, "conv")
    slot5 = conv0[5].clone()
    # restore slot 5 into 2, run from 2 into 3, then checkpoint 3 into 6
    io = StateIO(
        read_slot=2,
        write_slot=3,
        copies_before=(SlotCopy(src=5, dst=2),),
        copies_after=(SlotCopy(src=3, dst=6),),
    )
    out = runner.execute(
        StepBatch(requests=(step(num_computed=4, block_tables={1: (1, 2)}, states={0: io}),))
    )
    assert out.logits["r"].shape == (256,) and out.num_passes == 1
    assert torch.equal(conv0[2], slot5)
    assert torch.equal(conv0[6], conv0[3])
    # lfm2 keeps the last 3 conv inputs: the 3 new tokens replace all of them
    assert not torch.equal(conv0[3], slot5)
