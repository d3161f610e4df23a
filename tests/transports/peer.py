"""Serving and reading processes for transport tests; reusable by any test that needs a real peer.

``Peer(transport, regions=[{"size": n, "seed": s}, ...], token="secret", options={...})`` starts a
separate OS process (``python -m transports._serve``) that registers regions holding
``region_bytes(size, seed)`` and serves them; see ``transports._serve`` for its line commands
(``stats``, ``register``, ``deregister``, ``call``, ``stop``). ``peer.stop()`` returns its exit status.

``run_client(...)`` runs a whole reading side in another OS process (``python tests/transports/peer.py
client '<json>'``): connect, read every region whole, check every byte, close; it exits with status 0
only if all of that worked. With ``refuse=[row, ...]`` it first posts each row as a batch of its own,
each of which must end in ``TransportError`` (a row that is read is status 1; a crash is a signal).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from transports._serve import ServingProcess as Peer  # noqa: E402
from transports._serve import check_region, region_bytes  # noqa: E402

__all__ = ["Peer", "check_region", "region_bytes", "run_client"]


def run_client(
    transport: str,
    endpoint: bytes,
    descriptors: list[bytes],
    regions: list[dict],
    *,
    token: str | None = "secret",
    options: dict | None = None,
    timeout: float = 60.0,
    wrap: list[str] | None = None,
    refuse: list[tuple[int, int, int, int, int]] | None = None,
) -> subprocess.CompletedProcess:
    """Reads every region of a peer from a fresh process; returns the finished process (check returncode).

    ``wrap`` prefixes the command (``["setpriv", "--bounding-set=-sys_ptrace", ...]``, say);
    ``refuse``: batch rows ``(src_region, src_offset, dst_region, dst_offset, nbytes)`` posted first,
    each alone, that must be refused with ``TransportError``.
    """
    spec = {
        "transport": transport,
        "endpoint": endpoint.hex(),
        "descriptors": [d.hex() for d in descriptors],
        "regions": regions,
        "token": token,
        "options": options or {},
        "timeout": timeout,
        "refuse": [list(map(int, row)) for row in refuse or []],
    }
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run(
        [*(wrap or []), sys.executable, os.path.abspath(__file__), "client", json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=timeout + 30,
        env=env,
        cwd=ROOT,
    )


def _client(spec: dict) -> int:
    import numpy as np

    import transports
    from transports.base import ReadBatch

    sizes = [r["size"] for r in spec["regions"]]
    dst = np.empty(sum(sizes), dtype=np.uint8)
    dst.fill(0x5A)
    starts = np.cumsum([0] + sizes[:-1])
    token = spec["token"].encode() if spec["token"] else None
    with transports.get(spec["transport"])(token=token, **spec["options"]) as t:
        local = t.register(dst.ctypes.data, dst.nbytes)
        peer = t.connect(bytes.fromhex(spec["endpoint"]), timeout=spec["timeout"])
        for row in spec.get("refuse", []):
            try:
                hostile = t.prepare(peer, [bytes.fromhex(d) for d in spec["descriptors"]], [local], ReadBatch.of([row]))
                t.read(hostile, timeout=spec["timeout"])
            except transports.TransportError as e:
                print(f"hostile row refused {row}: {e}", file=sys.stderr)
                continue
            print(f"read {row}: not refused", file=sys.stderr)
            return 1
        batch = ReadBatch(np.arange(len(sizes)), np.zeros(len(sizes)), np.zeros(len(sizes)), starts, sizes)
        prep = t.prepare(peer, [bytes.fromhex(d) for d in spec["descriptors"]], [local], batch)
        t.read(prep, timeout=spec["timeout"])
        for r, start in zip(spec["regions"], starts):
            if not check_region(dst[start : start + r["size"]], r["seed"]):
                print(f"region with seed {r['seed']} differs", file=sys.stderr)
                return 1
        t.release(prep)
        t.disconnect(peer)
        t.deregister(local)
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "client":
        sys.exit(_client(json.loads(sys.argv[2])))
    sys.exit("usage: peer.py client '<json spec>'")
