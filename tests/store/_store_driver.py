"""A store client (or tcp:// host) driven by JSON lines on stdin, for tests across namespaces.

    python -m tests.store._store_driver open URL CONNECT_TIMEOUT
    python -m tests.store._store_driver host ADDR CONNECT_TIMEOUT     (hosts a TcpStore on ADDR)

Prints {"ready": url} first, then answers each request {"op": ..., "key": ..., ...} with
{"ok": true, "value": <hex or null>, "took": seconds} or {"ok": false, "error": class name,
"msg": text, "took": seconds}. EOF on stdin closes the store and exits.
"""

from __future__ import annotations

import json
import sys
import time

from wbridge.store import TcpStore, open_store


def _hex(v):
    return None if v is None else (v.hex() if isinstance(v, bytes) else v)


def serve(store) -> None:
    print(json.dumps({"ready": store.url}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        op, key = req["op"], req.get("key")
        t0 = time.monotonic()
        try:
            if op == "get":
                out = store.get(key)
            elif op == "set":
                out = store.set(key, bytes.fromhex(req["value"]))
            elif op == "add":
                out = store.add(key, req["delta"])
            elif op == "wait":
                out = store.wait(key, req["timeout"])
            elif op == "wait_change":
                old = req.get("old")
                out = store.wait_change(key, None if old is None else bytes.fromhex(old), req["timeout"])
            else:
                raise ValueError(f"unknown op {op!r}")
            reply = {"ok": True, "value": _hex(out)}
        except Exception as e:  # noqa: BLE001 - the test inspects the class
            reply = {"ok": False, "error": type(e).__name__, "msg": str(e)[:500]}
        reply["took"] = time.monotonic() - t0
        print(json.dumps(reply), flush=True)
    store.close()


def main(argv: list[str]) -> None:
    mode, where, timeout = argv[0], argv[1], float(argv[2])
    if mode == "host":
        store = TcpStore(where, 0, is_host=True, connect_timeout=timeout)
    else:
        store = open_store(where, connect_timeout=timeout)
    serve(store)


if __name__ == "__main__":
    main(sys.argv[1:])
