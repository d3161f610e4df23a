"""Errors raised by the planner, under one root, ``PlannerError``.

The planner imports nothing of wbridge; ``wbridge.errors`` places ``PlannerError`` under
``wbridge.WBridgeError`` when wbridge is imported (see there), so a wbridge user catches these as
``WBridgeError`` while the planner stays usable on its own.
"""


class PlannerError(Exception):
    """Root of the planner's errors."""


class LayoutError(PlannerError, ValueError):
    """A layout declaration is malformed (bad box, non-contiguous tensor, overlapping pieces)."""


class PlanError(PlannerError, ValueError):
    """A plan cannot be built or fails validation; the message names the tensors and ranks."""
