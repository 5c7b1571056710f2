"""Multi-head latent attention (DeepSeek V2 / V3): one compressed latent per token.

An MLA layer caches, per token, the normalised KV latent (``kv_lora_rank`` values) and the
shared RoPE key (``qk_rope_head_dim`` values), not per-head K and V.  transformers 5.23 stores
exactly that: ``keys`` ``[batch, 1, seq, kv_lora_rank]`` and ``values``
``[batch, 1, seq, qk_rope_head_dim]``, expanding to per-head K/V only inside attention.

Tensor parallelism: the latent is shared by all heads, so every rank keeps the whole latent
(replicated, never split).  Example: DeepSeek-V3, bf16 -> (512 + 64) * 2 = 1152 bytes per token
per layer on every rank.
"""

from __future__ import annotations

from hybridkv.models.config import Architecture, ConfigView, DeriveContext
from hybridkv.specs import LayerSpec, MLASpec

__all__ = ["ARCHITECTURES", "mla_spec"]


def mla_spec(cfg: ConfigView, ctx: DeriveContext) -> MLASpec:
    """The latent cache of one MLA layer (``kv_lora_rank``, ``qk_rope_head_dim`` required)."""
    if ctx.tp_size > 1:
        ctx.note(f"MLA latent replicated on each of the {ctx.tp_size} ranks (not split by tp)")
    return MLASpec(
        kv_lora_rank=cfg.req_int("kv_lora_rank"),
        qk_rope_head_dim=cfg.req_int("qk_rope_head_dim"),
        dtype=ctx.kv_dtype,
    )


def _derive_deepseek(cfg: ConfigView, ctx: DeriveContext) -> list[LayerSpec]:
    """Every decoder layer is MLA (MTP / next-token-prediction layers are not decoder layers)."""
    spec = mla_spec(cfg, ctx)
    return [
        LayerSpec(index=i, layer_type="full_attention", caches=(spec,))
        for i in range(cfg.num_layers())
    ]


ARCHITECTURES: dict[str, Architecture] = {
    "deepseek_v2": Architecture(
        _derive_deepseek, {"kv_lora_rank": 512, "qk_rope_head_dim": 64}, "mla"
    ),
    "deepseek_v3": Architecture(
        _derive_deepseek, {"kv_lora_rank": 512, "qk_rope_head_dim": 64}, "mla"
    ),
}
