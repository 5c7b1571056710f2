"""Prefill -> decode handover: a request computed by one engine continues on another with a
different layout, tokens identical to transformers; in one process and in two over gloo."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from hybridkv.engine import CacheConfig, LLMEngine, verify_completions
from hybridkv.engine.disaggregate import run_disaggregated
from hybridkv.engine.errors import EngineError
from hybridkv.engine.handover import export_request, import_request, release, shard_handover
from hybridkv.engine.tp_shards import shard_caches
from hybridkv.scheduler import SchedulerConfig
from hybridkv.storage import TransferError
from hybridkv.storage.transfer_plan import TransferPlan
from test_engine_tiers import _reference, conversations

pytestmark = pytest.mark.usefixtures("one_thread")

MODELS = ["llama", "gpt_oss", "qwen3_next", "lfm2", "granitemoehybrid", "deepseek_v3"]
STATE = {"qwen3_next", "lfm2", "granitemoehybrid"}
PROMPTS = conversations(1, n_conv=3, turns=2, first=30, step=9)
# prefill: pools, 4-token blocks; decode: arena, 8-token blocks, published once computed
PREFILL = CacheConfig(
    strategy="pools", block_size=4, state_block_size=8, num_blocks=64, max_model_len=96
)
DECODE = CacheConfig(
    strategy="arena", block_size=8, state_block_size=8, max_model_len=96, publish="computed"
)


def _engines(name: str) -> tuple[LLMEngine, LLMEngine]:
    return LLMEngine(name, cache=PREFILL, keep_logits=True), LLMEngine(
        name, cache=DECODE, keep_logits=True
    )


@pytest.mark.parametrize("name", MODELS)
def test_a_prefilled_request_decodes_exactly_on_another_layout(name: str) -> None:
    pre, dec = _engines(name)
    pulled: list[int] = []

    def pull(plan: TransferPlan, source: int, buffers: Sequence[torch.Tensor]) -> None:
        assert source == 0
        pulled.append(plan.total_bytes)
        plan.copy(pre.storage.buffers, buffers)

    for i, prompt in enumerate(PROMPTS):
        rid = f"r{i}"
        pre.add_request(rid, prompt, max_tokens=1, hold=True)
        pre.run()
        assert import_request(dec, export_request(pre, rid), max_tokens=6, pull=pull)
        release(pre, rid)
        assert pre.manager.has_blocks(rid) is False
        dec.run()
    done = [dec.completions[f"r{i}"] for i in range(len(PROMPTS))]
    result = verify_completions(_reference(name), done)
    assert result.ok, result.mismatches
    assert all(len(c.token_ids) == 6 for c in done)
    # the registration names the buffers a connector would read (seed 004's tensor refs)
    reg = export_request(pre, "r0").registration if "r0" in pre.scheduler.held else None
    assert reg is None  # released
    pre.add_request("x", PROMPTS[0], max_tokens=1, hold=True)
    pre.run()
    refs = export_request(pre, "x").registration.tensors
    assert [(t.address, t.nbytes) for t in refs] == [
        (b.data_ptr(), b.numel()) for b in pre.storage.buffers
    ]
    pre.manager.check_invariants()
    dec.manager.check_invariants()
    hits = [c.num_cached_tokens for c in done]
    if name in STATE:  # no checkpoint at 24 on the decode side: the whole prompt comes over
        assert hits == [0] * 6
        assert pulled[3] > pulled[0]  # 39 tokens and the state vs 30 tokens and the state
    else:  # the second turns hit their first turns' 24 cached tokens: only the rest comes
        assert hits == [0, 0, 0, 24, 24, 24]
        assert pulled[3] < pulled[0]  # 15 tokens vs 30


def test_window_blocks_the_prefill_side_dropped_are_not_needed() -> None:
    """lfm3 (short conv + sliding window 8 + full): the prefill side computes each prompt in
    two chunks (a state checkpoint at the last aligned boundary), and its second chunk
    releases the first chunk's window blocks.  The decode side frees those positions too
    (``KVCacheManager.drop_unread``: no query after the prompt reads them), so every request
    decodes from the transferred data (it used to fail the transfer plan and recompute)."""
    pre, dec = _engines("lfm3")
    dropped = 0

    def pull(plan: TransferPlan, source: int, buffers: Sequence[torch.Tensor]) -> None:
        plan.copy(pre.storage.buffers, buffers)

    for i, prompt in enumerate(PROMPTS):
        rid = f"r{i}"
        pre.add_request(rid, prompt, max_tokens=1, hold=True)
        pre.run()
        handover = export_request(pre, rid)
        dropped += sum(table.count(0) for table in handover.sources[0][1].values())
        reasons: dict[str, str] = {}
        assert import_request(dec, handover, max_tokens=6, pull=pull, reasons=reasons), reasons
        release(pre, rid)
        dec.manager.check_invariants()
        dec.run()
    assert dropped >= len(PROMPTS)  # every prompt had window blocks dropped at the source
    done = [dec.completions[f"r{i}"] for i in range(len(PROMPTS))]
    assert verify_completions(_reference("lfm3"), done).ok
    dec.check_invariants()


def test_a_failed_pull_is_recomputed_never_read() -> None:
    pre, dec = _engines("llama")
    pre.add_request("r0", PROMPTS[0], max_tokens=1, hold=True)
    pre.run()

    def broken(plan: TransferPlan, source: int, buffers: Sequence[torch.Tensor]) -> None:
        half = TransferPlan(
            plan.src_buffer[:1],
            plan.src_offset[:1],
            plan.dst_buffer[:1],
            plan.dst_offset[:1],
            plan.length[:1],
        )
        half.copy(pre.storage.buffers, buffers)  # part of it arrived
        raise TransferError("transfer: the peer went away")

    reasons: dict[str, str] = {}
    handover = export_request(pre, "r0")
    assert not import_request(dec, handover, max_tokens=6, pull=broken, reasons=reasons)
    assert reasons == {"r0": "transfer: the peer went away"}  # why it is recomputed
    release(pre, "r0")
    dec.manager.check_invariants()
    # nothing of the failed import is a prefix hit: the request is recomputed from scratch
    dec.run()
    done = dec.completions["r0"]
    assert done.num_cached_tokens == 0
    assert verify_completions(_reference("llama"), [done]).ok
    handover = _handover(dec)
    with pytest.raises(EngineError, match="publish blocks once computed"):
        import_request(pre, handover, max_tokens=2, pull=lambda plan, source, buffers: None)


def test_a_handover_its_first_token_ends_completes_without_a_pull() -> None:
    """An EOS as the prefill side's token, or ``max_tokens=1``, finishes the request on the
    decode side with nothing pulled or decoded (found by review: the decode side ignored
    EOS and kept generating)."""
    first = LLMEngine("llama").generate([PROMPTS[0]], max_tokens=2)[0].token_ids
    pre, dec = _engines("llama")

    def pull(plan: TransferPlan, source: int, buffers: Sequence[torch.Tensor]) -> None:
        raise AssertionError("a finished request pulls nothing")

    for rid, kw in (("eos", {"max_tokens": 6, "eos_token_ids": [first[0]]}), ("one", {})):
        pre.add_request(rid, PROMPTS[0], max_tokens=1, hold=True)
        pre.run()
        assert import_request(dec, export_request(pre, rid), pull=pull, **{"max_tokens": 1, **kw})
        release(pre, rid)
    assert not dec.has_unfinished() and not dec.manager.has_blocks("eos")
    eos, one = dec.completions["eos"], dec.completions["one"]
    assert (eos.token_ids, eos.finish_reason.value) == (first[:1], "stop")
    assert (one.token_ids, one.finish_reason.value) == (first[:1], "length")
    assert len(eos.logits) == 1 and dec.stats().generated_tokens == 2
    assert verify_completions(_reference("llama"), [eos], [first[0]]).ok


def test_larger_decode_window_blocks_import_and_never_serve_the_tokens_they_lack() -> None:
    """Found by review (D3): the decode side's first kept window block (tokens 16-31 of 16-token
    blocks) starts before the first token the prefill side still holds (26: 2-token blocks,
    released up to its last chunk's window).  The import writes tokens 26-36 and withholds
    that block from the prefix cache (it used to refuse the plan and recompute).  Without
    the withholding a later hit at 32 reads token 25, which was never written: the decode
    buffers are filled with junk first, so that would be a wrong token."""
    pre = LLMEngine(
        "mistral",  # sliding window 8 everywhere
        cache=CacheConfig(strategy="pools", block_size=2, num_blocks=256, max_model_len=128),
        scheduler=SchedulerConfig(max_prefill_chunk=33),
        keep_logits=True,
    )
    dec = LLMEngine(
        "mistral",
        cache=CacheConfig(strategy="arena", block_size=16, max_model_len=128, publish="computed"),
        keep_logits=True,
    )
    for buffer in dec.storage.buffers:
        buffer.fill_(7)
    prompt = PROMPTS[3][:37]
    assert len(prompt) == 37
    pre.add_request("r0", prompt, max_tokens=1, hold=True)
    pre.run()
    handover = export_request(pre, "r0")
    assert handover.tables[0][:13] == [0] * 13  # tokens 0-25 released on the prefill side
    reasons: dict[str, str] = {}
    pull = lambda plan, source, bufs: plan.copy(pre.storage.buffers, bufs)  # noqa: E731
    assert import_request(dec, handover, max_tokens=4, pull=pull, reasons=reasons), reasons
    assert dec.manager.get_block_ids("r0")[0][:2] == [0, dec.manager.get_block_ids("r0")[0][1]]
    release(pre, "r0")
    dec.run()
    hits = []
    for i, cut in enumerate((32, 32)):  # the first recomputes 16-31 and publishes them
        dec.add_request(f"x{i}", [*prompt[:cut], 5, 6, 7], max_tokens=4)
        dec.run()
        hits.append(dec.completions[f"x{i}"].num_cached_tokens)
    assert hits == [0, 32]
    done = [dec.completions[r] for r in ("r0", "x0", "x1")]
    assert verify_completions(_reference("mistral"), done).ok
    dec.check_invariants()


def test_processes_stop_at_eos() -> None:
    """``eos_token_ids`` reach the decode process: requests stop where transformers does."""
    eos = [LLMEngine("llama").generate([PROMPTS[1]], max_tokens=4)[0].token_ids[2]]
    res = run_disaggregated(
        ["llama"],
        PROMPTS,
        max_tokens=6,
        eos_token_ids=eos,
        prefill_cache=PREFILL,
        decode_cache=DECODE,
    )["llama"]
    done = [res.completions[f"r{i}"] for i in range(len(PROMPTS))]
    assert done[1].token_ids[-1] == eos[0] and len(done[1].token_ids) == 3
    assert done[1].finish_reason.value == "stop"
    assert verify_completions(_reference("llama"), done, eos).ok


def _handover(engine: LLMEngine) -> Any:
    engine.add_request("h", PROMPTS[0], max_tokens=1, hold=True)
    engine.run()
    return export_request(engine, "h")


def test_prefill_and_decode_processes_over_gloo() -> None:
    results = run_disaggregated(
        MODELS, PROMPTS, max_tokens=6, prefill_cache=PREFILL, decode_cache=DECODE
    )
    for name in MODELS:
        res = results[name]
        assert (res.imported, res.recomputed, res.errors) == (len(PROMPTS), 0, [])
        done = [res.completions[f"r{i}"] for i in range(len(PROMPTS))]
        assert verify_completions(_reference(name), done).ok, name
        assert res.hit_tokens == (0 if name in STATE else 72)


def test_a_lost_prefill_process_leaves_requests_recomputed() -> None:
    results = run_disaggregated(
        ["llama"],
        PROMPTS,
        max_tokens=6,
        prefill_cache=PREFILL,
        decode_cache=DECODE,
        timeout=5.0,
        die_after=2,
    )
    res = results["llama"]
    assert (res.imported, res.recomputed) == (2, 4)
    assert res.errors == ["request r2: transfer failed, recomputed"]
    # every recomputed request says why: r2's pull failed, the later ones never came over
    assert sorted(res.reasons) == ["r2", "r3", "r4", "r5"]
    assert res.reasons["r2"].startswith("transfer: ")
    assert {res.reasons[r] for r in ("r3", "r4", "r5")} == {
        "not handed over: the transfer of request r2 failed"
    }
    done = [res.completions[f"r{i}"] for i in range(len(PROMPTS))]
    assert verify_completions(_reference("llama"), done).ok


def test_run_disaggregate(capsys: pytest.CaptureFixture[str]) -> None:
    from hybridkv.cli.main import main

    assert main(["run", "--model", "llama", "--disaggregate", "--verify", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "disaggregated: 8 of 8 requests decoded from the prefill process's KV and state" in out
    assert "224 prompt tokens hit the decode side's own prefix cache" in out
    assert re.search(r"were not pulled; 128 tokens generated in \d+\.\d s \(both processes", out)
    assert "verify: all 8 requests (128 tokens) identical" in out
    assert main(["run", "--model", "llama", "--disaggregate", "--speculate", "2"]) == 2
    assert "--disaggregate: not with --speculate" in capsys.readouterr().err


def test_quiet_silences_the_processes_of_a_disaggregated_run(
    capfd: pytest.CaptureFixture[str],
) -> None:
    """--quiet: nothing on stderr, the prefill and decode processes included (their
    transformers used to note its fused-kernel fallback for qwen3_next; found by review)."""
    from hybridkv.cli.main import main

    argv = ["run", "--model", "qwen3_next", "--disaggregate", "--num-requests", "2"]
    assert main([*argv, "--max-tokens", "2", "--quiet"]) == 0
    out, err = capfd.readouterr()
    assert "disaggregated: 2 of 2 requests decoded" in out and err == ""


@pytest.mark.parametrize("name", ["llama", "qwen3_next", "deepseek_v3", "lfm2", "gpt_oss"])
@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (1, 2), (2, 2)])
def test_handover_between_tensor_parallel_sizes(name: str, prefill_tp: int, decode_tp: int) -> None:
    """Sharded-cache emulation: the bytes leave per-rank caches of the prefill instance and
    land in per-rank caches of the decode instance; the tokens stay exact.  gpt_oss: the
    prefill side has dropped the sliding-window blocks of r3's first 16 tokens; no rank holds
    them either (they were copied from a null block before)."""
    pre, dec = _engines(name)
    shards = shard_caches(pre.layout, prefill_tp, 96) if prefill_tp > 1 else []
    sources = [s.storage.buffers for s in shards] or [pre.storage.buffers]
    pulls: list[tuple[int, int]] = []

    def pull(plan: TransferPlan, source: int, buffers: Sequence[torch.Tensor]) -> None:
        pulls.append((source, plan.total_bytes))
        plan.copy(sources[source], buffers)

    for i, prompt in enumerate(PROMPTS[:4]):
        rid = f"r{i}"
        pre.add_request(rid, prompt, max_tokens=1, hold=True)
        pre.run()
        handover = export_request(pre, rid)
        if shards:
            handover = shard_handover(pre, handover, shards)
            for _, rank_tables in handover.shards:  # null where the engine's table is
                for gid, table in handover.tables.items():
                    assert [b == 0 for b in rank_tables[gid][: len(table)]] == [
                        b == 0 for b in table
                    ]
        reasons: dict[str, str] = {}
        assert import_request(
            dec, handover, max_tokens=5, pull=pull, decode_tp=decode_tp, reasons=reasons
        ), reasons
        assert reasons == {}
        release(pre, rid)
        dec.run()
    done = [dec.completions[f"r{i}"] for i in range(4)]
    assert verify_completions(_reference(name), done).ok
    # every source rank sends its slice; deepseek_v3's MLA latents are whole on each: rank 0
    assert {s for s, _ in pulls} == ({0} if name == "deepseek_v3" else set(range(prefill_tp)))
    if prefill_tp == decode_tp == 2:
        # rank r pulls only from rank r (MLA latents, whole on every rank, from rank 0 only)
        assert len(pulls) == 2 * 4


def test_processes_of_other_tensor_parallel_sizes_over_gloo() -> None:
    """tp 2 prefill -> tp 1 decode and back, emulated caches, bytes over gloo: exact."""
    for prefill_tp, decode_tp in ((2, 1), (1, 2)):
        results = run_disaggregated(
            ["llama", "qwen3_next", "deepseek_v3"],
            PROMPTS[:3],
            max_tokens=5,
            prefill_cache=PREFILL,
            decode_cache=DECODE,
            prefill_tp=prefill_tp,
            decode_tp=decode_tp,
        )
        for name, res in results.items():
            assert (res.imported, res.recomputed, res.errors) == (3, 0, [])
            done = [res.completions[f"r{i}"] for i in range(3)]
            assert verify_completions(_reference(name), done).ok, (name, prefill_tp, decode_tp)


def test_a_tp_size_the_workers_cannot_split_is_recomputed_with_its_reason(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """Where the up-front check cannot tell (a config it cannot derive), the prefill process
    announces each request it cannot hand over and the decode process records why: no
    traceback, no lost connection, every request recomputed exactly."""
    import hybridkv.engine.disaggregate as disagg

    monkeypatch.setattr(disagg, "check_tp_sizes", lambda *args, **kwargs: None)
    results = run_disaggregated(
        ["llama"],
        PROMPTS[:3],
        max_tokens=4,
        prefill_cache=PREFILL,
        decode_cache=DECODE,
        prefill_tp=4,
    )
    res = results["llama"]
    assert (res.imported, res.recomputed, res.errors) == (0, 3, [])
    assert set(res.reasons.values()) == {
        "the prefill instance cannot hold it at tp 4: group 0: 2 KV heads do not split over "
        "tp 4 (the emulation needs a multiple; replicated heads are planned, not emulated)"
    }
    assert sorted(res.reasons) == ["r0", "r1", "r2"]
    done = [res.completions[f"r{i}"] for i in range(3)]
    assert verify_completions(_reference("llama"), done).ok
    assert "Traceback" not in capfd.readouterr().err


def test_compaction_leaves_a_held_requests_exported_tables_alone() -> None:
    # The prefill engine keeps serving after exporting a held request; its compaction must
    # not move the held request's blocks, whose old ids the decode side pulls from (found by
    # review: a window block moved and the decode side read another request's data).
    from test_engine_scheduler import check, engine, prompt

    small = CacheConfig(block_size=4, state_block_size=8, memory_bytes=104 << 10, max_model_len=64)
    pre = engine("gemma3_text", small, token_budget=64)
    pre.add_request("h", prompt(333, 24), max_tokens=1, hold=True)
    pre.run()
    handover = export_request(pre, "h")
    others = pre.generate([prompt(334 + i, n) for i, n in enumerate([28, 41, 55, 41])], 4)
    check("gemma3_text", others)
    assert pre.stats().moved_blocks > 0  # compaction ran around the held request
    assert {g: list(t) for g, t in enumerate(pre.manager.get_block_ids("h"))} == handover.tables
    dec = engine(
        "gemma3_text",
        CacheConfig(block_size=4, state_block_size=8, max_model_len=64, publish="computed"),
    )

    def pull(plan: TransferPlan, source: int, buffers: Sequence[torch.Tensor]) -> None:
        plan.copy(pre.storage.buffers, buffers)

    assert import_request(dec, handover, max_tokens=6, pull=pull)
    release(pre, "h")
    dec.run()
    check("gemma3_text", [dec.completions["h"]])


def test_a_handover_of_two_sampled_tokens_hits_no_further_than_the_prompt() -> None:
    # Found by review: the decode side's hit was looked up over prompt + sampled tokens, so
    # with two tokens on a prompt the decode side had cached past its end it ran beyond the
    # prompt; the allocation refused it and left the id in the scheduler, so the recompute
    # fallback failed too ("already queued").
    prompt = PROMPTS[3][:31]  # 31 tokens + 1 sampled: an aligned 32 on 8-token blocks
    pre, dec = _engines("llama")
    dec.add_request("warm", prompt, max_tokens=4)  # caches the prompt and tokens past it
    dec.run()
    pre.add_request("x", prompt, max_tokens=2, hold=True)
    pre.run()
    handover = export_request(pre, "x")
    assert len(handover.token_ids) == 2
    reasons: dict[str, str] = {}
    assert import_request(
        dec,
        handover,
        max_tokens=5,
        pull=lambda plan, source, bufs: plan.copy(pre.storage.buffers, bufs),
        reasons=reasons,
    )
    assert reasons == {} and dec._live["x"].seq.num_cached_tokens == 24  # below 31
    release(pre, "x")
    dec.run()
    assert verify_completions(_reference("llama"), [dec.completions["x"]]).ok
    dec.check_invariants()
    assert not dec.manager._coord.requests and not dec.scheduler.seqs
    stats = dec.stats()  # the import counts as an admission with its hit (review: it did not)
    assert (stats.admitted_tokens, stats.prefix_hit_tokens) == (62, 24)


def test_an_import_that_raises_leaves_no_trace_in_the_scheduler() -> None:
    pre, dec = _engines("llama")
    pre.add_request("x", PROMPTS[0], max_tokens=1, hold=True)
    pre.run()
    handover = export_request(pre, "x")

    def broken(*_: Any) -> None:
        raise RuntimeError("not a HybridKVError: propagates")

    with pytest.raises(RuntimeError, match="propagates"):
        dec.scheduler.import_computed(
            "x", handover.prompt, handover.token_ids, max_tokens=4, fill=broken
        )
    assert not dec.scheduler.seqs and not dec.manager._coord.requests
    dec.check_invariants()
    assert dec.scheduler.import_computed(  # the id is free again
        "x",
        handover.prompt,
        handover.token_ids,
        max_tokens=4,
        fill=lambda tables, hit, res: None,
    )


def test_a_prompt_the_decode_process_cannot_serve_is_refused_and_the_rest_go_on() -> None:
    # Found by review: a decode max_model_len below a prompt the prefill side took ended the
    # decode process, and the caller waited out the timeout for a result, then lost them all.
    decode = CacheConfig(strategy="arena", block_size=8, max_model_len=32, publish="computed")
    prompts = [PROMPTS[0][:20], PROMPTS[3], PROMPTS[1][:24]]  # 20, 39 and 24 tokens
    res = run_disaggregated(
        ["llama"], prompts, max_tokens=3, prefill_cache=PREFILL, decode_cache=decode, timeout=20
    )["llama"]
    assert (res.imported, res.recomputed, res.refused, res.errors) == (2, 0, 1, [])
    assert list(res.reasons) == ["r1"]
    assert res.reasons["r1"].startswith("the decode instance cannot serve it: request 'r1'")
    assert res.reasons["r1"].endswith(
        "the prompt has 39 tokens; prompts must be shorter than max_model_len 32"
    )
    assert sorted(res.completions) == ["r0", "r2"]
    done = [res.completions["r0"], res.completions["r2"]]
    assert verify_completions(_reference("llama"), done).ok


def test_a_decode_process_that_ends_without_a_result_is_reported_at_once() -> None:
    import queue as queue_mod
    import time

    from hybridkv.engine.disaggregate import _result

    class Ended:
        exitcode = 1

    start = time.monotonic()
    with pytest.raises(EngineError, match=r"decode process ended \(exit code 1\) without"):
        _result(queue_mod.Queue(), Ended(), 600.0)
    assert time.monotonic() - start < 10
    box: queue_mod.Queue[bytes] = queue_mod.Queue()
    box.put(b"late")  # a result put just before it ended still counts
    assert _result(box, Ended(), 600.0) == b"late"


def test_a_prompt_the_prefill_process_cannot_serve_is_recomputed_on_the_decode_side() -> None:
    # Found by review: the prefill process ended with a traceback, and the decode process
    # waited out its timeout, then recomputed every request left.
    prefill = CacheConfig(strategy="pools", block_size=4, num_blocks=64, max_model_len=32)
    prompts = [PROMPTS[0], PROMPTS[3], PROMPTS[1]]  # 30, 39 and 30 tokens
    res = run_disaggregated(
        ["llama"], prompts, max_tokens=3, prefill_cache=prefill, decode_cache=DECODE, timeout=20
    )["llama"]
    assert (res.imported, res.recomputed, res.refused, res.errors) == (2, 1, 0, [])
    assert res.reasons["r1"].startswith("the prefill instance cannot serve it: request 'r1'")
    done = [res.completions[f"r{i}"] for i in range(3)]
    assert verify_completions(_reference("llama"), done).ok


def test_the_prefill_process_says_in_one_line_why_it_stopped(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from hybridkv.engine import disaggregate

    def lost(*_: Any) -> None:
        raise TransferError("transport: no message from rank 1 within 5 s")

    monkeypatch.setattr(disaggregate, "_prefill", lost)
    assert not disaggregate._prefill_or_say(None, [], None, 1)  # type: ignore[arg-type]
    assert capsys.readouterr().err == (
        "hybridkv: prefill process stopped: transport: no message from rank 1 within 5 s\n"
    )
