"""Coverage-guided fuzzing of the tcp server's connection handler with atheris (libFuzzer).

Run: ``PYTHONPATH=. python tests/transports/fuzz_tcp_atheris.py -runs=2000 [corpus dir]``; an empty
or missing corpus directory is first seeded with a few well-formed streams. Each input is a byte
stream sent to ``serve_connection`` over a socket pair, before or after a valid handshake (first
byte). The run fails if the handler hangs, hits an internal error, sends anything before the
handshake but CHALLENGE/ERROR, or answers differently from the reference model after it.
"""

from __future__ import annotations

import os
import socket
import sys
import threading

import atheris
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import transports.base  # noqa: E402,F401 - imported (with numpy) before instrumenting: only the wire code is

with atheris.instrument_imports():
    from transports import _auth, _regions, _wire, tcp

from tests.transports.wire_model import (
    CHALLENGE,
    DATA,
    ERROR,
    client_handshake,
    exchange,  # noqa: E402
    expected_replies,
    parse_replies,
)

KEY, INSTANCE = b"atheris-token", b"\1" * 16
ARRAYS = {1: np.arange(300, dtype=np.uint8), 2: np.arange(7, dtype=np.uint8) * 3}
TABLE = _regions.RegionTable("tcp")
for rid, arr in ARRAYS.items():
    TABLE.add(rid, _regions.Served(arr.nbytes, arr.ctypes.data, memoryview(arr)))
REGIONS = {rid: arr.tobytes() for rid, arr in ARRAYS.items()}
CFG = tcp.ServerConfig(KEY, INSTANCE, TABLE, handshake_timeout=2.0, frame_timeout=1.0)


def one_input(data: bytes) -> None:
    authed, stream = bool(data[:1]) and data[0] & 1, data[1:]
    client, server = socket.socketpair()
    why: list[str] = []
    th = threading.Thread(target=lambda: why.append(tcp.serve_connection(server, CFG)), daemon=True)
    th.start()
    try:
        if authed:
            client_handshake(client, KEY, INSTANCE)
        got = parse_replies(exchange(client, stream))
    finally:
        client.close()
    th.join(5)
    if th.is_alive():
        raise RuntimeError(f"server hung on {data!r}")
    if why[0].startswith("internal error"):
        raise RuntimeError(f"server bug on {data!r}: {why[0]}")
    kinds = [k for k, _ in got]
    if not authed:
        if not set(kinds) <= {CHALLENGE, ERROR} or kinds.count(CHALLENGE) > 1:
            raise RuntimeError(f"before the handshake the server sent {kinds}")
        return
    want = expected_replies(stream, REGIONS)
    if kinds != [k for k, _ in want] or any(k == DATA and p != q for (k, p), (_, q) in zip(got, want)):
        raise RuntimeError(f"server replied {got!r}, the model says {want!r}")


def seed_corpus(directory: str) -> None:
    """Well-formed starting points: valid reads, an out-of-region read, a truncated frame."""
    from tests.transports.wire_model import read_frame

    seeds = [
        read_frame([(1, 0, 10)]),
        read_frame([(2, 3, 4), (1, 299, 1)]),
        read_frame([(2, 0, 8)]),
        read_frame([(3, 0, 1)]),
        read_frame([(1, 5, 5)])[:20],
    ]
    os.makedirs(directory, exist_ok=True)
    for i, seed in enumerate(seeds):
        with open(os.path.join(directory, f"seed{i}"), "wb") as f:
            f.write(b"\1" + seed)


if __name__ == "__main__":
    assert _wire.MAX_ENTRIES and _auth.NONCE_BYTES and _regions.Served  # instrumented imports, in use
    for arg in sys.argv[1:]:
        if not arg.startswith("-") and not (os.path.isdir(arg) and os.listdir(arg)):
            seed_corpus(arg)
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()
