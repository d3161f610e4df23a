"""The slot stamp: 32 registered bytes next to each staging slot that say which version it holds.

Layout (four native uint64): magic, version, state, epoch. A publisher writes ``STAMP_WRITING``
before the first byte of a slot changes and ``STAMP_STABLE`` once the slot holds the whole version;
a reader reads the stamp after its data reads and discards them unless it still says
``(STAMP_MAGIC, v, STAMP_STABLE, epoch)``.
"""

STAMP_BYTES = 32  # uint64 magic, version, state, epoch
STAMP_MAGIC = 0x57425354414D5031  # "WBSTAMP1"
STAMP_STABLE, STAMP_WRITING = 0, 1

__all__ = ["STAMP_BYTES", "STAMP_MAGIC", "STAMP_STABLE", "STAMP_WRITING"]
