"""Reading a Hugging Face ``config.json``: loading, text-config selection and typed field access.

Everything here is plain JSON/dict logic (no transformers, no torch).  Derivation functions read
fields through a :class:`ConfigView`, whose errors name the field, the offending value and the
model type, e.g. ``jamba config: field 'mamba_d_state' must be an integer >= 1, got 0``.

Defaults
--------
Published checkpoints often omit fields whose value equals the transformers config-class
default (``google/gemma-3-4b-it`` has no ``num_attention_heads``).  Each architecture therefore
declares the transformers defaults it relies on; a :class:`ConfigView` reads the checkpoint's
value first and the declared default second.  A field with neither is *required* and its absence
raises :class:`~hybridkv.errors.ConfigError` naming the field and the model type.  A field whose
value is JSON ``null`` is absent too, but it is *not* replaced by the default: as in
transformers, ``"sliding_window": null`` means "no window" even where the class default is 4096.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from hybridkv.errors import ConfigError, brief_repr
from hybridkv.specs import DType, LayerSpec

__all__ = [
    "MAX_CONFIG_INT",
    "MAX_LAYERS",
    "MODEL_TYPE_ALIASES",
    "WRAPPER_TEXT_TYPES",
    "Architecture",
    "ConfigView",
    "Derive",
    "DeriveContext",
    "load_config",
    "model_dtype",
    "select_text_config",
]

#: Multimodal wrapper ``model_type`` -> the ``model_type`` of its ``text_config`` (used when the
#: nested text config does not name its own type): the ``model_type`` of the wrapper config
#: class's ``sub_configs_defaults["text_config"]`` in transformers 5.24, listed for wrappers
#: whose text model is a decoder hybridkv derives (a registry entry or a generic type).
WRAPPER_TEXT_TYPES: dict[str, str] = {
    "audioflamingo3": "qwen2",
    "aya_vision": "cohere2",
    "blip-2": "opt",
    "cohere2_vision": "cohere2",
    "deepseek_vl": "llama",
    "deepseek_vl_hybrid": "llama",
    "exaone4_5": "exaone4",
    "fast_vlm": "qwen2",
    "fun_asr_nano": "qwen3",
    "fuyu": "persimmon",
    "gemma3": "gemma3_text",
    "gemma4": "gemma4_text",
    "gemma4_assistant": "gemma4_text",
    "glmasr": "llama",
    "got_ocr2": "qwen2",
    "granite_speech": "granite",
    "granite_speech_plus": "granite",
    "hyperclovax_vision_v2": "hyperclovax",
    "idefics2": "mistral",
    "idefics3": "llama",
    "instructblip": "opt",
    "instructblipvideo": "opt",
    "internvl": "qwen2",
    "janus": "llama",
    "jev": "qwen3_5_text",
    "kimi_k25": "deepseek_v3",
    "lfm2_vl": "lfm2",
    "lfm3_vl": "lfm3",
    "lighton_ocr": "qwen3",
    "llama4": "llama4_text",
    "llava": "llama",
    "llava_next": "llama",
    "llava_next_video": "llama",
    "llava_onevision": "qwen2",
    "minicpm_ocr": "qwen3_5_text",
    "minicpmv4_6": "qwen3_5_text",
    "minicpmv4_7": "qwen3_5_text",
    "mistral3": "mistral",
    "moss_transcribe_diarize": "qwen3",
    "musicflamingo": "qwen2",
    "nemo_speechlm": "nemotron_h",
    "nemotron_h_omni": "nemotron_h",
    "omniasr": "llama",
    "ovis2": "qwen2",
    "paligemma": "gemma",
    "perception_lm": "llama",
    "pp_chart2table": "qwen2",
    "qianfan_ocr": "qwen3",
    "qwen2_audio": "qwen2",
    "qwen3_5": "qwen3_5_text",
    "qwen3_5_moe": "qwen3_5_moe_text",
    "qwen3_asr": "qwen3",
    "shieldgemma2": "gemma3_text",
    "smolvlm": "llama",
    "vibevoice": "qwen2",
    "vibevoice_asr": "qwen2",
    "video_llama_3": "qwen2",
    "video_llava": "llama",
    "vipllava": "llama",
    "voxtral": "llama",
}

#: ``model_type`` values that name another type's architecture: Moonshot's Kimi-K2 checkpoints
#: say ``kimi_k2`` and load with DeepSeek-V3's config and model classes (``architectures:
#: DeepseekV3ForCausalLM``), and transformers' ``kimi_k25`` config maps a ``kimi_k2`` text
#: config to ``deepseek_v3`` the same way.
MODEL_TYPE_ALIASES: dict[str, str] = {"kimi_k2": "deepseek_v3"}

#: The most decoder layers a config may declare: real models have a few hundred at most, and
#: a planner walks every layer (a typo of 10^11 layers would run out of memory, not fail).
MAX_LAYERS = 1 << 16
#: The largest value any integer field of a config may take unless the field says otherwise
#: (2^31 - 1): past every real size, position count or id, and small enough that products of
#: a few such fields still convert to float (a ``1e308`` head_dim overflowed the planner).
MAX_CONFIG_INT = (1 << 31) - 1

#: The model dtype when a config names none (the dtype nearly every checkpoint ships in).
DEFAULT_DTYPE = DType.BF16


def load_config(config: Mapping[str, Any] | str | os.PathLike[str]) -> dict[str, Any]:
    """Return the config as a dict: ``config`` itself, or the JSON read from a path.

    A path may name a ``config.json`` file or a directory containing one.  The returned dict is
    never mutated by hybridkv.  Raises :class:`ConfigError` naming the path when the file is
    missing or is not a JSON object.
    """
    if isinstance(config, Mapping):
        return dict(config)
    if not isinstance(config, str | os.PathLike):
        raise ConfigError(
            f"config: expected a config dict, a path to a config.json or a directory holding "
            f"one, got {brief_repr(config)}"
        )
    path = Path(config)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError(
            f"config: {str(config)!r} is not a config.json file or a directory containing one"
        )
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:  # JSONDecodeError, UnicodeDecodeError: ValueErrors
        raise ConfigError(f"config: cannot read {str(path)!r} as JSON: {exc}") from None
    except RecursionError:
        raise ConfigError(f"config: {str(path)!r} nests JSON too deeply to read") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config: {str(path)!r} holds {type(data).__name__}, not a JSON object")
    return data


def _model_type_of(data: Mapping[str, Any]) -> str | None:
    value = data.get("model_type")
    return value if isinstance(value, str) and value else None


def select_text_config(
    raw: Mapping[str, Any], supported: Mapping[str, object]
) -> tuple[str, Mapping[str, Any]]:
    """Pick the decoder config inside ``raw``: ``(model_type, config dict)``.

    Types are read through :data:`MODEL_TYPE_ALIASES`.  A top-level ``model_type`` in
    ``supported`` wins.  Otherwise a nested ``text_config`` (the layout of multimodal wrappers
    such as gemma3, gemma4 and llama4) is used; its model type is its own ``model_type`` or,
    failing that, the wrapper's entry in :data:`WRAPPER_TEXT_TYPES`.
    The dtype of the wrapper is inherited when the text config names none.  Raises
    :class:`ConfigError` when no model type can be found.
    """
    top_type = _model_type_of(raw)
    top_type = MODEL_TYPE_ALIASES.get(top_type or "", top_type)
    if top_type is not None and top_type in supported:
        return top_type, raw
    text = raw.get("text_config")
    if isinstance(text, Mapping):
        text_type = _model_type_of(text)
        text_type = MODEL_TYPE_ALIASES.get(text_type or "", text_type)
        text_type = text_type or WRAPPER_TEXT_TYPES.get(top_type or "")
        if text_type is not None:
            merged = dict(text)
            for key in ("dtype", "torch_dtype"):
                if merged.get(key) is None and raw.get(key) is not None:
                    merged[key] = raw[key]
            return text_type, merged
    if top_type is None:
        given = raw.get("model_type")
        what = "missing" if given is None else f"must be a non-empty string, got {given!r}"
        raise ConfigError(
            f"config.model_type: {what}; a Hugging Face config.json names its architecture in "
            "'model_type' (e.g. 'llama', 'gpt_oss', 'qwen3_next')"
        )
    return top_type, raw


def model_dtype(data: Mapping[str, Any], model_type: str) -> DType:
    """The dtype the model runs in: ``dtype`` or ``torch_dtype``, bfloat16 when neither is set.

    Raises :class:`~hybridkv.errors.SpecError` naming the field when the name is not a dtype
    hybridkv knows.
    """
    for key in ("dtype", "torch_dtype"):
        value = data.get(key)
        if value is not None:
            return DType.parse(str(value), field=f"{model_type} config.{key}")
    return DEFAULT_DTYPE


@dataclass(frozen=True, kw_only=True)
class DeriveContext:
    """Settings every derivation function receives.

    ``dtype`` is the model dtype (conv states follow it); ``kv_dtype`` applies to attention and
    MLA caches only; ``ssm_state_dtype`` overrides the dtype of recurrent (SSM / delta-rule)
    state tensors, ``None`` meaning the architecture's own rule.  ``tp_size`` is the tensor
    parallel size the per-rank shapes are divided by.
    """

    tp_size: int
    dtype: DType
    kv_dtype: DType
    ssm_state_dtype: DType | None = None
    notes: list[str] = field(default_factory=list)

    def note(self, text: str) -> None:
        """Record a note for :attr:`hybridkv.specs.ModelSpec.notes` (mutates ``notes``)."""
        if text not in self.notes:
            self.notes.append(text)


@dataclass(frozen=True)
class ConfigView:
    """Typed, read-only access to one decoder config, with per-architecture defaults.

    ``data`` holds the checkpoint's fields; ``defaults`` the transformers defaults this
    architecture relies on.  Every getter raises :class:`ConfigError` naming the model type,
    the field and the offending value.
    """

    model_type: str
    data: Mapping[str, Any]
    defaults: Mapping[str, Any] = field(default_factory=dict)

    def raw(self, key: str) -> Any:
        """The value of ``key``: the checkpoint's (an explicit ``null`` included), else the default.

        As in transformers, an explicit ``null`` overrides the class default (``"sliding_window":
        null`` means no window even where the default is 4096).  ``None`` means absent.
        """
        if key in self.data:
            return self.data[key]
        return self.defaults.get(key)

    def has(self, key: str) -> bool:
        return self.raw(key) is not None

    def _fail(self, key: str, value: object, expected: str) -> ConfigError:
        return ConfigError(
            f"{self.model_type} config: field {key!r} must be {expected}, got {value!r}"
        )

    def missing(self, key: str, why: str = "") -> ConfigError:
        """The error for a required field that is absent."""
        extra = f" ({why})" if why else ""
        return ConfigError(f"{self.model_type} config: missing required field {key!r}{extra}")

    def _int(self, key: str, value: object, minimum: int, maximum: int | None = None) -> int:
        if maximum is None:
            maximum = MAX_CONFIG_INT
        expected = f"an integer in [{minimum}, {maximum}]"
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self._fail(key, value, expected)
        if isinstance(value, float) and not value.is_integer():
            raise self._fail(key, value, expected)
        number = int(value)
        if number < minimum or number > maximum:
            raise self._fail(key, value, expected)
        return number

    def req_int(
        self, key: str, *, minimum: int = 1, maximum: int | None = None, why: str = ""
    ) -> int:
        """The integer ``key`` (>= ``minimum``, default positive, and <= ``maximum`` when
        given); absent -> ConfigError."""
        value = self.raw(key)
        if value is None:
            raise self.missing(key, why)
        return self._int(key, value, minimum, maximum)

    def opt_int(self, key: str, *, minimum: int = 1, maximum: int | None = None) -> int | None:
        """The integer ``key`` or ``None`` when absent (present values are validated)."""
        value = self.raw(key)
        return None if value is None else self._int(key, value, minimum, maximum)

    def first_int(self, *keys: str, minimum: int = 1) -> int | None:
        """The first present integer among ``keys`` (aliases), or ``None``."""
        for key in keys:
            value = self.opt_int(key, minimum=minimum)
            if value is not None:
                return value
        return None

    def req_bool(self, key: str, *, default: bool) -> bool:
        value = self.raw(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self._fail(key, value, "true or false")
        return value

    def opt_str(self, key: str) -> str | None:
        value = self.raw(key)
        if value is None:
            return None
        if not isinstance(value, str):
            raise self._fail(key, value, "a string")
        return value

    def opt_int_list(self, key: str, *, minimum: int = 0) -> list[int] | None:
        """A list of integers (each >= ``minimum``) or ``None`` when absent."""
        value = self.raw(key)
        if value is None:
            return None
        if not isinstance(value, list | tuple):
            raise self._fail(key, value, "a list of integers")
        return [self._int(f"{key}[{i}]", v, minimum) for i, v in enumerate(value)]

    def opt_str_list(self, key: str) -> list[str] | None:
        """A list of strings or ``None`` when absent."""
        value = self.raw(key)
        if value is None:
            return None
        if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
            raise self._fail(key, value, "a list of strings")
        return list(value)

    def opt_mapping(self, key: str) -> Mapping[str, Any] | None:
        value = self.raw(key)
        if value is None:
            return None
        if not isinstance(value, Mapping):
            raise self._fail(key, value, "a JSON object")
        return value

    def num_layers(self) -> int:
        """``num_hidden_layers`` (required, in [1, :data:`MAX_LAYERS`])."""
        return self.req_int("num_hidden_layers", maximum=MAX_LAYERS)

    def check_length(self, key: str, values: list[Any], num_layers: int) -> None:
        """Raise ConfigError unless a per-layer list has one entry per layer."""
        if len(values) != num_layers:
            raise ConfigError(
                f"{self.model_type} config: field {key!r} has {len(values)} entries but the "
                f"model has {num_layers} layers (num_hidden_layers)"
            )


#: A derivation function: one :class:`~hybridkv.specs.LayerSpec` per decoder layer.
Derive = Callable[[ConfigView, DeriveContext], list[LayerSpec]]


class Architecture(NamedTuple):
    """One registry entry: how to derive layer specs for a ``model_type``.

    ``defaults`` are the transformers config-class defaults the derivation relies on when a
    checkpoint omits a field; ``family`` is a short label for listings.
    """

    derive: Derive
    defaults: Mapping[str, Any]
    family: str
