"""Planning: groups, block sizes and memory layout for a budget.  No torch."""

from __future__ import annotations

from hybridkv.plan.accounting import Waste
from hybridkv.plan.compare import (
    NaiveEstimate,
    StrategyComparison,
    StrategyFailure,
    compare_strategies,
)
from hybridkv.plan.grouping import SpecGroup, group_entries
from hybridkv.plan.layout import (
    NULL_BLOCK_ID,
    ArenaPlan,
    GroupPlan,
    MemoryLayout,
    PoolPlan,
    Strategy,
)
from hybridkv.plan.need import blocks_for_request, spec_blocks_for_request
from hybridkv.plan.options import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_CHUNK_ALIGNMENT,
    DEFAULT_STATE_BLOCK_SIZE,
    PlanOptions,
)
from hybridkv.plan.planner import make_plan
from hybridkv.plan.result import Capacity, PhysicalNeed, Plan

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_CHUNK_ALIGNMENT",
    "DEFAULT_STATE_BLOCK_SIZE",
    "NULL_BLOCK_ID",
    "ArenaPlan",
    "Capacity",
    "GroupPlan",
    "MemoryLayout",
    "NaiveEstimate",
    "PhysicalNeed",
    "Plan",
    "PlanOptions",
    "PoolPlan",
    "SpecGroup",
    "Strategy",
    "StrategyComparison",
    "StrategyFailure",
    "Waste",
    "blocks_for_request",
    "compare_strategies",
    "group_entries",
    "make_plan",
    "spec_blocks_for_request",
]
