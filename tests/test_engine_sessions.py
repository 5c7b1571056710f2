"""Protected sessions through the engine: a conversation its client protects outlasts
one-off requests in a host tier that holds little more than it, comes back from host memory,
and the tokens equal transformers' own."""

from __future__ import annotations

import pytest
import torch

from hybridkv.engine import CacheConfig, Completion, LLMEngine, verify_completions
from hybridkv.engine.errors import EngineError, PromptError
from hybridkv.errors import PlanError
from test_engine_tiers import _engine, _reference  # one request at a time on the device

pytestmark = pytest.mark.usefixtures("one_thread")


def _draw(seed: int, n: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return [int(t) for t in torch.randint(0, 200, (n,), generator=gen)]


def _serve(
    engine: LLMEngine, rid: str, prompt: list[int], protect_as: str | None = None
) -> Completion:
    engine.add_request(rid, prompt, max_tokens=4, protect_as=protect_as)
    engine.run()
    return engine.completions[rid]


@pytest.mark.parametrize("name", ["llama", "qwen3_next"])
def test_a_protected_conversation_outlasts_one_off_requests_in_the_host_tier(name: str) -> None:
    first = _draw(1, 40)
    others = [_draw(10 + i, 40) for i in range(8)]
    # the bytes of everything the first turn caches, once in the host tier
    probe = _engine(name, 64 << 20)
    _serve(probe, "a1", first)
    probe.manager.persist_to_tier("host")
    held = probe.manager.tier_stats()["host"]["used_bytes"]
    spare = min(g.block_bytes for g in probe.layout.groups)
    hits = {}
    for protect in (False, True):
        engine = _engine(name, held + spare)  # the first turn and one more (small) block
        done = [_serve(engine, "a1", first, "chat" if protect else None)]
        done += [_serve(engine, f"x{i}", p) for i, p in enumerate(others)]  # one-off requests
        a1 = done[0]
        second = [*first, *a1.token_ids, *_draw(2, 8)]
        before = engine.stats().host_hit_tokens
        done.append(_serve(engine, "a2", second))
        hits[protect] = engine.stats().host_hit_tokens - before
        result = verify_completions(_reference(name), done)
        assert result.ok, result.mismatches
        if protect:
            assert engine.manager.tier_stats()["host"]["protected_blocks"] > 0
            assert engine.unprotect("chat") and not engine.unprotect("chat")
            assert engine.manager.tier_stats()["host"]["protected_blocks"] == 0
        engine.check_invariants()
    # state models hit at their checkpoints (multiples of 8): the first turn's 40 tokens
    assert hits == {False: 0, True: 40}


def test_a_session_over_the_protect_share_ends_and_its_turn_is_recomputed() -> None:
    # the same conversation with protected entries allowed half the host tier only: the
    # first turn fills more, so its session ends as the device evicts it, and the one-off
    # requests push it out; the tokens stay exact
    first = _draw(1, 40)
    probe = _engine("llama", 64 << 20)
    _serve(probe, "a1", first)
    probe.manager.persist_to_tier("host")
    held = probe.manager.tier_stats()["host"]["used_bytes"]
    spare = min(g.block_bytes for g in probe.layout.groups)
    engine = _engine("llama", held + spare, protect_share=0.5)
    done = [_serve(engine, "a1", first, "chat")]
    done += [_serve(engine, f"x{i}", _draw(10 + i, 40)) for i in range(8)]
    assert engine.manager.session_stats() == {"sessions": 0, "protected_hashes": 0, "expired": 1}
    assert not engine.unprotect("chat")
    second = [*first, *done[0].token_ids, *_draw(2, 8)]
    before = engine.stats().host_hit_tokens
    done.append(_serve(engine, "a2", second))
    assert engine.stats().host_hit_tokens == before  # nothing of the first turn is left
    result = verify_completions(_reference("llama"), done)
    assert result.ok, result.mismatches
    engine.check_invariants()


@pytest.mark.parametrize("bad", [0, 1.5, True])
def test_a_bad_protect_share_is_a_cache_config_error(bad: object) -> None:
    with pytest.raises(PlanError, match=r"CacheConfig\.protect_share: .* in \(0, 1\], got"):
        CacheConfig(protect_share=bad)  # type: ignore[arg-type]


def test_protect_as_needs_a_lower_tier_and_a_closed_engine_does_not_step() -> None:
    """Found by review: ``protect_as`` on an engine without tiers did nothing, and an engine
    stepped on after ``close()`` ran without its tiers."""
    plain = LLMEngine("llama")
    with pytest.raises(PromptError, match="protect_as='chat' keeps a prefix in the host"):
        plain.add_request("a", [1, 2, 3], max_tokens=1, protect_as="chat")
    assert not plain.has_unfinished()
    plain.close()  # no tiers: a no-op, and the engine goes on
    assert plain.generate([[1, 2, 3]], max_tokens=1)[0].token_ids
    tiered = _engine("llama", 64 << 20)
    _serve(tiered, "t", _draw(3, 20), protect_as="chat")
    tiered.close()
    tiered.add_request("u", [1, 2, 3], max_tokens=1)
    with pytest.raises(EngineError, match="the engine is closed"):
        tiered.step()
