"""When a blocking call must be over: one value instead of the time left recomputed at each use.

A public call turns its ``timeout`` into a ``Deadline`` once (``Deadline.after(timeout)``) and hands
that to every stage it runs; each stage asks it what it needs: the seconds left for one wait or read
(``left``), whether it passed (``expired``), a ``WaitTimeout`` naming what did not come in time
(``check``), or an earlier deadline for a part of the work (``share``). Store calls take the
``time.monotonic()`` value itself (``Store.deadline(deadline.at)``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from .errors import WaitTimeout


@dataclass(frozen=True)
class Deadline:
    """A point in ``time.monotonic()`` time.

    - ``at``: when it passes.
    - ``seconds``: the timeout it was made from (for messages: "within 60.0s").
    """

    at: float
    seconds: float = 0.0

    @classmethod
    def after(cls, seconds: float) -> Deadline:
        """The deadline ``seconds`` from now."""
        return cls(time.monotonic() + seconds, seconds)

    def left(self, minimum: float = 0.0) -> float:
        """Seconds until it passes, at least ``minimum`` (a read or connect given ``minimum=0.1``
        still gets a chance to finish what is in flight)."""
        return max(minimum, self.at - time.monotonic())

    @property
    def expired(self) -> bool:
        return time.monotonic() >= self.at

    def check(self, message: str) -> float:
        """The seconds left; ``WaitTimeout(message)`` (saying what did not come in time) where none are."""
        left = self.at - time.monotonic()
        if left <= 0:
            raise WaitTimeout(message)
        return left

    def share(self, fraction: float) -> Deadline:
        """An earlier deadline: ``fraction`` of the time left from now (what one part of the work may
        take before the rest gets its turn)."""
        left = self.left()
        return Deadline(time.monotonic() + left * fraction, left * fraction)

    def __repr__(self) -> str:
        return f"Deadline(in {self.at - time.monotonic():.3f}s of {self.seconds:.1f}s)"


__all__ = ["Deadline"]
