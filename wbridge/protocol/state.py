"""A subscriber's state key (``Keys.sub(i, "state")``): the version it holds and the one it reads.

Written by the subscriber (``wbridge.pull``), read by the aggregating publisher rank
(``wbridge.publish.tracker``): ``b"<acked> <reading>"``, 0 for none."""

from __future__ import annotations


def state_bytes(acked: int, reading: int) -> bytes:
    """The value of ``Keys.sub(i, "state")``: last version applied, version being read (0: none)."""
    return f"{acked} {reading}".encode()


def parse_state(raw: bytes | None) -> tuple[int, int]:
    """(acked, reading) of a state value; absent or malformed reads as (0, 0): nothing acked yet."""
    try:
        acked, reading = raw.split()
        return int(acked), int(reading)
    except (ValueError, AttributeError):
        return 0, 0


__all__ = ["parse_state", "state_bytes"]
