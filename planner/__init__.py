"""wbridge planner: layouts, correspondence, balanced read plans, validation and simulation.

Pure: numpy only; imports nothing from ``wbridge`` or ``transports``.
"""

from .builder import DEFAULT_MIN_SPLIT_BYTES, build_plan, build_plans
from .compiler import LayoutBuilder, flat_range_boxes, local_tensor, pieces_for
from .errors import LayoutError, PlanError
from .layout import Box, Flat, Fused, LocalTensor, Piece, RankLayout, Shard, Stack, TensorSpec
from .packing import (
    PackedPlan,
    PackedStaging,
    StridedCopies,
    build_packed_plans,
    copy_boxes,
    pack_staging,
    pack_stagings,
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
    "PackedPlan",
    "PackedStaging",
    "Piece",
    "Plan",
    "PlanError",
    "RankLayout",
    "ReadOp",
    "Shard",
    "SimResult",
    "SourceOps",
    "StridedCopies",
    "Stack",
    "TensorSpec",
    "build_packed_plans",
    "build_plan",
    "build_plans",
    "copy_boxes",
    "flat_range_boxes",
    "format_summary",
    "local_tensor",
    "pack_staging",
    "pack_stagings",
    "pieces_for",
    "simulate",
    "summarize",
    "validate_plan",
]
