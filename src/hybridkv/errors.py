"""Typed exceptions shared by every layer.

Every error raised for bad input is a :class:`HybridKVError`; the CLI turns one into a one-line
message and exit code 2.  Messages name the field, the offending value and what would be valid.
"""

from __future__ import annotations

import numbers

__all__ = [
    "AllocationError",
    "BudgetTooSmallError",
    "ConfigError",
    "HybridKVError",
    "InvariantError",
    "PlanError",
    "PoolRatiosError",
    "RequestError",
    "SpecError",
    "StorageError",
    "UnknownModelError",
    "UnsupportedModelTypeError",
    "as_integer",
    "brief_repr",
]


class HybridKVError(Exception):
    """Base class of every error hybridkv raises on bad input or an impossible request."""


class SpecError(HybridKVError, ValueError):
    """A layer spec was given invalid values (non-positive size, unknown dtype, ...)."""


class ConfigError(HybridKVError, ValueError):
    """A model config is missing a field or holds an invalid value."""


class UnsupportedModelTypeError(ConfigError):
    """The config's ``model_type`` is not one hybridkv can map to layer specs."""


class UnknownModelError(HybridKVError, LookupError):
    """A model name is neither in the catalog nor a path to a config."""


class PlanError(HybridKVError, ValueError):
    """A plan cannot be made: bad budget, bad block size, or not even one request fits."""


class BudgetTooSmallError(PlanError):
    """The budget holds not even one request of ``max_model_len`` tokens; ``least_bytes``
    (also in the message) is a budget that would hold one (0: not known)."""

    def __init__(self, message: str, least_bytes: int = 0) -> None:
        super().__init__(message)
        self.least_bytes = least_bytes


class PoolRatiosError(PlanError):
    """``pool_ratios`` do not match the groups the ``pools`` strategy plans (an input error
    even where other strategies are compared beside it)."""


class RequestError(HybridKVError, ValueError):
    """A cache-manager call does not match the request it names (unknown id, bad lengths)."""


class AllocationError(HybridKVError, RuntimeError):
    """Not enough free blocks; raised only by calls documented to raise instead of return."""


class StorageError(HybridKVError, ValueError):
    """A storage or view request names a layer, block or size the storage does not have."""


class InvariantError(AssertionError):
    """``check_invariants()`` found a broken invariant: a bug in hybridkv, not bad input."""


def brief_repr(value: object, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters, with its type: what an error message shows
    of a bad argument (``'gpt-oss-20b' (str)``, ``[1, 2, 3, ...] (list)``)."""
    text = repr(value)
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return f"{text} ({type(value).__name__})"


def as_integer(value: object) -> int | None:
    """``value`` as an ``int`` when it is an integer (a Python ``int`` or a numpy integer,
    whatever ids were computed with), None otherwise (a bool, a float, a string)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return None
    return int(value)
