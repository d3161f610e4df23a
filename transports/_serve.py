"""A serving process for tests and benchmarks: one transport, regions of known bytes, line commands.

Run as ``python -m transports._serve '<json spec>'``; the spec is
``{"transport": name, "token": str|null, "options": {...}, "regions": [{"size": n, "seed": s}, ...],
"fill": "random"|"pattern", "dumpable": bool}``. The process registers every region (staged into ``host_buffer`` when
the transport offers one), then writes one JSON line to stdout::

    {"pid": ..., "endpoint": hex, "descriptors": [hex, ...]}

and answers one JSON line per command line on stdin (replies carry ``"ok": true`` or ``"error"``):

- ``{"op": "stats"}``: open fds, live threads, regions and connections of the transport;
- ``{"op": "register", "size": n, "seed": s}``: one more region; replies with its descriptor;
- ``{"op": "deregister", "index": i}``: stops serving region ``i``;
- ``{"op": "call", "method": m, "kwargs": {...}}``: calls ``transport.m(**kwargs)`` in a thread
  (for two-sided transports that must take part in a read); the reply comes when it returns;
- ``{"op": "stop"}`` (or EOF on stdin): closes the transport and exits with status 0.

Region ``i`` holds ``region_bytes(size, seed)``, so a reader can check every byte it got.
Library output goes to stderr; stdout carries only the protocol.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from typing import Any

import numpy as np

import transports

#: Period of the "pattern" fill: a prime, so a block landing at a wrong 4 KiB-multiple offset shows.
PATTERN_PERIOD = 1_048_573


def fill_region(arr: np.ndarray, seed: int, fill: str = "random") -> None:
    """Writes the content of a served region into ``arr`` (uint8), reproducibly from ``seed``.

    ``random``: independent random bytes. ``pattern``: a random block of ``PATTERN_PERIOD`` bytes
    repeated, cheap enough for GiB-sized benchmark regions.
    """
    rng = np.random.default_rng(seed)
    if fill == "random":
        arr[:] = rng.integers(0, 256, len(arr), dtype=np.uint8)
        return
    if fill != "pattern":
        raise ValueError(f"unknown fill {fill!r}")
    tile = np.tile(rng.integers(0, 256, PATTERN_PERIOD, dtype=np.uint8), 64)
    for start in range(0, len(arr), len(tile)):
        chunk = arr[start : start + len(tile)]
        chunk[:] = tile[: len(chunk)]


def check_region(arr: np.ndarray, seed: int, fill: str = "random") -> bool:
    """Whether ``arr`` holds exactly the bytes of the region made from ``seed`` (checked in chunks)."""
    if fill == "random":
        return bool(np.array_equal(arr, region_bytes(len(arr), seed)))
    period = region_bytes(PATTERN_PERIOD, seed)  # the block fill_region tiles
    step = PATTERN_PERIOD * 64
    for start in range(0, len(arr), step):
        chunk = arr[start : start + step]
        if not np.array_equal(chunk, np.resize(period, len(chunk))):
            return False
    return True


def region_bytes(size: int, seed: int, fill: str = "random") -> np.ndarray:
    """The bytes of a served region of ``size`` bytes made from ``seed``."""
    arr = np.empty(size, dtype=np.uint8)
    fill_region(arr, seed, fill)
    return arr


def _stats(transport: Any, regions: dict) -> dict:
    return {
        "fds": len(os.listdir("/proc/self/fd")),
        "threads": threading.active_count(),
        "regions": getattr(transport, "num_regions", len(regions)),
        "connections": getattr(transport, "num_connections", None),
    }


def serve(spec: dict) -> int:
    if not spec.get("dumpable", True):  # tests: a process others may not inspect without CAP_SYS_PTRACE
        import ctypes

        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE = 4
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # keep stray prints off the protocol channel
    fill = spec.get("fill", "random")
    t = transports.get(spec["transport"])(token=spec.get("token") and spec["token"].encode(), **spec.get("options", {}))
    buffers: dict[int, Any] = {}
    regions: dict[int, Any] = {}

    def add(size: int, seed: int) -> str:
        raw = t.host_buffer(size)
        arr = np.frombuffer(raw, dtype=np.uint8, count=size) if raw is not None else np.empty(size, np.uint8)
        fill_region(arr, seed, fill)
        i = len(buffers)
        buffers[i] = (raw, arr)
        regions[i] = t.register(arr.ctypes.data, size)
        return regions[i].descriptor.hex()

    descs = [add(r["size"], r["seed"]) for r in spec.get("regions", [])]
    out.write(json.dumps({"pid": os.getpid(), "endpoint": t.endpoint().hex(), "descriptors": descs}) + "\n")
    lock = threading.Lock()

    def reply(msg: dict) -> None:
        with lock:
            out.write(json.dumps(msg) + "\n")

    def call(method: str, kwargs: dict) -> None:
        try:
            reply({"ok": True, "result": repr(getattr(t, method)(**kwargs))})
        except Exception as e:  # noqa: BLE001 - reported to the driver
            reply({"error": repr(e)})

    try:
        for line in sys.stdin:
            cmd = json.loads(line)
            op = cmd.get("op")
            try:
                if op == "stop":
                    break
                if op == "stats":
                    reply({"ok": True, **_stats(t, regions)})
                elif op == "register":
                    reply({"ok": True, "descriptor": add(cmd["size"], cmd["seed"])})
                elif op == "deregister":
                    t.deregister(regions.pop(cmd["index"]))
                    reply({"ok": True})
                elif op == "call":
                    threading.Thread(target=call, args=(cmd["method"], cmd.get("kwargs", {})), daemon=True).start()
                else:
                    reply({"error": f"unknown op {op!r}"})
            except Exception as e:  # noqa: BLE001
                reply({"error": repr(e)})
    finally:
        t.close()
    reply({"ok": True, "stopped": True})
    return 0


class ServingProcess:
    """Starts ``python -m transports._serve`` and speaks its line protocol; a context manager.

    ``timeout`` bounds every exchange (start-up included): a silent process is an error, not a hang.
    """

    def __init__(
        self,
        transport: str,
        regions: list[dict],
        *,
        token: str | None = "secret",
        options: dict | None = None,
        fill: str = "random",
        timeout: float = 60.0,
        dumpable: bool = True,
    ) -> None:
        self.spec = {
            "transport": transport,
            "token": token,
            "options": dict(options or {}),
            "regions": regions,
            "fill": fill,
            "dumpable": dumpable,
        }
        self.timeout = timeout
        # The child imports this very copy of the package (a checkout or an installed one): its parent
        # folder goes first on the child's PYTHONPATH.
        root = os.path.dirname(os.path.dirname(os.path.abspath(transports.__file__)))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "transports._serve", json.dumps(self.spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        hello = self._line()
        self.pid: int = hello["pid"]
        self.endpoint: bytes = bytes.fromhex(hello["endpoint"])
        self.descriptors: list[bytes] = [bytes.fromhex(d) for d in hello["descriptors"]]

    def _line(self) -> dict:
        result: list[str] = []
        reader = threading.Thread(target=lambda: result.append(self.proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(self.timeout)
        if not result or not result[0]:
            self.kill()
            raise RuntimeError(
                f"serving process {self.proc.pid} gave no reply within {self.timeout}s (exit status {self.proc.poll()})"
            )
        return json.loads(result[0])

    def command(self, **cmd: Any) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        msg = self._line()
        if "error" in msg:
            raise RuntimeError(f"serving process: {cmd.get('op')} failed: {msg['error']}")
        return msg

    def post(self, **cmd: Any) -> None:
        """Sends a command without waiting for its reply (collect it later with ``reply()``)."""
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def reply(self) -> dict:
        return self._line()

    def stop(self) -> int:
        """Asks the process to close its transport and exit; returns its exit status."""
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "stop"}) + "\n")
                self.proc.stdin.close()
            except (BrokenPipeError, ValueError):
                pass
            try:
                return self.proc.wait(self.timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.wait(self.timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(self.timeout)

    def __enter__(self) -> ServingProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.stop()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except (OSError, ValueError):
                pass

    def __repr__(self) -> str:
        return f"ServingProcess({self.spec['transport']}, pid={self.proc.pid}, status={self.proc.poll()})"


if __name__ == "__main__":
    sys.exit(serve(json.loads(sys.argv[1])))
