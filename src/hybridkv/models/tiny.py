"""Built-in tiny models: real transformers architectures shrunk to a few layers.  No torch.

They are configs only (a ``model_type`` plus overrides of :data:`TINY_COMMON`); the engine
(:func:`hybridkv.engine.models.load_model`) builds them with seeded random weights.  Hidden 64,
vocab 256, sliding windows of 8 tokens so short prompts already recycle window blocks.
``initializer_range`` is 0.2: the default 0.02 gives nearly flat logits (top-2 gaps ~1e-4),
too close for a 1e-4 exactness check.  They run in float32 on CPU in milliseconds.

========================  ===================================================================
name                      what it exercises
========================  ===================================================================
``llama``                 full attention, GQA
``gemma2``                sliding / full alternating, attention logit softcap (tanh)
``gemma3_text``           5 sliding : 1 full, per-type RoPE, ``query_pre_attn_scalar``
``gpt_oss``               sliding / full alternating, learned sinks (``s_aux``), MoE
``qwen3_next``            gated DeltaNet (conv + recurrent state) + gated full attention
``granitemoehybrid``      Mamba2 (conv + SSM state) + attention, MoE
``nemotron_h``            Mamba2 + attention + MoE-only layers (no cache)
``deepseek_v3``           MLA (paged latent), MoE
``kimi_linear``           Kimi delta attention (conv + recurrent state) + MLA, dense MLPs
``lfm2``                  short conv (conv state) + attention
``lfm3``                  short conv + sliding + full attention (the default hybrid)
``llama4_text``           chunked local attention (chunk 8) + NoPE full attention, MoE
``falcon_h1``             attention and Mamba2 in every layer (two caches per layer)
``zamba2``                Mamba2 layers, two also running one shared attention module
``gemma4_text``           sliding / full; the last two layers read earlier layers' K/V
``jamba``                 Mamba1 + attention, MoE (prompts computed whole: no prefix hits)
``bamba``, ``qwen3_5_text``, ``olmo_hybrid``   Mamba2 / gated DeltaNet + attention
``mistral``, ``qwen2``, ``cohere2``, ``exaone4``, ``olmo3``   sliding windows
``qwen3``, ``deepseek_v2``   QK-norm attention; MLA
``olmo2``, ``phi3``, ``starcoder2``, ``granite``   no registry entry: derived generically
========================  ===================================================================

The tiny ``qwen3_next`` uses dense MLPs (``mlp_only_layers``): with its MoE, transformers
itself is not batch-invariant enough for a 1e-4 check (a batch of three decoding requests
drifts by up to 2e-4 from the same requests decoded alone after six steps; the paged runner
matches transformers to 1e-6 for each request alone).  MoE is exercised by gpt_oss,
granitemoehybrid, nemotron_h, deepseek_v3 and llama4_text.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["DEFAULT_TINY_MODEL", "TINY_COMMON", "TINY_MODELS", "TinyModel"]

#: Config fields every tiny model shares (before its own overrides).
TINY_COMMON: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "initializer_range": 0.2,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
    "bos_token_id": None,
    "eos_token_id": None,
    "pad_token_id": None,
}


@dataclass(frozen=True, kw_only=True)
class TinyModel:
    """A built-in tiny architecture: transformers ``model_type`` plus config overrides."""

    name: str
    model_type: str
    description: str
    overrides: Mapping[str, Any] = field(default_factory=dict)


def _tiny(name: str, model_type: str, description: str, **overrides: Any) -> TinyModel:
    return TinyModel(name=name, model_type=model_type, description=description, overrides=overrides)


_MOE = {"num_experts_per_tok": 2}
#: 3 sliding (window 8) : 1 full attention layers.
_SWA_3_1 = {
    "num_hidden_layers": 4,
    "sliding_window": 8,
    "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
}
#: 3 gated DeltaNet : 1 full attention layers.
_GDN_3_1 = {
    "num_hidden_layers": 4,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
}
#: Mamba2 mixers of 4 heads of 16 (falcon_h1, bamba name these fields alike).
_MAMBA2_4X16 = {
    "mamba_n_heads": 4,
    "mamba_d_head": 16,
    "mamba_d_state": 16,
    "mamba_n_groups": 1,
    "mamba_chunk_size": 16,
    "mamba_d_conv": 4,
    "mamba_expand": 1,
}
#: Multi-head latent attention (latent 32 + rope 8) with a MoE after the first layer.
_MLA_MOE = {
    "num_hidden_layers": 3,
    "num_key_value_heads": 4,
    "head_dim": 8,
    "kv_lora_rank": 32,
    "q_lora_rank": 48,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "n_routed_experts": 4,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "moe_intermediate_size": 32,
    **_MOE,
}

TINY_MODELS: dict[str, TinyModel] = {
    m.name: m
    for m in (
        _tiny("llama", "llama", "full attention, GQA", num_hidden_layers=3),
        _tiny(
            "gemma2",
            "gemma2",
            "sliding (window 8) / full attention with logit softcapping",
            num_hidden_layers=4,
            sliding_window=8,
            query_pre_attn_scalar=16,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=30.0,
            layer_types=["sliding_attention", "full_attention"] * 2,
        ),
        _tiny(
            "gemma3_text",
            "gemma3_text",
            "5 sliding (window 8) : 1 full attention",
            num_hidden_layers=6,
            sliding_window=8,
            query_pre_attn_scalar=16,
            layer_types=["sliding_attention"] * 5 + ["full_attention"],
        ),
        _tiny(
            "gpt_oss",
            "gpt_oss",
            "sliding (window 8) / full attention with learned sinks, MoE",
            num_hidden_layers=4,
            sliding_window=8,
            num_local_experts=4,
            layer_types=["sliding_attention", "full_attention"] * 2,
            max_position_embeddings=131072,
            **_MOE,
        ),
        _tiny(
            "qwen3_next",
            "qwen3_next",
            "gated DeltaNet + gated full attention (dense MLPs)",
            num_hidden_layers=4,
            layer_types=["linear_attention"] * 3 + ["full_attention"],
            mlp_only_layers=[0, 1, 2, 3],
            linear_conv_kernel_dim=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            num_experts=4,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            **_MOE,
        ),
        _tiny(
            "granitemoehybrid",
            "granitemoehybrid",
            "Mamba2 + attention, MoE",
            num_hidden_layers=4,
            layer_types=["mamba", "attention", "mamba", "attention"],
            mamba_n_heads=4,
            mamba_d_head=32,
            mamba_d_state=16,
            mamba_n_groups=1,
            mamba_chunk_size=16,
            num_local_experts=4,
            shared_intermediate_size=64,
            **_MOE,
        ),
        _tiny(
            "nemotron_h",
            "nemotron_h",
            "Mamba2 + attention + MoE-only layer",
            num_hidden_layers=4,
            layers_block_type=["mamba", "attention", "mamba", "moe"],
            mamba_num_heads=4,
            mamba_head_dim=16,
            ssm_state_size=16,
            n_groups=1,
            chunk_size=16,
            n_routed_experts=4,
            moe_intermediate_size=32,
            moe_shared_expert_intermediate_size=32,
            time_step_limit=(0.0, float("inf")),
            **_MOE,
        ),
        _tiny(
            "falcon_h1",
            "falcon_h1",
            "attention and Mamba2 side by side in every layer (two caches per layer)",
            num_hidden_layers=3,
            mamba_d_ssm=64,
            time_step_limit=(0.0, float("inf")),
            **_MAMBA2_4X16,
        ),
        _tiny(
            "zamba2",
            "zamba2",
            "Mamba2 layers, two of them also running one shared attention block",
            num_hidden_layers=4,
            layers_block_type=["mamba", "hybrid", "mamba", "hybrid"],
            mamba_d_state=16,
            mamba_d_conv=4,
            mamba_expand=2,
            mamba_headdim=16,
            mamba_ngroups=1,
            n_mamba_heads=8,
            chunk_size=16,
            num_mem_blocks=1,
            use_shared_attention_adapter=False,
            attention_head_dim=32,
            time_step_limit=(0.0, float("inf")),
        ),
        _tiny(
            "mistral",
            "mistral",
            "sliding window (8) in every layer",
            num_hidden_layers=3,
            sliding_window=8,
        ),
        _tiny(
            "qwen2",
            "qwen2",
            "full attention below max_window_layers, sliding (window 8) above",
            num_hidden_layers=4,
            use_sliding_window=True,
            sliding_window=8,
            max_window_layers=2,
            layer_types=["full_attention"] * 2 + ["sliding_attention"] * 2,
        ),
        _tiny(
            "cohere2", "cohere2", "3 sliding (window 8) : 1 full attention without RoPE", **_SWA_3_1
        ),
        _tiny(
            "exaone4", "exaone4", "3 sliding (window 8) : 1 full attention, QK norms", **_SWA_3_1
        ),
        _tiny("olmo3", "olmo3", "3 sliding (window 8) : 1 full attention", **_SWA_3_1),
        _tiny("qwen3", "qwen3", "full attention with QK norms", num_hidden_layers=3),
        _tiny("olmo2", "olmo2", "full attention (no registry entry: derived)", num_hidden_layers=3),
        _tiny("phi3", "phi3", "full attention, fused QKV (no registry entry)", num_hidden_layers=3),
        _tiny(
            "starcoder2",
            "starcoder2",
            "sliding window (8), biases (no registry entry: derived)",
            num_hidden_layers=3,
            sliding_window=8,
        ),
        _tiny(
            "granite",
            "granite",
            "full attention, scaled residuals (no registry entry: derived)",
            num_hidden_layers=3,
        ),
        _tiny(
            "gemma4_text",
            "gemma4_text",
            "sliding (window 8) / full; the last two layers read earlier layers' K/V",
            num_hidden_layers=4,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"] * 2,
            num_kv_shared_layers=2,
        ),
        _tiny(
            "bamba",
            "bamba",
            "Mamba2 + attention",
            num_hidden_layers=4,
            attn_layer_indices=[1, 3],
            **_MAMBA2_4X16,
        ),
        _tiny("qwen3_5_text", "qwen3_5_text", "gated DeltaNet + gated full attention", **_GDN_3_1),
        _tiny("olmo_hybrid", "olmo_hybrid", "gated DeltaNet + full attention", **_GDN_3_1),
        _tiny(
            "jamba",
            "jamba",
            "Mamba1 + attention, MoE (prompts computed whole: no prefix hits)",
            num_hidden_layers=4,
            attn_layer_period=2,
            attn_layer_offset=1,
            expert_layer_period=2,
            expert_layer_offset=1,
            num_experts=2,
            num_experts_per_tok=2,
            mamba_d_state=8,
            mamba_d_conv=4,
            mamba_expand=2,
            mamba_dt_rank=8,
        ),
        _tiny(
            "deepseek_v2",
            "deepseek_v2",
            "multi-head latent attention (latent 32 + rope 8), MoE",
            **_MLA_MOE,
        ),
        _tiny(
            "deepseek_v3",
            "deepseek_v3",
            "multi-head latent attention (latent 32 + rope 8), MoE",
            **_MLA_MOE,
        ),
        _tiny(
            "kimi_linear",
            "kimi_linear",
            "Kimi delta attention + MLA (latent 32 + rope 8), dense MLPs",
            num_hidden_layers=4,
            layer_types=["linear_attention", "full_attention"] * 2,
            mlp_layer_types=["dense"] * 4,
            num_key_value_heads=4,
            head_dim=8,
            kv_lora_rank=32,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=16,
            linear_head_dim=16,
            linear_num_heads=4,
            linear_conv_kernel_dim=4,
            num_local_experts=4,
            moe_intermediate_size=32,
            **_MOE,
        ),
        _tiny(
            "lfm2",
            "lfm2",
            "short conv + full attention",
            num_hidden_layers=4,
            layer_types=["conv", "full_attention", "conv", "full_attention"],
            conv_L_cache=3,
            block_auto_adjust_ff_dim=False,
        ),
        _tiny(
            "lfm3",
            "lfm3",
            "short conv + sliding (window 8) + full attention",
            num_hidden_layers=6,
            layer_types=["conv", "sliding_attention", "full_attention"] * 2,
            sliding_window=8,
            block_auto_adjust_ff_dim=False,
        ),
        _tiny(
            "llama4_text",
            "llama4_text",
            "chunked local attention (chunk 8) + NoPE full attention, MoE",
            num_hidden_layers=4,
            attention_chunk_size=8,
            intermediate_size_mlp=128,
            num_local_experts=4,
            num_experts_per_tok=1,
            no_rope_layer_interval=4,
            floor_scale=8,
        ),
    )
}

#: The tiny model ``hybridkv run`` uses by default: full, sliding and state layers in one.
DEFAULT_TINY_MODEL = "lfm3"
