"""Checks of the manager's public arguments, done once per call at its boundary: a wrong
type or an id out of range raises the cache's typed error naming the call, the argument and
the value, instead of a ``TypeError`` or ``IndexError`` from deep inside."""

from __future__ import annotations

import operator
from collections.abc import Iterable
from typing import SupportsIndex

from hybridkv.cache.errors import LayoutMismatchError, RequestLengthError, UnknownRequestError
from hybridkv.cache.tiers import TierSpec
from hybridkv.cache.types import ComputedBlocks
from hybridkv.errors import PlanError, brief_repr

__all__ = [
    "check_computed_blocks",
    "check_count",
    "check_group_id",
    "check_index",
    "check_request_id",
    "check_tier_specs",
]


def check_request_id(where: str, request_id: object) -> None:
    """Raise :class:`UnknownRequestError` for a ``request_id`` that is not a ``str`` (no request
    has one; an unhashable value would otherwise fail the lookup with a ``TypeError``)."""
    if not isinstance(request_id, str):
        raise UnknownRequestError(
            f"{where}: request_id must be a str naming a request, got {brief_repr(request_id)}"
        )


def check_index(where: str, name: str, value: object) -> int:
    """``value`` as an int (any integer type but ``bool``, e.g. numpy's); raises
    :class:`LayoutMismatchError` naming ``name`` otherwise."""
    if type(value) is int:
        return value
    if isinstance(value, bool) or not isinstance(value, SupportsIndex):
        raise LayoutMismatchError(f"{where}: {name} must be an integer, got {brief_repr(value)}")
    return operator.index(value)


def check_group_id(where: str, group_id: object, num_groups: int) -> int:
    """``group_id`` as an int in ``[0, num_groups)``; raises :class:`LayoutMismatchError`
    otherwise."""
    group_id = check_index(where, "group_id", group_id)
    if not 0 <= group_id < num_groups:
        raise LayoutMismatchError(
            f"{where}: group_id {group_id} is not a group of this layout "
            f"(valid: 0..{num_groups - 1})"
        )
    return group_id


def check_tier_specs(tiers: object) -> tuple[TierSpec, ...]:
    """``tiers`` as a tuple of :class:`TierSpec`; raises :class:`PlanError` otherwise."""
    valid = "a sequence of TierSpec (host, then disk), e.g. [TierSpec('host', 64 << 30)]"
    if isinstance(tiers, (str, bytes, TierSpec)) or not isinstance(tiers, Iterable):
        raise PlanError(f"tiers: expected {valid}, got {brief_repr(tiers)}")
    specs = tuple(tiers)
    for i, spec in enumerate(specs):
        if not isinstance(spec, TierSpec):
            raise PlanError(
                f"tiers[{i}]: expected a TierSpec, got {brief_repr(spec)}; give {valid}"
            )
    return specs


def check_count(name: str, value: object) -> int:
    """``value`` if it is an integer >= 0, else a :class:`RequestLengthError` naming ``name``."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise RequestLengthError(f"{name}: must be an integer >= 0, got {value!r}")
    return value


def check_computed_blocks(rid: str, num_tokens: int, blocks: ComputedBlocks) -> None:
    """Raise unless the fields of ``blocks`` (its type is checked at the call's boundary) have
    the shape ``KVCacheManager.get_computed_blocks`` returns for request ``rid`` of
    ``num_tokens`` tokens (found by review: a junction of None failed inside the allocation,
    after the request had taken blocks)."""
    if not isinstance(blocks.blocks, tuple):
        raise LayoutMismatchError(
            f"request {rid!r}: new_computed_blocks.blocks must be a tuple of per-group block "
            f"ids, got {brief_repr(blocks.blocks)}"
        )
    hit, junction = blocks.num_computed_tokens, blocks.junction_tokens
    for name, value in (("num_computed_tokens", hit), ("junction_tokens", junction)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise RequestLengthError(
                f"request {rid!r}: new_computed_blocks.{name} must be an integer, got "
                f"{brief_repr(value)}"
            )
    if not hit <= junction <= num_tokens:
        raise RequestLengthError(
            f"request {rid!r}: new_computed_blocks.junction_tokens {junction} outside "
            f"[{hit}, {num_tokens}] (the hit, the request's tokens)"
        )
