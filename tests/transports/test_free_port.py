"""``free_port`` picks below the kernel's ephemeral range, where no outgoing connection or port-0
listener of another process takes the port before the caller binds it."""

from __future__ import annotations

import socket

from transports._util import _LOWEST_PICKED, _ephemeral_low, free_port


def test_free_ports_lie_below_the_ephemeral_range_and_can_be_bound() -> None:
    low = _ephemeral_low()
    ports = {free_port() for _ in range(20)}
    if low >= 2 * _LOWEST_PICKED:
        assert all(_LOWEST_PICKED <= p < low for p in ports), (low, ports)
    assert len(ports) > 1  # random per call
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports.pop()))
