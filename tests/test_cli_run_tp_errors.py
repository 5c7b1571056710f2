"""``hybridkv run --disaggregate`` with tensor-parallel sizes: a size that does not split the
model's caches is one line on stderr and exit 2, found before any process starts (the CLI
and :func:`hybridkv.engine.disaggregate.run_disaggregated` alike); why a request was
recomputed instead of decoded from the prefill side's data is recorded and printed."""

from __future__ import annotations

import argparse
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import torch

from hybridkv.cli import run_disagg
from hybridkv.cli.main import main
from hybridkv.engine import CacheConfig, LLMEngine
from hybridkv.engine import disaggregate as disagg
from hybridkv.engine.disaggregate import DisaggregatedResult, check_tp_sizes, run_disaggregated
from hybridkv.engine.handover import export_request, import_request
from hybridkv.engine.tp_shards import TPSplitError, check_tp, shard_caches, valid_tp_sizes
from hybridkv.storage.transfer_plan import TransferPlan


@pytest.fixture(autouse=True)
def _threads() -> Iterator[None]:
    before = torch.get_num_threads()  # `run` sets 1 thread for tiny models
    yield
    torch.set_num_threads(before)


@pytest.fixture
def no_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Starting the prefill and decode processes fails the test: the check comes first."""

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("processes were started before the tp sizes were checked")

    monkeypatch.setattr(disagg.mp, "get_context", refuse)


# lfm3 (the default model): state tensor 'conv' (64, 7) and 2 KV heads: tp 1 or 2 only
BAD_TP = [
    (
        ("--prefill-tp", "3"),
        "--prefill-tp 3: lfm3's state tensor 'conv' (64, 7) does not split over tp 3 along "
        "axis 0; valid for lfm3: 1, 2",
    ),
    (
        ("--decode-tp", "3"),
        "--decode-tp 3: lfm3's state tensor 'conv' (64, 7) does not split over tp 3 along "
        "axis 0; valid for lfm3: 1, 2",
    ),
    (
        ("--decode-tp", "4"),
        "--decode-tp 4: lfm3's 2 KV heads do not split over tp 4; valid for lfm3: 1, 2",
    ),
    (
        ("--prefill-tp", "2", "--decode-tp", "4"),
        "--decode-tp 4: lfm3's 2 KV heads do not split over tp 4; valid for lfm3: 1, 2",
    ),
    (
        ("--model", "llama", "--prefill-tp", "4"),
        "--prefill-tp 4: llama's 2 KV heads do not split over tp 4; valid for llama: 1, 2",
    ),
]


@pytest.mark.parametrize(("flags", "message"), BAD_TP, ids=[" ".join(f) for f, _ in BAD_TP])
@pytest.mark.usefixtures("no_processes")
def test_a_tp_size_the_caches_do_not_split_is_one_line_and_exit_2(
    flags: tuple[str, ...], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["run", "--disaggregate", *flags, "--quiet"])
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    assert "Traceback" not in out + err
    assert out == ""
    assert err.splitlines() == [f"hybridkv run: error: {message}"]


@pytest.mark.usefixtures("no_processes")
def test_the_library_refuses_a_tp_size_before_any_process_starts() -> None:
    prompts = [[1, 2, 3]]
    cache = CacheConfig(publish="computed")
    with pytest.raises(TPSplitError, match=r"^prefill_tp: 3: lfm3's state tensor 'conv'"):
        run_disaggregated(
            ["lfm3"], prompts, max_tokens=2, prefill_cache=cache, decode_cache=cache, prefill_tp=3
        )
    with pytest.raises(TPSplitError, match=r"^decode_tp: 4: llama's 2 KV heads .* 1, 2$"):
        run_disaggregated(
            ["deepseek_v3", "llama"],  # every size splits the first, not the second
            prompts,
            max_tokens=2,
            prefill_cache=cache,
            decode_cache=cache,
            prefill_tp=2,
            decode_tp=4,
        )
    with pytest.raises(TPSplitError, match=r"^decode_tp: must be a positive integer, got 0"):
        check_tp_sizes("llama", prefill_tp=1, decode_tp=0)
    check_tp_sizes("deepseek_v3", prefill_tp=3, decode_tp=5)  # MLA latents: whole on every rank


@pytest.mark.parametrize("name", ["lfm3", "qwen3_next", "kimi_linear", "deepseek_v3"])
def test_the_up_front_check_agrees_with_the_emulation(name: str) -> None:
    """:func:`check_tp_sizes` (from the config) accepts exactly the sizes
    :func:`shard_caches` (from the engine's probed layout) can split."""
    layout = LLMEngine(name).layout
    specs = [g.spec for g in layout.groups]
    valid = valid_tp_sizes(specs)
    for tp in range(1, 7):
        try:
            shard_caches(layout, tp, 16)
            splits = True
        except TPSplitError:
            splits = False
        try:
            check_tp_sizes(name, prefill_tp=tp, decode_tp=tp)
            checked = True
        except TPSplitError:
            checked = False
        assert splits == checked == (valid is None or tp in valid), (name, tp)
    if name == "deepseek_v3":
        assert valid is None
    else:
        assert valid is not None and valid[:2] == [1, 2]
        check_tp(specs, 2, field="tp")
        with pytest.raises(TPSplitError, match=r"^tp: 7: .*; valid: 1, 2"):
            check_tp(specs, 7, field="tp")


def test_an_import_that_falls_back_records_why() -> None:
    cache = CacheConfig(strategy="pools", block_size=4, num_blocks=64, max_model_len=96)
    pre = LLMEngine("lfm2", cache=cache, keep_logits=True)
    dec = LLMEngine("lfm2", cache=CacheConfig(publish="computed", max_model_len=96))
    pre.add_request("r0", list(range(1, 21)), max_tokens=1, hold=True)
    pre.run()

    def pull(plan: TransferPlan, source: int, buffers: Sequence[torch.Tensor]) -> None:
        plan.copy(pre.storage.buffers, buffers)

    reasons: dict[str, str] = {}
    handover = export_request(pre, "r0")
    assert not import_request(dec, handover, max_tokens=3, pull=pull, decode_tp=3, reasons=reasons)
    assert list(reasons) == ["r0"]
    assert reasons["r0"].startswith("the decode instance cannot hold it at tp 3: group ")
    assert "does not split over tp 3" in reasons["r0"]
    dec.run()  # recomputed from its prompt
    assert dec.completions["r0"].num_cached_tokens == 0
    # and one that imports records nothing
    pre.add_request("r1", list(range(1, 21)), max_tokens=1, hold=True)
    pre.run()
    assert import_request(
        dec, export_request(pre, "r1"), max_tokens=3, pull=pull, decode_tp=2, reasons=reasons
    )
    assert list(reasons) == ["r0"]


def test_the_cli_prints_one_line_per_distinct_reason(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from hybridkv.engine.llm_engine import Completion
    from hybridkv.scheduler.types import FinishReason

    def fake(models: list[str], prompts: list[list[int]], **kw: Any) -> dict[str, Any]:
        done = {
            f"r{i}": Completion(
                request_id=f"r{i}",
                prompt_token_ids=tuple(p),
                token_ids=(1, 2),
                finish_reason=FinishReason.LENGTH,
                num_cached_tokens=0,
                num_preemptions=0,
            )
            for i, p in enumerate(prompts)
        }
        lost = "not handed over: the prefill process was lost at request r5"
        result = DisaggregatedResult(
            completions=done,
            imported=3,
            recomputed=5,
            errors=["transfer: could not receive metadata from rank 0: gone"],
            reasons={
                "r1": "no transfer plan from the prefill side: layer 1 slot 0 'k': ...",
                "r5": "transfer: could not receive metadata from rank 0: gone",
                "r6": lost,
                "r7": lost,
                "r8": lost,
            },
        )
        return {models[0]: result}

    import hybridkv.engine.disaggregate as engine_disagg

    monkeypatch.setattr(engine_disagg, "run_disaggregated", fake)
    args = argparse.Namespace(
        speculate=0,
        host_memory=None,
        disk_cache=None,
        write_through=None,
        attention_sinks=0,
        device="cpu",
        prefill_tp=None,
        decode_tp=None,
        quiet=True,
        model="llama",
        max_tokens=2,
        seed=0,
        verify=False,
    )
    assert run_disagg.run_disaggregated(args, CacheConfig(), [[5, 6]] * 9, None) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "3 of 9 requests decoded" in lines[9] and "5 recomputed" in lines[9]
    # the connection error is the reason of r5: printed once, not again as an error line
    assert lines[10:] == [
        "  3 recomputed (r6, r7, r8): not handed over: the prefill process was lost at request r5",
        "  1 recomputed (r1): no transfer plan from the prefill side: layer 1 slot 0 'k': ...",
        "  1 recomputed (r5): transfer: could not receive metadata from rank 0: gone",
    ]
    assert run_disagg.reason_lines({f"r{i}": "x" for i in range(6)}) == [
        "  6 recomputed (r0, r1, r2, r3, ...): x"
    ]
