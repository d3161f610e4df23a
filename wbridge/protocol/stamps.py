"""The slot stamp: 32 registered bytes next to each staging slot that say which version it holds.

Layout (four native uint64): magic, version, state, epoch. A publisher writes ``STAMP_WRITING``
before the first byte of a slot changes and ``STAMP_STABLE`` once the slot holds the whole version;
a reader reads the stamp after its data reads and discards them unless it still says
``(STAMP_MAGIC, v, STAMP_STABLE, epoch)``: what a ``Stamp`` says (a version record's is
``VersionRecord.stamp``; a relay's buffer is one slot, 0).
"""

from __future__ import annotations

from dataclasses import dataclass

STAMP_BYTES = 32  # uint64 magic, version, state, epoch
STAMP_MAGIC = 0x57425354414D5031  # "WBSTAMP1"
STAMP_STABLE, STAMP_WRITING = 0, 1


@dataclass(frozen=True)
class Stamp:
    """What the stamp of ``slot`` must say for the bytes read from it to be version ``v`` of
    publisher epoch ``epoch``, whole."""

    v: int
    epoch: int
    slot: int = 0

    @property
    def words(self) -> tuple[int, int, int, int]:
        """The stamp's four words: magic, version, state (stable), epoch."""
        return STAMP_MAGIC, self.v, STAMP_STABLE, self.epoch


__all__ = ["STAMP_BYTES", "STAMP_MAGIC", "STAMP_STABLE", "STAMP_WRITING", "Stamp"]
