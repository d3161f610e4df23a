"""wbridge planner: layouts, correspondence, balanced read plans, validation and simulation.

Pure: numpy only; imports nothing from ``wbridge`` or ``transports``.
"""

from .builder import DEFAULT_MIN_SPLIT_BYTES, build_plan, build_plans
from .errors import LayoutError, PlanError
from .layout import (
    Box,
    Flat,
    Fused,
    LayoutBuilder,
    LocalTensor,
    Piece,
    RankLayout,
    Shard,
    Stack,
    TensorSpec,
    flat_range_boxes,
    local_tensor,
    pieces_for,
)
from .plan import Plan, ReadOp, SourceOps, format_summary, summarize
from .simulate import SimResult, simulate
from .validate import validate_plan

__all__ = [
    "DEFAULT_MIN_SPLIT_BYTES",
    "Box",
    "Flat",
    "Fused",
    "LayoutBuilder",
    "LayoutError",
    "LocalTensor",
    "Piece",
    "Plan",
    "PlanError",
    "RankLayout",
    "ReadOp",
    "Shard",
    "SimResult",
    "SourceOps",
    "Stack",
    "TensorSpec",
    "build_plan",
    "build_plans",
    "flat_range_boxes",
    "format_summary",
    "local_tensor",
    "pieces_for",
    "simulate",
    "summarize",
    "validate_plan",
]
