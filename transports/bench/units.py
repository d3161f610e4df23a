"""Byte sizes as people write them: ``1GiB``, ``4MiB``, ``512k``, ``1e6``; sweeps ``4KiB:64MiB``."""

from __future__ import annotations

import argparse
import re

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kb": 1000,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mb": 10**6,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gb": 10**9,
    "gib": 1 << 30,
}


def parse_size(text: str) -> int:
    """``"1GiB"`` -> 1073741824; also ``4MiB``, ``512k``, ``1e6``, plain integers; positive."""
    m = re.fullmatch(r"\s*([0-9.e+]+)\s*([a-zA-Z]*)\s*", text)
    try:
        value = int(float(m.group(1)) * _UNITS[m.group(2).lower()]) if m else 0
    except (KeyError, ValueError):
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 1GiB, 4MiB, 65536)")
    return value


def parse_sweep(text: str) -> list[int]:
    """``"4KiB:64MiB"`` -> every power of two from 4 KiB to 64 MiB (both ends powers of two)."""
    lo_text, sep, hi_text = text.partition(":")
    if not sep:
        raise argparse.ArgumentTypeError(f"a sweep is LOW:HIGH (4KiB:64MiB), not {text!r}")
    lo, hi = parse_size(lo_text), parse_size(hi_text)
    if lo & (lo - 1) or hi & (hi - 1) or lo > hi:
        raise argparse.ArgumentTypeError(f"a sweep runs between two powers of two, low first: {text!r}")
    return [1 << k for k in range(lo.bit_length() - 1, hi.bit_length())]


def human(n: int) -> str:
    """``4194304`` -> ``4MiB``; sizes that are not whole KiB/MiB/GiB stay in bytes."""
    for unit, k in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= k and n % k == 0:
            return f"{n // k}{unit}"
    return str(n)
