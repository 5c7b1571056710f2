"""What transformers' own config classes do for the model types the generic path derives.

Many transformers config classes build ``layer_types`` in ``__post_init__`` when a checkpoint
has none, by a rule of their own (exaone4: every 4th layer full; dots1: layers from
``max_window_layers`` on slide; mellum: every layer full despite a default window), and fill
absent fields from class defaults that differ from the shared rule (ministral3's ``head_dim``
is 128, not ``hidden_size // num_attention_heads``; qwen3_moe's ``num_key_value_heads`` is 4,
not ``num_attention_heads``).  A checkpoint saved by an older transformers, or written by hand,
often lacks those fields, so the generic path must apply the same rules.

:data:`GENERIC_TYPES` holds, per model type, the class defaults the generic path relies on and
the class's ``layer_types`` rule, each read from ``transformers/models/<type>/
configuration_<type>.py`` (transformers 5.24) and checked against the installed config classes
by ``tests/test_models_review_layer_rules.py``.  A model type not listed here whose config has
no ``layer_types`` but a window, a chunk size or a layer-pattern field is refused by
:func:`unknown_pattern_refusal`: which of its layers slide is its config class's business, and
guessing "all of them" planned exaone4 at a quarter of its full-attention bytes.  No torch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from hybridkv.errors import ConfigError
from hybridkv.models.config import ConfigView

__all__ = [
    "GENERIC_TYPES",
    "PATTERN_FIELDS",
    "REFUSED_TYPES",
    "GenericType",
    "unknown_pattern_refusal",
]

FULL = "full_attention"
SLIDING = "sliding_attention"

#: ``(config, num_layers, window or None) -> layer types``: a config class's ``__post_init__``.
LayerRule = Callable[[ConfigView, int, int | None], list[str]]


class GenericType(NamedTuple):
    """One model type the generic path knows: its class defaults and its layer-type rule.

    ``rule`` describes ``layer_rule`` for the spec's notes (empty for transformers' shared
    cache rule, which needs no note).
    """

    defaults: Mapping[str, Any]
    layer_rule: LayerRule
    rule: str


def _uniform(cfg: ConfigView, n: int, window: int | None) -> list[str]:
    # transformers' cache rule for a class without layer_types (mistral-like attention that
    # passes config.sliding_window to every layer), and MinistralConfig's own rule
    return [SLIDING if window is not None else FULL] * n


def _all_full(cfg: ConfigView, n: int, window: int | None) -> list[str]:
    return [FULL] * n


def _pattern(cfg: ConfigView, key: str) -> int:
    """An integer layer-pattern field; a string ("LLLG") or 0 is refused, naming the fix."""
    value = cfg.raw(key)
    if isinstance(value, str):
        raise ConfigError(
            f"{cfg.model_type} config: field {key!r} is {value!r}, a string pattern that "
            f"transformers' {cfg.model_type} config class cannot expand into layer kinds; add "
            "'layer_types' to config.json (one of full_attention, sliding_attention per layer) "
            f"or make {key!r} an integer n (every n-th layer full)"
        )
    return cfg.req_int(key, why="the layer pattern when the config has no 'layer_types'")


def _exaone(cfg: ConfigView, n: int, window: int | None) -> list[str]:
    # Exaone4Config / ExaoneMoeConfig: sliding_window null sets the pattern to 0 (no sliding
    # layer); else every sliding_window_pattern-th layer is full
    if window is None:
        return [FULL] * n
    every = _pattern(cfg, "sliding_window_pattern")
    return [SLIDING if (i + 1) % every else FULL for i in range(n)]


def _qwen2_moe(cfg: ConfigView, n: int, window: int | None) -> list[str]:
    # Qwen2MoeConfig: odd-numbered layers below max_window_layers slide (use_sliding_window)
    if window is None:
        return [FULL] * n
    below = cfg.req_int("max_window_layers", minimum=0)
    return [SLIDING if (i + 1) % 2 and i < below else FULL for i in range(n)]


def _dots1(cfg: ConfigView, n: int, window: int | None) -> list[str]:
    # Dots1Config: layers from max_window_layers on slide when a window is set
    if window is None:
        return [FULL] * n
    start = cfg.req_int("max_window_layers", minimum=0)
    return [SLIDING if i >= start else FULL for i in range(n)]


def _afmoe(cfg: ConfigView, n: int, window: int | None) -> list[str]:
    # AfmoeConfig: every global_attn_every_n_layers-th layer full, the rest slide
    every = _pattern(cfg, "global_attn_every_n_layers")
    return [SLIDING if (i + 1) % every else FULL for i in range(n)]


def _every_other(cfg: ConfigView, n: int, window: int | None) -> list[str]:
    # VaultGemmaConfig: sliding and full layers alternate, starting with sliding
    return [SLIDING if (i + 1) % 2 else FULL for i in range(n)]


def _first_of_four_full(cfg: ConfigView, n: int, window: int | None) -> list[str]:
    # CwmConfig, GraniteSwaConfig, GraniteMoeSwaConfig: layers 0, 4, 8, ... full
    return [FULL if i % 4 == 0 else SLIDING for i in range(n)]


def _cohere2_moe(cfg: ConfigView, n: int, window: int | None) -> list[str]:
    # Cohere2MoeConfig: the first_k_dense_replace dense layers follow
    # prefix_dense_sliding_window_pattern, the rest sliding_window_pattern (counted afresh)
    dense = cfg.req_int("first_k_dense_replace", minimum=0)
    prefix = _pattern(cfg, "prefix_dense_sliding_window_pattern")
    every = _pattern(cfg, "sliding_window_pattern")
    return [SLIDING if (i + 1) % prefix else FULL for i in range(min(dense, n))] + [
        SLIDING if (i + 1) % every else FULL for i in range(n - min(dense, n))
    ]


def _smollm3(cfg: ConfigView, n: int, window: int | None) -> list[str]:
    # SmolLM3Config: with use_sliding_window and a window, the NoPE layers (no_rope_layers[i]
    # == 0; default every no_rope_layer_interval-th layer) slide, the RoPE layers are full
    if window is None:
        return [FULL] * n
    rope = cfg.opt_int_list("no_rope_layers")
    if rope is None:
        interval = _pattern(cfg, "no_rope_layer_interval")
        rope = [int((i + 1) % interval != 0) for i in range(n)]
    cfg.check_length("no_rope_layers", rope, n)
    return [FULL if rope[i] else SLIDING for i in range(n)]


def _beam(cfg: ConfigView, n: int, window: int | None) -> list[str]:
    # BeamConfig: every sixth layer full, and the last one
    types = [SLIDING if (i + 1) % 6 else FULL for i in range(n)]
    types[-1] = FULL
    return types


def _flint(cfg: ConfigView, n: int, window: int | None) -> list[str]:
    # FlintConfig: layers 0, 1, the last and those with i % 4 == 1 full
    return [FULL if i < 2 or i % 4 == 1 or i == n - 1 else SLIDING for i in range(n)]


def _kolibri1(cfg: ConfigView, n: int, window: int | None) -> list[str]:
    # Kolibri1Config: every fifth layer full
    return [FULL if (i + 1) % 5 == 0 else SLIDING for i in range(n)]


def _hrm_text(cfg: ConfigView, n: int, window: int | None) -> list[str]:
    # HrmTextConfig: without num_layers_per_stack, num_hidden_layers is the per-stack count and
    # is rewritten to count * H_cycles * (L_cycles + 1), one cache slot per attention call
    if cfg.raw("num_layers_per_stack") is None:
        raise ConfigError(
            f"hrm_text config: field 'num_layers_per_stack' is missing, so transformers' "
            f"HrmTextConfig reads num_hidden_layers={n} as the per-stack count and caches "
            f"{n} * H_cycles * (L_cycles + 1) attention calls; add 'num_layers_per_stack' (the "
            "per-stack count) to config.json, with num_hidden_layers the total, as "
            "transformers saves it"
        )
    return _uniform(cfg, n, window)


def _type(defaults: Mapping[str, Any], rule: LayerRule, text: str) -> GenericType:
    return GenericType(defaults=defaults, layer_rule=rule, rule=text)


_UNIFORM = ""  # the shared cache rule: every layer slides when a window is set
_EXAONE = {"num_key_value_heads": 32, "sliding_window": 4096, "sliding_window_pattern": 4}
_FIRST_OF_FOUR = "layers 0, 4, 8, ... full, the rest slide"

#: model_type -> the transformers 5.24 config class's defaults and ``layer_types`` rule.
#: ``num_key_value_heads`` / ``head_dim`` are listed where the class default is not the shared
#: rule's (``num_attention_heads`` / ``hidden_size // num_attention_heads``).
GENERIC_TYPES: dict[str, GenericType] = {
    # classes that build layer_types in __post_init__
    "exaone4": _type(_EXAONE, _exaone, "every sliding_window_pattern-th layer full"),
    "exaone_moe": _type(_EXAONE, _exaone, "every sliding_window_pattern-th layer full"),
    "qwen2_moe": _type(
        {
            "num_key_value_heads": 16,
            "use_sliding_window": False,
            "sliding_window": 4096,
            "max_window_layers": 28,
        },
        _qwen2_moe,
        "odd-numbered layers below max_window_layers slide when use_sliding_window",
    ),
    "dots1": _type(
        {"num_key_value_heads": 32, "sliding_window": 4096, "max_window_layers": 62},
        _dots1,
        "layers from max_window_layers on slide when a window is set",
    ),
    "afmoe": _type(
        {"head_dim": 128, "sliding_window": 1024, "global_attn_every_n_layers": 4},
        _afmoe,
        "every global_attn_every_n_layers-th layer full",
    ),
    "cwm": _type(
        {"num_key_value_heads": 8, "head_dim": 128, "sliding_window": 8192},
        _first_of_four_full,
        _FIRST_OF_FOUR,
    ),
    "vaultgemma": _type(
        {"num_key_value_heads": 4, "head_dim": 256, "sliding_window": 4096},
        _every_other,
        "sliding and full layers alternate",
    ),
    "cohere2_moe": _type(
        {
            "head_dim": 128,
            "sliding_window": 4096,
            "sliding_window_pattern": 4,
            "prefix_dense_sliding_window_pattern": 1,
            "first_k_dense_replace": 0,
        },
        _cohere2_moe,
        "every sliding_window_pattern-th layer full (prefix_dense_sliding_window_pattern for "
        "the first_k_dense_replace dense layers)",
    ),
    "granite_swa": _type(
        {"num_key_value_heads": 4, "sliding_window": 128}, _first_of_four_full, _FIRST_OF_FOUR
    ),
    "granitemoe_swa": _type({"sliding_window": 128}, _first_of_four_full, _FIRST_OF_FOUR),
    "smollm3": _type(
        {
            "num_key_value_heads": 4,
            "use_sliding_window": False,
            "no_rope_layer_interval": 4,
        },
        _smollm3,
        "the NoPE layers slide when use_sliding_window",
    ),
    "mellum": _type(
        {"num_key_value_heads": 4, "head_dim": 128, "sliding_window": 1024},
        _all_full,
        "every layer full",
    ),
    "laguna": _type(
        {"num_key_value_heads": 8, "head_dim": 128, "sliding_window": 512},
        _all_full,
        "every layer full",
    ),
    "beam": _type(
        {"num_key_value_heads": 8, "head_dim": 128, "sliding_window": 512},
        _beam,
        "every sixth layer and the last full",
    ),
    "flint": _type(
        {"num_key_value_heads": 4, "head_dim": 128, "sliding_window": 513},
        _flint,
        "layers 0, 1, the last and every i % 4 == 1 full",
    ),
    "kolibri1": _type(
        {"num_key_value_heads": 4, "head_dim": 128, "sliding_window": 513},
        _kolibri1,
        "every fifth layer full",
    ),
    "ministral": _type({"num_key_value_heads": 8, "sliding_window": 4096}, _uniform, _UNIFORM),
    # classes without layer_types whose attention takes config.sliding_window in every layer
    # (transformers' cache rule: every layer slides when a window is set)
    "ministral3": _type({"num_key_value_heads": 8, "head_dim": 128}, _uniform, _UNIFORM),
    "qwen3_moe": _type(
        {"num_key_value_heads": 4, "use_sliding_window": False, "sliding_window": 4096},
        _uniform,
        _UNIFORM,
    ),
    "phi3": _type({}, _uniform, _UNIFORM),
    "phimoe": _type({"num_key_value_heads": 8}, _uniform, _UNIFORM),
    "phi4_multimodal": _type({"num_key_value_heads": 8}, _uniform, _UNIFORM),
    "starcoder2": _type({"num_key_value_heads": 2}, _uniform, _UNIFORM),
    "doge": _type({}, _uniform, _UNIFORM),
    # attention-only classes with no window, whose KV head / head size defaults differ from
    # the shared rule's
    "bitnet": _type({"num_key_value_heads": 5}, _uniform, _UNIFORM),
    "ernie4_5": _type({"num_key_value_heads": 2, "head_dim": 128}, _uniform, _UNIFORM),
    "ernie4_5_moe": _type({"num_key_value_heads": 4}, _uniform, _UNIFORM),
    "exaone": _type({"num_key_value_heads": 8}, _uniform, _UNIFORM),
    "gemma": _type({"num_key_value_heads": 16, "head_dim": 256}, _uniform, _UNIFORM),
    "glm": _type({"num_key_value_heads": 2, "head_dim": 128}, _uniform, _UNIFORM),
    "glm4": _type({"num_key_value_heads": 2, "head_dim": 128}, _uniform, _UNIFORM),
    "glm4_moe": _type({"num_key_value_heads": 8}, _uniform, _UNIFORM),
    "helium": _type({"num_key_value_heads": 20, "head_dim": 128}, _uniform, _UNIFORM),
    "hrm_text": _type({"head_dim": 128}, _hrm_text, _UNIFORM),
    "hy_v3": _type({"num_key_value_heads": 8, "head_dim": 128}, _uniform, _UNIFORM),
    "internlm3": _type({"num_key_value_heads": 2, "head_dim": 128}, _uniform, _UNIFORM),
    "iquestcoder": _type({"num_key_value_heads": 8, "head_dim": 128}, _uniform, _UNIFORM),
    "minimax_m2": _type({"num_key_value_heads": 8, "head_dim": 128}, _uniform, _UNIFORM),
    "sarvam_moe": _type({"num_key_value_heads": 4, "head_dim": 64}, _uniform, _UNIFORM),
    "seed_oss": _type({"num_key_value_heads": 8, "head_dim": 128}, _uniform, _UNIFORM),
    "solar_open": _type({"num_key_value_heads": 8, "head_dim": 128}, _uniform, _UNIFORM),
    "stablelm": _type({"num_key_value_heads": 32}, _uniform, _UNIFORM),
}

#: Model types whose config class makes layer kinds the generic path cannot derive (with or
#: without ``layer_types`` in the checkpoint): the reason the refusal gives.
REFUSED_TYPES: dict[str, str] = {
    "minimax": (
        "MiniMaxConfig makes every second layer 'linear_attention' (lightning attention, a "
        "fixed-size per-request state of num_attention_heads x head_dim x head_dim), which "
        "hybridkv has no spec for; planning it as attention would be wrong"
    ),
    "zaya": "ZayaConfig makes every layer 'hybrid' (attention plus a recurrent state)",
    "inkling_text": "InklingTextConfig makes 'hybrid' / 'hybrid_sliding' layers",
    "inkling2_text": "Inkling2TextConfig makes 'hybrid' / 'hybrid_sliding' layers",
    "inkling2_loop_text": "Inkling2LoopTextConfig makes 'hybrid' / 'hybrid_sliding' layers",
    "deepseek_v4": "DeepseekV4Config makes compressed (sparse) attention layers",
}

#: Fields naming which layers slide, chunk or skip RoPE: without ``layer_types``, only the
#: config class knows what they make.
PATTERN_FIELDS = (
    "sliding_window_pattern",
    "global_attn_every_n_layers",
    "max_window_layers",
    "no_rope_layers",
    "no_rope_layer_interval",
    "prefix_dense_sliding_window_pattern",
    "local_layer_ids",
    "sliding_window_size",
    "full_attention_interval",
)


def unknown_pattern_refusal(
    cfg: ConfigView, window: int | None, *, known: bool = False
) -> ConfigError | None:
    """The error for a config without ``layer_types`` whose layer kinds only its config class
    knows, else None: a chunk size (no class in :data:`GENERIC_TYPES` chunks), and for a model
    type outside it (``known`` false) also a window or a layer-pattern field.

    ``use_sliding_window: false`` switches every window off (in every transformers class that
    has the flag), so a Qwen-style config with it derives as all full attention.
    """
    found: list[str] = []
    if cfg.raw("attention_chunk_size") is not None:
        found.append(f"attention_chunk_size={cfg.raw('attention_chunk_size')!r}")
    if not known and cfg.raw("use_sliding_window") is not False:
        if window is not None:
            found.append(f"sliding_window={window}")
        found += [f"{k}={cfg.raw(k)!r}" for k in PATTERN_FIELDS if cfg.raw(k) is not None]
    if not found:
        return None
    return ConfigError(
        f"{cfg.model_type} config: has {', '.join(found)} but no 'layer_types'; which layers "
        f"this makes slide or chunk is up to transformers' {cfg.model_type} config class, and "
        "hybridkv has no rule for it; add 'layer_types' to config.json (one entry per layer: "
        "full_attention, sliding_attention or chunked_attention)"
    )
