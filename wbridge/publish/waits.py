"""What each sync mode waits for around a snapshot: the acks of earlier versions, readers off the slot.

Before the snapshot of ``v`` (``before_snapshot``): ``one_step_off`` waits until every live
subscriber acked ``v - 1``, ``Async(max_staleness=k)`` until they acked ``v - k``; then every mode
but async (whose readers get ``StaleVersionError`` instead) and zero copy waits until no live
subscriber reads the slot ``v`` overwrites. After the commit (``after_commit``), ``sync`` and zero
copy wait for the acks of ``v`` itself. Each wait is a ``SubscriberTracker.wait`` on its condition's
key (``Keys.acked``, ``Keys.free``: rank 0 scans, the other ranks block on the key); ``close()``
cuts it short (``stopped`` raises).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .. import _validate
from .._deadline import Deadline
from ..errors import StoreError, UsageError, WaitTimeout
from ..store import Store
from .tracker import SubscriberTracker, SubscriberView


@dataclass(frozen=True)
class SyncWaits:
    """The waits of one publisher rank.

    - ``tracker``: the subscribers' progress, in the store generation registered in.
    - ``who``: the rank in messages (``"publisher rank 0"``).
    - ``mode``, ``max_staleness``: the sync mode (``wbridge.options.mode_of``).
    - ``nslots``: staging slots versions rotate through.
    - ``zero_copy``: the slots are the live tensors (``ZeroCopy``).
    - ``stopped``: raises ``UsageError`` once the publisher closed (``InFlight.check_stopped``).
    """

    tracker: SubscriberTracker
    who: str
    mode: str
    max_staleness: int
    nslots: int
    zero_copy: bool
    stopped: Callable[[], None]

    def before_snapshot(self, v: int, deadline: Deadline) -> None:
        """Waits as the mode says before version ``v`` is copied into its slot."""
        if self.mode == "one_step_off" and v > 1:
            self.acked(v - 1, deadline, f"{self.who}: acks of version {v - 1} before publishing {v}")
        elif self.mode == "async" and v - self.max_staleness > 0:
            what = f"{self.who}: subscribers within {self.max_staleness} versions of {v}"
            self.acked(v - self.max_staleness, deadline, what)
        if self.mode != "async" and not self.zero_copy:
            # Do not pull a slot from under a reader; async readers get StaleVersionError instead.
            slot = v % self.nslots

            def free(s: SubscriberView) -> bool:
                r = s.reading
                return r <= 0 or r % self.nslots != slot or r >= v

            self.until(self.tracker.keys.free(v), free, deadline, f"{self.who}: readers of slot {slot}")

    def after_commit(self, v: int, deadline: Deadline) -> None:
        """``sync`` (and zero copy, whose slot is the live tensors): waits for the acks of ``v``."""
        if self.mode == "sync" or self.zero_copy:
            self.acked(v, deadline, f"{self.who}: acks of version {v}")

    def acked(self, version: int, deadline: Deadline, what: str) -> None:
        """Waits until every live subscriber acked ``version`` or later."""
        self.until(self.tracker.keys.acked(version), lambda s: s.acked >= version, deadline, what)

    def until(self, key: str, pred: Callable[[SubscriberView], bool], deadline: Deadline, what: str) -> None:
        """Waits until ``pred`` holds for every live subscriber (``key`` says so once it does, see
        ``wbridge.publish.tracker``); ``WaitTimeout`` names ``what``."""
        self.stopped()
        deadline.check(f"timed out waiting for {what}")
        try:
            self.tracker.wait(key, pred, deadline, what, self.stopped)
        except WaitTimeout as e:  # also the store's, when the deadline passed inside a call
            raise WaitTimeout(f"timed out waiting for {what}") from e

    def live(self, n: int, timeout: float) -> int:
        """Waits until at least ``n`` subscribers are live; returns how many are
        (``Publisher.wait_for_subscribers``: ``UsageError`` for a bad ``n`` or ``timeout``)."""
        if type(n) is not int or n < 0:  # noqa: E721 - bool is no count
            raise UsageError(f"{self.who}: wait_for_subscribers(n) needs an int >= 0, got {n!r}")
        timeout = _validate.timeout(timeout, "wait_for_subscribers() timeout")
        seen = [0]

        def probe() -> int | None:
            self.stopped()
            try:
                seen[0] = len(self.tracker.live())
            except StoreError:  # the store down for a while: polled again until the deadline
                return None
            return seen[0] if seen[0] >= n else None

        try:
            # every store call of the wait (reconnects included) ends by the caller's deadline
            with self.tracker.store.deadline(Deadline.after(timeout).at):
                return Store.wait_until(probe, timeout, f"{n} live subscribers", poll=0.005, max_poll=0.1)
        except WaitTimeout:
            raise WaitTimeout(
                f"{self.who} of channel {self.tracker.keys.channel!r}: {seen[0]} of {n} subscribers "
                f"live after {timeout:.1f}s"
            ) from None


__all__ = ["SyncWaits"]
