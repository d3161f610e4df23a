"""The delta-or-full choice on its own (``wbridge.pull.delta_cost``): ``LinkCost`` keeps the least
of recent measurements, and the choice probes first, declines deltas estimated slower (before the
tables where they look much slower, after them on their exact sizes), declines deltas that read
more bytes than a full read whatever the times, and probes again after ``PROBE_EVERY`` declines."""

from __future__ import annotations

from wbridge.pull.delta_cost import (
    PROBE_EVERY,
    PROBES,
    WINDOW,
    DeltaPull,
    LinkCost,
    Timed,
    after_tables,
    before_tables,
)

FULL = 1_000_000  # bytes of a full read


def measured(cost: LinkCost, full_s: float, delta_reads_s: float, pairs: int = 1000, nbytes: int = 2000) -> None:
    """A full read of ``FULL`` bytes in ``full_s``, then a delta pull whose reads took ``delta_reads_s``."""
    cost.full_read(FULL, full_s)
    cost.delta_pull(DeltaPull(pairs, nbytes, 1, Timed(nbytes, delta_reads_s), Timed(pairs, 1e-4), Timed(FULL, 1e-4)))


def test_link_cost_keeps_the_least_of_its_latest_measurements() -> None:
    cost = LinkCost()
    assert cost.estimate(10, 10, 10) is None  # nothing measured yet
    cost.full_read(FULL, 0.010)
    cost.full_read(FULL, 0.500)  # one slow read (a descheduled process) does not count
    assert cost.full == 0.010 / FULL
    for _ in range(WINDOW):
        cost.full_read(FULL, 0.020)  # the link really got slower: it shows within WINDOW reads
    assert cost.full == 0.020 / FULL
    measured(cost, 0.020, 0.003, pairs=1000, nbytes=2000)
    assert abs(cost.waits - (0.003 - 2000 * cost.full)) < 1e-12
    assert cost.pairs == 1000 and cost.nbytes == 2000 and cost.probes == 1
    est = cost.estimate(2000, 4000, FULL)
    assert abs(est - (cost.waits + 4000 * cost.full + 2000 * cost.cpu + FULL * cost.check)) < 1e-12


def test_deltas_are_probed_then_declined_where_slower() -> None:
    cost = LinkCost()
    cost.full_read(FULL, 0.001)  # a fast full read: 1 ms
    for _ in range(PROBES):  # probes: taken whatever they are guessed to cost
        g = before_tables(cost, 1, FULL, verify=False)
        assert g.probe and not g.declined
        assert after_tables(cost, g, 1000, 2000, 0, 1, FULL) is None
        measured(cost, 0.001, 0.050)  # each delta pull's reads took 50 ms: round trips
    # the next guess is far slower than a full read (more than SKIP_MARGIN): declined before the tables
    g = before_tables(cost, 1, FULL, verify=False)
    assert g.declined and not g.probe and cost.declined == 1


def test_deltas_a_little_slower_are_declined_on_the_exact_sizes_then_by_guess() -> None:
    cost = LinkCost()
    for _ in range(PROBES):
        measured(cost, 0.010, 0.012)  # deltas 20 % slower than the 10 ms full read
    g = before_tables(cost, 1, FULL, verify=False)
    assert not g.declined and not g.probe  # within SKIP_MARGIN: the tables are read
    assert after_tables(cost, g, 1000, 2000, 0, 1, FULL) == "cost"  # the exact estimate is slower
    assert cost.sure and cost.declined == 1
    assert before_tables(cost, 1, FULL, verify=False).declined  # sure: no tables read next time


def test_faster_deltas_are_taken() -> None:
    cost = LinkCost()
    for _ in range(PROBES + 3):
        measured(cost, 0.080, 0.002)  # a slow link: the full read takes 80 ms, the deltas 2
        g = before_tables(cost, 1, FULL, verify=True)
        assert not g.declined
        assert after_tables(cost, g, 1000, 2000, 0, 1, FULL) is None


def test_more_bytes_than_a_full_read_is_declined_whatever_the_times() -> None:
    assert after_tables(None, None, 10, FULL - 10, 10, 1, FULL) == "cost"  # (relays: no cost kept)
    assert after_tables(None, None, 10, FULL - 11, 10, 1, FULL) is None
    cost = LinkCost()
    g = before_tables(cost, 1, FULL, verify=False)
    assert g.probe and after_tables(cost, g, 10, FULL, 0, 1, FULL) == "cost"  # even a probe


def test_a_probe_every_probe_every_declines() -> None:
    cost = LinkCost()
    for _ in range(PROBES):
        measured(cost, 0.001, 0.050)
    for _ in range(PROBE_EVERY):
        assert before_tables(cost, 1, FULL, verify=False).declined
    g = before_tables(cost, 1, FULL, verify=False)
    assert g.probe and not g.declined  # costs drift: try the deltas again
    measured(cost, 0.001, 0.050)
    assert cost.declined == 0 and before_tables(cost, 1, FULL, verify=False).declined
