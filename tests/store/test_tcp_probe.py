"""The probe behind a lost store connection's message (``wbridge.store.tcp._gone``): a store host
being killed closes its sockets one by one, and until its listening socket closes the kernel still
completes new connections to it, then resets them. The message must say the host is gone, not that
it still accepts connections."""

from __future__ import annotations

import socket
import threading

import pytest

from wbridge.store.tcp import _gone


@pytest.mark.timeout(30)
def test_a_listener_closing_under_the_probe_is_a_host_gone() -> None:
    listener = socket.create_server(("127.0.0.1", 0))  # accepts nothing: what a dying process does
    port = listener.getsockname()[1]
    closer = threading.Timer(0.1, listener.close)  # the probe's connection is in its queue by then
    closer.start()
    try:
        said = _gone(f"tcp://127.0.0.1:{port}", "127.0.0.1", port, "closed")
    finally:
        closer.join()
    assert said.startswith(f"store host tcp://127.0.0.1:{port} is gone"), said


@pytest.mark.timeout(30)
def test_a_listener_that_stays_is_a_dropped_connection() -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        said = _gone(f"tcp://127.0.0.1:{port}", "127.0.0.1", port, "closed")
    assert "dropped this client's connection" in said and "although it accepts new ones" in said, said
