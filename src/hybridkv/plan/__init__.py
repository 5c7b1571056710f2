"""Planning: groups, block sizes and memory layout for a budget.  No torch."""

from __future__ import annotations

from hybridkv.plan.layout import (
    NULL_BLOCK_ID,
    ArenaPlan,
    GroupPlan,
    MemoryLayout,
    PoolPlan,
    Strategy,
)

__all__ = [
    "NULL_BLOCK_ID",
    "ArenaPlan",
    "GroupPlan",
    "MemoryLayout",
    "PoolPlan",
    "Strategy",
]
