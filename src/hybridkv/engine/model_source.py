"""What the engine reads about a model before loading its weights: its transformers config,
vocabulary, default ``max_model_len``, and whether a prompt fits."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hybridkv.engine.cache_config import DEFAULT_MAX_MODEL_LEN
from hybridkv.engine.errors import ModelSourceError
from hybridkv.engine.models import TINY_MODELS, tiny_config

__all__ = [
    "config_vocab_size",
    "default_max_model_len",
    "eos_token_ids",
    "is_token_id",
    "model_config",
    "position_limit",
    "prompt_problem",
]


def position_limit(config: Any) -> int | None:
    """The positions a model with transformers config ``config`` was made for (its
    ``max_position_embeddings``), or None where the config names none."""
    limit = getattr(config.get_text_config(decoder=True), "max_position_embeddings", None)
    return limit if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0 else None


def default_max_model_len(config: Any) -> int:
    """The engine's ``max_model_len`` for a model with transformers config ``config`` when
    :class:`CacheConfig` names none: its ``max_position_embeddings``, at most
    :data:`DEFAULT_MAX_MODEL_LEN` (that, when the config has no limit)."""
    limit = position_limit(config)
    return DEFAULT_MAX_MODEL_LEN if limit is None else min(limit, DEFAULT_MAX_MODEL_LEN)


def config_vocab_size(config: Any) -> int:
    """The vocabulary size of a model with transformers config ``config``."""
    return int(config.get_text_config(decoder=True).vocab_size)


def model_config(source: str | Path) -> Any:
    """The transformers config of tiny model or checkpoint directory ``source``, read without
    loading any weight (what :class:`LLMEngine` checks before it loads the model).

    Raises :class:`~hybridkv.engine.errors.ModelSourceError` when ``source`` is neither a tiny
    model nor a directory with a ``config.json``, or transformers cannot read the config, and
    :class:`~hybridkv.errors.UnsupportedModelTypeError` (or another
    :class:`~hybridkv.errors.ConfigError`) when :mod:`hybridkv.models` cannot map it.
    """
    name = str(source)
    if name in TINY_MODELS:
        return tiny_config(name)
    path = Path(source)
    _check_architecture(path)
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path)
    except (OSError, ValueError, KeyError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelSourceError(f"model: cannot read the config of {name!r}: {first}") from exc


def eos_token_ids(source: str | Path) -> list[int]:
    """The end-of-sequence ids of tiny model or checkpoint ``source``, read without loading a
    weight: its ``generation_config.json``'s ``eos_token_id`` where it has one, else its
    config's (none for the tiny models).  Raises like :func:`model_config`."""
    config = model_config(source)
    eos = getattr(config, "eos_token_id", None)
    if str(source) not in TINY_MODELS and (Path(source) / "generation_config.json").is_file():
        from transformers import GenerationConfig

        try:
            generation = GenerationConfig.from_pretrained(str(source))
        except (OSError, ValueError) as exc:
            raise ModelSourceError(
                f"model: cannot read {str(source)!r}'s generation_config.json: {exc}"
            ) from None
        if generation.eos_token_id is not None:
            eos = generation.eos_token_id
    if eos is None:
        return []
    return [int(e) for e in eos] if isinstance(eos, list | tuple) else [int(eos)]


def is_token_id(value: object, vocab_size: int) -> bool:
    """Whether ``value`` is a Python int (not a bool) in ``[0, vocab_size)``."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < vocab_size


def prompt_problem(prompt: Sequence[int], *, vocab_size: int, max_model_len: int) -> str | None:
    """Why an engine with ``vocab_size`` and ``max_model_len`` cannot serve ``prompt`` (an
    empty prompt, a token id outside ``[0, vocab_size)``, ``max_model_len`` tokens or more: one
    output token must fit), or ``None`` when it can.  What :meth:`LLMEngine.check_prompt`
    checks, usable before the model is loaded."""
    if not prompt:
        return "the prompt is empty"
    for t in prompt:
        if not isinstance(t, int) or isinstance(t, bool):
            return (
                f"token id {t!r} ({type(t).__name__}) is not a Python int; give token ids as "
                "ints (e.g. tensor.tolist())"
            )
        if not 0 <= t < vocab_size:
            return f"token id {t!r} is outside the vocabulary [0, {vocab_size})"
    if len(prompt) >= max_model_len:
        return (
            f"the prompt has {len(prompt)} tokens; prompts must be shorter than max_model_len "
            f"{max_model_len}"
        )
    return None


def _check_architecture(path: Path) -> None:
    """Fail before loading weights when ``path`` has no config or an architecture
    :mod:`hybridkv.models` cannot map (its errors propagate)."""
    from hybridkv.models import spec_from_config

    if not (path / "config.json").is_file():
        raise ModelSourceError(
            f"model: {str(path)!r} is neither a tiny model ({', '.join(sorted(TINY_MODELS))}) "
            "nor a directory holding config.json and safetensors weights"
        )
    spec_from_config(path)
