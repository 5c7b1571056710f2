"""Typed errors of the engine layer, all :class:`hybridkv.errors.HybridKVError` subclasses."""

from __future__ import annotations

from hybridkv.errors import ConfigError, HybridKVError, RequestError

__all__ = [
    "BatchError",
    "BindingError",
    "DeviceError",
    "EngineError",
    "ModelSourceError",
    "NoActiveStepError",
    "PromptError",
    "SpeculativeConfigError",
]


class EngineError(HybridKVError, RuntimeError):
    """The model runner cannot carry out a step (its inputs or the model do not fit)."""


class BatchError(RequestError):
    """A step batch is malformed: bad lengths, block tables, state slots or copies.

    Raised before anything is written, so a rejected batch changes nothing.
    """


class BindingError(ConfigError):
    """A memory layout does not fit the model it should serve (kind, window, shape, members)."""


class DeviceError(HybridKVError, ValueError):
    """A device name torch cannot parse, or one this machine's torch does not have."""


class ModelSourceError(ConfigError):
    """A model cannot be loaded: unknown tiny model name, missing checkpoint files."""


class NoActiveStepError(EngineError):
    """The paged attention function was called outside :meth:`ModelRunner.execute`."""


class PromptError(RequestError):
    """A request the engine cannot serve: empty prompt, token ids outside the vocabulary,
    ``max_tokens < 1``, or an id already in use."""


class SpeculativeConfigError(HybridKVError, ValueError):
    """Bad speculative-decoding settings (draft count, proposer), or a model whose recurrent
    state cannot verify drafts."""
