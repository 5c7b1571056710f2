"""Recurrent-state specs (Mamba1/2, gated DeltaNet, KDA, short conv) as transformers keeps them.

Every builder returns a :class:`~hybridkv.specs.StateSpec` whose tensors are the per-request
(batch dimension dropped) tensors Hugging Face transformers 5.23 stores in a
``LinearAttentionLayer``: ``conv`` is ``conv_states[0]`` and ``ssm`` / ``recurrent`` is
``recurrent_states[0]``.  Shapes are per tensor-parallel rank (see :mod:`hybridkv.models.parallel`).

Dtypes
------
* Conv states hold the projected activations, so they are in the model dtype.
* Recurrent states are float32: every transformers 5.23 mixer computes the scan in float32 and
  caches the float32 result (Mamba1/Mamba2 scans upcast, gated DeltaNet runs in float32, KDA
  casts with ``.to(torch.float32)``).  A config flag such as nemotron_h's
  ``mamba_ssm_cache_dtype`` or qwen3_5's ``mamba_ssm_dtype`` (both float32 in published
  checkpoints) or the caller's ``ssm_state_dtype`` (which wins) overrides it.

Conv windows keep the last ``d_conv`` inputs (transformers keeps the full kernel width, not
``d_conv - 1``).
"""

from __future__ import annotations

from hybridkv.models.config import DeriveContext
from hybridkv.models.parallel import split_exact, split_or_replicate
from hybridkv.specs import DType, StateMixer, StateSpec, StateTensor

__all__ = [
    "gated_deltanet_state",
    "kda_state",
    "mamba1_state",
    "mamba2_state",
    "recurrent_dtype",
    "short_conv_state",
]

#: The recurrent-state dtype transformers 5.23 caches for every state mixer.
DEFAULT_RECURRENT_DTYPE = DType.FP32


def recurrent_dtype(ctx: DeriveContext, config_flag: DType | None = None) -> DType:
    """The recurrent-state dtype: the caller's override, else a config flag, else float32."""
    if ctx.ssm_state_dtype is not None:
        return ctx.ssm_state_dtype
    return DEFAULT_RECURRENT_DTYPE if config_flag is None else config_flag


def mamba1_state(
    ctx: DeriveContext, *, model_type: str, intermediate: int, d_conv: int, d_state: int
) -> StateSpec:
    """Mamba1 (jamba): conv ``(intermediate/tp, d_conv)``, ssm ``(intermediate/tp, d_state)``.

    Example: Jamba-v0.1 (hidden 4096, expand 2, d_conv 4, d_state 16), tp=1, bf16 ->
    conv (8192, 4) bf16 = 64 KiB and ssm (8192, 16) fp32 = 512 KiB per request.
    """
    channels = split_exact(
        intermediate, ctx.tp_size, field="mamba intermediate size", model_type=model_type
    )
    return StateSpec(
        mixer=StateMixer.MAMBA1,
        tensors=(
            StateTensor(name="conv", shape=(channels, d_conv), dtype=ctx.dtype),
            StateTensor(name="ssm", shape=(channels, d_state), dtype=recurrent_dtype(ctx)),
        ),
    )


def mamba2_state(
    ctx: DeriveContext,
    *,
    model_type: str,
    n_heads: int,
    head_dim: int,
    n_groups: int,
    d_state: int,
    d_conv: int,
    ssm_dtype_flag: DType | None = None,
) -> StateSpec:
    """Mamba2: conv ``(I/tp + 2*G*d_state, d_conv)``, ssm ``(n_heads/tp, head_dim, d_state)``.

    ``I = n_heads * head_dim`` is the intermediate size and ``G`` the groups per rank
    (:func:`~hybridkv.models.parallel.split_or_replicate`).  Example: Nemotron-H-8B (128 heads
    of 64, 8 groups, d_state 128, d_conv 4), tp=1 -> conv (10240, 4), ssm (128, 64, 128).
    """
    heads = split_exact(n_heads, ctx.tp_size, field="mamba heads", model_type=model_type)
    groups = split_or_replicate(n_groups, ctx.tp_size)
    conv_channels = heads * head_dim + 2 * groups * d_state
    return StateSpec(
        mixer=StateMixer.MAMBA2,
        tensors=(
            StateTensor(name="conv", shape=(conv_channels, d_conv), dtype=ctx.dtype),
            StateTensor(
                name="ssm",
                shape=(heads, head_dim, d_state),
                dtype=recurrent_dtype(ctx, ssm_dtype_flag),
            ),
        ),
    )


def gated_deltanet_state(
    ctx: DeriveContext,
    *,
    model_type: str,
    num_k_heads: int,
    num_v_heads: int,
    head_k_dim: int,
    head_v_dim: int,
    d_conv: int,
    ssm_dtype_flag: DType | None = None,
) -> StateSpec:
    """Gated DeltaNet (qwen3_next): conv over q, k and v, recurrent ``(Hv, dk, dv)``.

    conv ``(2*Hk*dk + Hv*dv, d_conv)`` and recurrent ``(Hv, dk, dv)`` with ``Hk`` and ``Hv``
    divided by tp.  Example: Qwen3-Next-80B-A3B (16 k-heads, 32 v-heads, dims 128, d_conv 4)
    -> conv (8192, 4), recurrent (32, 128, 128) fp32 = 2 MiB.
    """
    k_heads = split_exact(
        num_k_heads, ctx.tp_size, field="linear_num_key_heads", model_type=model_type
    )
    v_heads = split_exact(
        num_v_heads, ctx.tp_size, field="linear_num_value_heads", model_type=model_type
    )
    conv_channels = 2 * k_heads * head_k_dim + v_heads * head_v_dim
    return StateSpec(
        mixer=StateMixer.GATED_DELTANET,
        tensors=(
            StateTensor(name="conv", shape=(conv_channels, d_conv), dtype=ctx.dtype),
            StateTensor(
                name="recurrent",
                shape=(v_heads, head_k_dim, head_v_dim),
                dtype=recurrent_dtype(ctx, ssm_dtype_flag),
            ),
        ),
    )


def kda_state(
    ctx: DeriveContext, *, model_type: str, num_heads: int, head_dim: int, d_conv: int
) -> StateSpec:
    """Kimi delta attention: conv ``(3*H*d, d_conv)`` (q, k, v), recurrent ``(H, d, d)``.

    ``H`` is divided by tp.  Example: Kimi-Linear-48B-A3B (32 heads of 128, d_conv 4) ->
    conv (12288, 4), recurrent (32, 128, 128) fp32.
    """
    heads = split_exact(num_heads, ctx.tp_size, field="linear num_heads", model_type=model_type)
    return StateSpec(
        mixer=StateMixer.KDA,
        tensors=(
            StateTensor(name="conv", shape=(3 * heads * head_dim, d_conv), dtype=ctx.dtype),
            StateTensor(
                name="recurrent", shape=(heads, head_dim, head_dim), dtype=recurrent_dtype(ctx)
            ),
        ),
    )


def short_conv_state(
    ctx: DeriveContext, *, model_type: str, hidden_size: int, l_cache: int
) -> StateSpec:
    """LFM2 short convolution: conv ``(hidden/tp, L_cache)`` in the model dtype, no recurrence."""
    channels = split_exact(hidden_size, ctx.tp_size, field="hidden_size", model_type=model_type)
    return StateSpec(
        mixer=StateMixer.SHORT_CONV,
        tensors=(StateTensor(name="conv", shape=(channels, l_cache), dtype=ctx.dtype),),
    )
