"""Applying one version to the destination: the last stage of a pull, and where the others meet.

``apply`` reads version ``rec`` (whose slot's fence read ``fence`` along with it):

1. Plans and connects if the publisher epoch or the packing generations changed (``connect``).
2. Says "reading v" in the subscriber's state key, from before the first read until the reads are
   checked: publishers do not overwrite the slot meanwhile (sync and one-step-off modes).
3. Reads: as deltas onto the version held where it can (``delta``); through the zone's relays where
   the subscriber has a zone (``zone``); else every source's prepared batch, failing over to
   replicas when a source dies (``reads``, ``connect.failover``).
4. Verifies full pulls against the publishers' checksums where asked (delta pulls always verify),
   and reads the slot stamps after the data: they, not the untrusted store's fence, prove the slot
   did not change under the reads (``StaleVersionError`` otherwise; a delta pull that read nothing
   of the slots reads them with its last delta reads, ``PullResult.stamped``). A source that dies before its
   stamp confirmed what it sent (during a delta pull's repairs, say) is failed over: its replicas
   stand in and the version is read again in full.
5. Staged: copies the private buffer into the live tensors; then acks ``v`` in the state key.

The reads and checks of one try share its ``context.Attempt`` (the record, the session, the version
held before, the pull's deadline); a failover that connects a new session replaces it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import numpy as np

from .._deadline import Deadline
from .._lifecycle import quietly
from ..errors import IntegrityError, StaleVersionError, TransportError, UsageError
from ..protocol.state import state_bytes
from ..protocol.version import VersionRecord
from . import delta
from .connect import failover, setup
from .context import Attempt, Held, PullContext, PullResult
from .reads import check_stamps, prepare_sources, read_sources, verify_sources
from .session import SourcesFailed
from .zone import ZoneReader

log = logging.getLogger("wbridge")


def apply(ctx: PullContext, rec: VersionRecord, fence: int, deadline: Deadline, zone: ZoneReader | None) -> PullResult:
    """Reads ``rec`` into the destination (see the module docstring); ``zone``: the subscriber's
    zone reader, if it has a zone."""
    check_options(ctx, rec, zone)  # (the subscriber checks first: a refusal leaves the channel)
    session = ctx.session
    gens = rec.packing or (0,) * rec.world_size  # which packed layout each rank's slot holds
    reused = session is not None and (session.epoch, session.gens, session.incs) == (rec.epoch, gens, rec.incs)
    if not reused:
        session = setup(ctx, rec, gens, deadline)
    member = ctx.member
    state_key = ctx.keys.sub(member.id, "state")
    ctx.store.set(state_key, state_bytes(member.acked, rec.v))
    # the destination holds no whole version until we finish
    a, ctx.held = Attempt(rec, session, ctx.held, deadline), None
    try:
        if fence != rec.fence:
            raise StaleVersionError(f"version {rec.v} was overwritten before the read began")
        if not ctx.dest.staged:
            ctx.hold(None)  # the live tensors are about to hold a mix until we finish
        try:
            a, result = _read(ctx, a, zone)
        except TransportError as e:
            if not reused:
                raise
            # The publishers planned for are gone although the epoch is the same: a restarted
            # trainer in a store that lost its history (the same epoch numbers again). Their
            # records say where they are now; a full read (the destination may hold a mix).
            log.warning("subscriber %s: publishers of epoch %d gone (%s); planning again", ctx.name, rec.epoch, e)
            a = replace(a, session=setup(ctx, rec, gens, deadline), held=None)
            a, result = _read(ctx, a, zone)
        while True:
            try:
                _check(ctx, a, result)
                break
            except SourcesFailed as failed:
                # A source died after its data was read, before its stamp confirmed it (a delta
                # pull's repairs or stamps, say), or a zone reader read from relays only: its
                # replicas stand in, for a full read (through the zone's relays where it has one).
                a = replace(a, session=failover(ctx, a.session, failed, deadline), held=None)
                a, result = _read(ctx, a, zone)
                result = replace(result, reason="source-failed")
    except BaseException:
        # best effort, briefly even past the pull's deadline: keep the original error, and do
        # not leave a reading mark that would make publishers wait for this slot
        with ctx.store.deadline(time.monotonic() + 1.0):
            quietly(ctx.store.set, state_key, state_bytes(member.acked, 0))
        raise
    for dst, src in ctx.dest.commit:  # staged: every read succeeded, now commit
        if isinstance(dst, np.ndarray):
            np.copyto(dst, src)
        else:
            dst.copy_(src)
    ctx.hold(rec)
    member.acked = rec.v
    ctx.held = Held(rec.v, rec.epoch, gens, rec.incs)
    ctx.store.set(state_key, state_bytes(rec.v, 0))  # acked, and reading nothing
    return result


def check_options(ctx: PullContext, rec: VersionRecord, zone: ZoneReader | None) -> None:
    """``UsageError`` where what the subscriber asked for needs the publishers' checksums and they
    opted out of them (``Staging(checksums=False)``): ``verify=True``, and a zone (relays are
    peers, not authorities: their bytes are checked against the publishers' checksums)."""
    if rec.checksums:
        return
    fix = "drop checksums=False from the publishers' Staging()/ZeroCopy() (checksums are on by default)"
    if ctx.verify:
        raise UsageError(
            f"subscriber {ctx.name}: verify=True, but the publishers of channel {ctx.channel!r} keep no "
            f"checksums to verify against: {fix}, or subscribe with verify=False"
        )
    if zone is not None:
        raise UsageError(
            f"subscriber {ctx.name}: zone {zone.zone!r} reads through relays, whose bytes are checked "
            f"against the publishers' checksums, but the publishers of channel {ctx.channel!r} keep none: "
            f"{fix}, or subscribe without zone="
        )


def _check(ctx: PullContext, a: Attempt, result: PullResult) -> None:
    """The checks after the reads: the publishers' checksums (``verify``; a delta pull checked its
    own) and the slot stamps (where the reads did not read them last themselves); sources that
    stopped answering raise ``SourcesFailed``."""
    sources, rec = a.session.sources, a.rec
    if not result.delta and ctx.verify and rec.checksums:
        try:
            verify_sources(ctx, sources, rec, a.deadline)
        except IntegrityError:
            check_stamps(ctx, sources, rec.stamp, a.deadline)  # a slot reused under us is staleness
            raise
    if not result.stamped:
        check_stamps(ctx, sources, rec.stamp, a.deadline, failover=True)


def _read(ctx: PullContext, a: Attempt, zone: ZoneReader | None) -> tuple[Attempt, PullResult]:
    """The reads of ``a.rec``: deltas onto ``a.held`` where possible and cheaper, else through the
    zone, else from every source (failing over to replicas); the attempt (with a new session after
    a failover) and result, whose ``reason`` says why it was a delta or a full pull."""
    rec, choice = a.rec, delta.Choice(None, "zone")
    if zone is None:  # a zone's readers take deltas in ``zone`` (its relays pull them over the link)
        try:
            choice = delta.choose(ctx, a.session, rec, a.held, a.deadline)
        except IntegrityError:
            check_stamps(ctx, a.session.sources, rec.stamp, a.deadline)  # a slot reused under us is staleness
            raise
        except TransportError as e:  # a source died mid-pull: the full read below fails over
            log.warning("subscriber %s: delta pull of version %d failed (%s); pulling in full", ctx.name, rec.v, e)
            choice = delta.Choice(None, "source-failed")
        if choice.result is not None:
            return replace(a, session=ctx.session or a.session), choice.result
    if zone is not None:  # relays of the zone first (deltas over the link), publishers for the rest
        try:
            a, result = zone.read(a)
        except IntegrityError:  # (a relay checking its own range from the publishers)
            check_stamps(ctx, a.session.sources, rec.stamp, a.deadline)  # a slot reused under us is staleness
            raise
        return a, replace(result, reason="delta" if result.delta else "zone")
    while True:
        try:
            prepare_sources(ctx, a.session.sources, rec.slot)  # (not timed: once per slot and session)
            t0 = time.perf_counter()
            read_sources(ctx, a.session.sources, rec.slot, a.deadline)
            break
        except SourcesFailed as failed:  # a source died: its replicas stand in, if any
            a = replace(a, session=failover(ctx, a.session, failed, a.deadline))
    seconds = time.perf_counter() - t0  # what a full read costs on this link (deltas or full: ``delta.choose``)
    plan = a.session.plan
    ctx.costs.setdefault(delta.link(a.session), delta.LinkCost()).full_read(plan.total_bytes, seconds)
    # (a declined delta pull's headers and tables were read too)
    nbytes, ops = plan.total_bytes + choice.nbytes, len(plan) + choice.ops
    return a, PullResult(nbytes, 0, ops, reason=choice.reason)


__all__ = ["apply", "check_options"]
