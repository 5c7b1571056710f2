"""The attention math matches transformers' eager attention; the entry point's contract."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from hybridkv.engine.attention import attend, paged_attention_forward
from hybridkv.engine.errors import EngineError, NoActiveStepError


def naive(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scaling: float,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """One query and head at a time, straight from the definition (float64)."""
    heads, length = q.shape[0], q.shape[1]
    rep = heads // k.shape[0]
    out = torch.zeros(length, heads, v.shape[-1], dtype=torch.float64)
    for h in range(heads):
        for t in range(length):
            logits = []
            for s in range(k.shape[1]):
                if not mask[t, s]:
                    continue
                x = float(q[h, t].double() @ k[h // rep, s].double()) * scaling
                if softcap is not None:
                    x = math.tanh(x / softcap) * softcap
                logits.append((x, s))
            extra = [] if sinks is None else [float(sinks[h])]
            top = max([x for x, _ in logits] + extra)
            denom = sum(math.exp(x - top) for x, _ in logits) + sum(
                math.exp(x - top) for x in extra
            )
            for x, s in logits:
                out[t, h] += math.exp(x - top) / denom * v[h // rep, s].double()
    return out


@given(
    kv_heads=st.integers(1, 2),
    rep=st.integers(1, 3),
    length=st.integers(1, 4),
    keys=st.integers(1, 6),
    softcap=st.sampled_from([None, 5.0]),
    with_sinks=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_attend_matches_the_definition(
    kv_heads: int,
    rep: int,
    length: int,
    keys: int,
    softcap: float | None,
    with_sinks: bool,
    seed: int,
) -> None:
    gen = torch.Generator().manual_seed(seed)
    heads = kv_heads * rep
    q = torch.randn(heads, length, 4, generator=gen)
    k = torch.randn(kv_heads, keys, 4, generator=gen)
    v = torch.randn(kv_heads, keys, 3, generator=gen)
    mask = torch.rand(length, keys, generator=gen) < 0.6
    mask[:, 0] = True  # every query sees at least one key
    sinks = torch.randn(heads, generator=gen) if with_sinks else None
    got = attend(q, k, v, mask, scaling=0.5, softcap=softcap, sinks=sinks)
    assert got.shape == (length, heads, 3)
    want = naive(q, k, v, mask, 0.5, softcap, sinks)
    assert torch.allclose(got.double(), want, atol=1e-5)


def _hf_inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 4, 3, 8, generator=gen)
    k = torch.randn(1, 2, 5, 8, generator=gen)
    v = torch.randn(1, 2, 5, 8, generator=gen)
    # 3 new tokens after 2 cached ones, causal
    mask = torch.arange(5)[None, :] <= torch.arange(2, 5)[:, None]
    return q, k, v, mask


def test_attend_matches_gpt_oss_eager_attention_with_sinks() -> None:
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    q, k, v, mask = _hf_inputs(1)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    module = SimpleNamespace(num_key_value_groups=2, sinks=sinks, training=False)
    additive = torch.zeros(1, 1, 3, 5).masked_fill(~mask, float("-inf"))
    want, _ = eager_attention_forward(module, q, k, v, additive, scaling=0.3)
    got = attend(q[0], k[0], v[0], mask, scaling=0.3, sinks=sinks)
    assert torch.allclose(got, want[0], atol=1e-6)


def test_attend_matches_gemma2_eager_attention_with_softcap() -> None:
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    q, k, v, mask = _hf_inputs(2)
    module = SimpleNamespace(num_key_value_groups=2, training=False)
    additive = torch.zeros(1, 1, 3, 5).masked_fill(~mask, float("-inf"))
    want, _ = eager_attention_forward(module, q, k, v, additive, scaling=0.3, softcap=2.0)
    got = attend(q[0], k[0], v[0], mask, scaling=0.3, softcap=2.0)
    assert torch.allclose(got, want[0], atol=1e-6)


def test_paged_attention_needs_an_active_step() -> None:
    q = torch.zeros(1, 2, 1, 4)
    with pytest.raises(NoActiveStepError, match=r"outside ModelRunner\.execute"):
        paged_attention_forward(torch.nn.Module(), q, q, q, None)


def test_paged_attention_refuses_a_prepared_mask() -> None:
    from hybridkv.engine.attention import active_step

    class _Never:
        def attention(self, *args: object, **kwargs: object) -> torch.Tensor:
            raise AssertionError("not reached")

    q = torch.zeros(1, 2, 1, 4)
    with active_step(_Never()), pytest.raises(EngineError, match="attention_mask=None"):
        paged_attention_forward(torch.nn.Module(), q, q, q, torch.zeros(1, 1, 1, 1))
