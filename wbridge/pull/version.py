"""Which version a pull reads: the newest committed record, waited for on its ``ready`` key.

A pull blocks on the ``ready`` key of the version it needs next (a TCPStore wait, an etcd watch),
not polling; that key holds the version's record, so a wait needs no further read. It never goes
back: a store replaying an older (genuinely signed) version record must not roll a subscriber back
to stale weights. The one exception is a record of an epoch before the one of the newest version
seen (held or not): epochs never go back in one store history, so the store lost it (an old
generation record put back, a backup restored) and counts from 1 again; what was known is dropped,
the caller's ``min_version`` too (it counted the lost history: waiting for it there would hold Async
publishers back on this subscriber's ack), and a replayed record of an old epoch gains nothing: its
slot stamps, read from the publishers, no longer say its version.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from .._deadline import Deadline
from ..errors import StoreError, UsageError, WaitTimeout
from ..options import MAX_SLOTS
from ..protocol.version import VersionRecord
from .context import PullContext

log = logging.getLogger("wbridge")

# A pull waiting for a version blocks on its ``ready`` key in slices this long, re-reading the version
# record in between (a zero-copy version fenced off, or a key collected before the wait began: that
# takes slots + 2 commits within one round trip).
VERSION_WAIT_SLICE_S = 30.0


def lost_history(ctx: PullContext, rec: VersionRecord | None) -> str:
    """Why version record ``rec`` shows that the store lost the history the subscriber knows although
    its generation record is the same (an old one put back, a backup restored), or "" where it does
    not. Epochs never go back in one store history, and one epoch's publishers never change their
    incarnations (registering again starts a new epoch): a record of an earlier epoch, or of the
    epoch seen last with other incarnations (a trainer restarted at the same epoch number), comes
    from a history that counts versions and epochs from 1 again."""
    if rec is None:
        return ""
    known_epoch = max(ctx.newest_epoch, ctx.identity[1] if ctx.identity is not None else 0)
    if rec.epoch < known_epoch:
        return f"is at epoch {rec.epoch}, before the {known_epoch} of a version seen"
    if rec.epoch == ctx.newest_epoch and ctx.newest_incs and rec.incs and rec.incs != ctx.newest_incs:
        return f"has epoch {rec.epoch} published by other trainer incarnations than a version seen"
    return ""


class GenerationChanged(Exception):
    """Internal: the store was found in a new generation while waiting; wait again there."""


def next_version(
    ctx: PullContext,
    want: int,
    deadline: Deadline,
    known: list | None,
    check_membership: Callable[[], list | None],
) -> tuple[VersionRecord, int]:
    """The newest version record (at least ``want``) and its slot's fence (``known``: the values of
    ``VersionRecord.keys_with_fence`` read already). ``check_membership()`` re-checks the
    subscriber's place in the channel when no record is found (None: it changed, and
    ``GenerationChanged`` is raised)."""
    want = max(want, ctx.newest)
    ready: VersionRecord | None = None  # the record in the ready key a wait returned
    while True:
        if ready is not None and not ready.zero_copy:  # (zero-copy: readable only while its publish() runs)
            rec, fence = ready, ready.fence
        else:
            rec, fence = VersionRecord.read_with_fence(ctx.member.chan, ctx.nslots, known)
        known = ready = None
        why = lost_history(ctx, rec)
        if why:
            log.warning(
                "subscriber %s: channel %r %s: the store lost its history; reading its versions afresh",
                ctx.name,
                ctx.channel,
                why,
            )
            ctx.forget()
            want = 1  # the caller's floor counted versions of the lost history
        if rec is None and check_membership() is None:
            raise GenerationChanged
        if rec is not None and rec.slot >= ctx.nslots:
            ctx.nslots = min(rec.slot + 1, MAX_SLOTS)
        if rec is not None and rec.v >= want:
            # zero-copy versions are readable only while their publish() runs
            if ctx.holds(rec) or not rec.zero_copy or fence == rec.fence:
                ctx.see(rec)
                return rec, fence
        elif rec is not None and rec.mode == "sync" and not ctx.holds(rec) and ctx.member.lease is not None:
            raise UsageError(
                f"subscriber {ctx.name}: channel {ctx.channel!r} is in sync mode and version {rec.v} "
                f"waits for this subscriber's ack, so version {want} cannot come until it pulls "
                f"{rec.v}: call pull() without min_version (or min_version={rec.v}) first"
            )
        left = deadline.check(
            f"subscriber {ctx.name}: no version >= {want} on channel "
            f"{ctx.channel!r} within {deadline.seconds:.1f}s (is a publisher running?)"
        )
        nxt = want if rec is None or rec.v < want else rec.v + 1
        try:
            raw = ctx.store.wait(ctx.keys.ready(nxt), min(left, VERSION_WAIT_SLICE_S))
        except (WaitTimeout, StoreError):
            continue  # a store down for the slice: the next read retries it within its own timeout
        ready = VersionRecord.parse_ready(ctx.member.chan, nxt, raw)


__all__ = ["VERSION_WAIT_SLICE_S", "GenerationChanged", "lost_history", "next_version"]
