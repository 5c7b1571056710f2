"""Loading causal LMs for the runner: a local checkpoint, or a built-in tiny random model.

Tiny models (:mod:`hybridkv.models.tiny`: names, architectures, config overrides) are built
here with seeded random weights.
"""

from __future__ import annotations

import copy
from pathlib import Path
from pickle import UnpicklingError
from typing import Any

import torch
from safetensors import SafetensorError

from hybridkv.engine.errors import ModelSourceError
from hybridkv.models.tiny import DEFAULT_TINY_MODEL, TINY_COMMON, TINY_MODELS, TinyModel

__all__ = [
    "DEFAULT_TINY_MODEL",
    "TINY_MODELS",
    "TinyModel",
    "load_model",
    "reference_copy",
    "tiny_config",
]


def tiny_config(name: str) -> Any:
    """The transformers config of tiny model ``name``.  Raises :class:`ModelSourceError`."""
    from transformers import AutoConfig

    tiny = TINY_MODELS.get(name)
    if tiny is None:
        raise ModelSourceError(
            f"model: unknown tiny model {name!r}; known: {', '.join(sorted(TINY_MODELS))}"
        )
    return AutoConfig.for_model(tiny.model_type, **{**TINY_COMMON, **tiny.overrides})


def load_model(
    source: str | Path,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str | None = None,
) -> Any:
    """A causal LM in eval mode: tiny model ``source`` (seeded random weights) or the
    checkpoint in directory ``source`` (``config.json`` + safetensors).

    The global torch RNG is left as it was.  Raises :class:`ModelSourceError` when
    ``source`` is neither a tiny model name nor a directory with a ``config.json``, or when
    transformers cannot load the checkpoint (missing or corrupt weights, unknown
    architecture).
    """
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = {"dtype": dtype}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    name = str(source)
    if name in TINY_MODELS:
        config = tiny_config(name)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            # from_config writes the implementation into the config it gets: give it a copy.
            model = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
                copy.deepcopy(config), **kwargs
            )
    else:
        path = Path(source)
        if not (path / "config.json").is_file():
            raise ModelSourceError(
                f"model: {name!r} is neither a tiny model ({', '.join(sorted(TINY_MODELS))}) "
                "nor a directory holding config.json and safetensors weights"
            )
        try:
            loaded: Any = AutoModelForCausalLM.from_pretrained(
                path, output_loading_info=True, **kwargs
            )
            model, info = loaded
        except (
            OSError,
            ValueError,
            KeyError,
            RuntimeError,
            SafetensorError,
            UnpicklingError,
        ) as exc:
            # transformers' own words on a missing or corrupt weight file (safetensors header,
            # pickle, shape mismatch) or an unknown architecture
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else "no message"
            if "ignore_mismatched_sizes" in first:  # it points at a report it logged
                raise ModelSourceError(
                    f"model: checkpoint {name!r} holds weights whose shapes differ from what "
                    "its config.json describes (transformers' load report, at log level "
                    "warning, lists them)"
                ) from exc
            raise ModelSourceError(
                f"model: cannot load {name!r} ({type(exc).__name__}: {first})"
            ) from exc
        missing = sorted(info.get("missing_keys") or ())
        if missing:
            # transformers would run with these weights freshly initialized: a model nobody
            # trained, different on every load
            more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
            raise ModelSourceError(
                f"model: checkpoint {name!r} lacks {len(missing)} weight(s) its config "
                f"needs ({', '.join(missing[:3])}{more})"
            )
    return model.eval()


def reference_copy(model: Any, attn_implementation: str | None = None) -> Any:
    """A deep copy of ``model`` (same weights) to serve as the exactness oracle.

    Take it before a :class:`~hybridkv.engine.runner.ModelRunner` switches ``model`` to paged
    attention, or name transformers' implementation (``"eager"``, ``"sdpa"``) to switch to.
    """
    ref = copy.deepcopy(model)
    if attn_implementation is not None:
        ref.set_attn_implementation(attn_implementation)
    return ref.eval()
