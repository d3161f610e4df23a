"""Errors raised by the planner. wbridge re-raises them as its own ``WBridgeError`` subclasses."""


class LayoutError(ValueError):
    """A layout declaration is malformed (bad box, non-contiguous tensor, overlapping pieces)."""


class PlanError(ValueError):
    """A plan cannot be built or fails validation; the message names the tensors and ranks."""
