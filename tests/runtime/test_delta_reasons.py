"""Every ``delta_reason`` a pull can report (``wbridge.pull.delta_cost.DELTA_REASONS``), each from
the situation that produces it, with every pull bit-exact. The reasons covered elsewhere:
``cost``, ``too-far-behind`` and ``header-changed`` (``test_delta.py``), ``new-layout``
(``test_delta_layouts.py``), ``source-failed`` (``tests/faults/test_delta_failover.py``), ``zone``
(``test_zone_deltas.py``); ``delta`` and ``no-base`` everywhere."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest

from wbridge import Delta, Staging
from wbridge.protocol.delta import HEADER_BYTES

from .delta_actors import DeltaPub, DeltaSub
from .harness import Worker, free_port

FRAC = 0.02

pytestmark = pytest.mark.timeout(150)


def pulls(pub: Worker, sub: Worker, versions: range, frac: float = FRAC) -> list[dict]:
    """Publishes each version (``frac`` of the elements changed) and pulls it; checks every byte."""
    out, steps = [], [(v, frac) for v in range(2, versions.start)]
    for v in versions:
        steps.append((v, frac))
        assert pub.call("step", v, frac) == v
        got = sub.call("pull", min_version=v)
        assert got["v"] == v and got["delta"] == (got["why"] == "delta"), got
        assert sub.call("bad", steps) == [], (v, got)
        out.append(got)
    return out


def first_pull(pub: Worker, sub: Worker) -> dict:
    pub.call("publish")
    got = sub.call("pull", min_version=1)
    assert got["v"] == 1 and not got["delta"] and got["why"] == "no-base", got
    return got


@contextlib.contextmanager
def channel(staging: Staging | None, **sub_options: Any) -> Iterator[tuple[Worker, Worker]]:
    """A publisher (with ``staging``, or the default) and a subscriber (``sub_options``) over tcp
    on a store of their own, after the first pull; both stopped at the end."""
    url = f"tcp://127.0.0.1:{free_port()}"
    pub = Worker("pub", DeltaPub, url, transport="tcp", **({} if staging is None else {"staging": staging}))
    sub = Worker("sub", DeltaSub, url, transport="tcp", **sub_options)
    try:
        first_pull(pub, sub)
        yield pub, sub
    finally:
        sub.stop()
        pub.stop()


def test_a_publisher_without_deltas_says_so() -> None:
    with channel(None) as (pub, sub):
        assert [g["why"] for g in pulls(pub, sub, range(2, 4))] == ["publisher-no-delta"] * 2


def test_a_version_with_too_many_changes_has_no_delta() -> None:
    """Every element rewritten with a random value: more than a delta buffer holds (half the
    slot), so the version has none; the next sparse change has one again."""
    with channel(Staging(delta=Delta())) as (pub, sub):
        steps = [(2, 1.0)]
        pub.call("step", 2, 1.0)
        got = sub.call("pull", min_version=2)
        assert got["why"] == "no-delta" and sub.call("bad", steps) == [], got
        steps.append((3, FRAC))
        pub.call("step", 3, FRAC)
        got = sub.call("pull", min_version=3)
        assert got["why"] == "delta" and sub.call("bad", steps) == [], got


def test_publishers_registered_again_start_a_new_epoch() -> None:
    with channel(Staging(delta=Delta())) as (pub, sub):
        pub.call("register_again")
        assert [g["why"] for g in pulls(pub, sub, range(2, 4))] == ["new-epoch", "delta"]


def test_a_malformed_table_is_not_decoded() -> None:
    """A bit flipped in the tables of the first delta pull (its second read: the header, then the
    table entries) makes them decrease: no write, a full pull instead; the next pull takes deltas
    again."""
    # the top byte of the second chunk's first pair (uint32 table entry 1): 2**24 more pairs
    fault = ("flip-bit", {"on_reads": (2,), "min_bytes": 64, "at": HEADER_BYTES + 7})
    with channel(Staging(delta=Delta()), fault=fault) as (pub, sub):
        assert [g["why"] for g in pulls(pub, sub, range(2, 4))] == ["malformed", "delta"]


def test_a_plan_that_reads_a_byte_twice_takes_no_deltas() -> None:
    """One tensor registered twice: the plan reads its slot bytes into two destinations."""
    with channel(Staging(delta=Delta()), twice=True) as (pub, sub):
        assert [g["why"] for g in pulls(pub, sub, range(2, 4))] == ["unsupported-plan"] * 2
