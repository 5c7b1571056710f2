"""Errors the cache manager raises for calls that do not match the request they name.

All subclass :class:`hybridkv.errors.RequestError`; a call that raises leaves every structure
exactly as it was.
"""

from __future__ import annotations

from hybridkv.errors import RequestError

__all__ = [
    "DuplicateRequestError",
    "FinishedRequestError",
    "LayoutMismatchError",
    "RequestLengthError",
    "StaleComputedBlocksError",
    "UnknownRequestError",
    "UnwrittenTokensError",
]


class UnknownRequestError(RequestError, LookupError):
    """The request id names no request this manager has allocated for."""


class FinishedRequestError(RequestError):
    """The request was freed (finished); it cannot be allocated for or queried again."""


class RequestLengthError(RequestError):
    """Token counts or lengths given for a request do not match the request's tokens."""


class LayoutMismatchError(RequestError):
    """The request or the blocks passed were made for a different layout or hasher."""


class StaleComputedBlocksError(RequestError):
    """``new_computed_blocks`` no longer match the prefix cache (evicted or not a hit)."""


class DuplicateRequestError(RequestError):
    """Two different :class:`~hybridkv.cache.request.Request` objects use one request id."""


class UnwrittenTokensError(RequestError):
    """An import cannot write tokens that a later query reads, or that a block already
    published holds (:meth:`~hybridkv.cache.manager.KVCacheManager.drop_unread`)."""
