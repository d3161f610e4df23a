"""Dtype names the planner understands, with their sizes. Names follow torch (``bfloat16``...)."""

from __future__ import annotations

from .errors import LayoutError

ITEMSIZE: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "uint16": 2,
    "uint32": 4,
    "uint64": 8,
    "complex64": 8,
    "complex128": 16,
}


def itemsize(dtype: str) -> int:
    try:
        return ITEMSIZE[dtype]
    except KeyError:
        raise LayoutError(f"unknown dtype {dtype!r}; known: {sorted(ITEMSIZE)}") from None


def normalize(dtype: object) -> str:
    """Accepts torch dtypes, numpy dtypes and strings; returns the planner's name."""
    name = str(dtype)
    name = name.removeprefix("torch.")
    if name not in ITEMSIZE:
        raise LayoutError(f"unknown dtype {dtype!r}")
    return name
