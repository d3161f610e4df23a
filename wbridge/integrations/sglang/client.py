"""Reading an SGLang engine's wbridge stats: an ``sgl.Engine`` or an HTTP server's URL (this
module needs no SGLang: a trainer host can poll its rollout servers)."""

from __future__ import annotations

import json
import time
import urllib.request
from typing import Any

from ... import _validate
from ...errors import UsageError, WaitTimeout
from ..remote import merge_verified, rebuild, untag


def server_stats(engine: Any) -> list[dict[str, Any]]:
    """Each scheduler rank's wbridge stats: an ``sgl.Engine``, or an HTTP server's base URL."""
    if isinstance(engine, str):
        with urllib.request.urlopen(engine.rstrip("/") + "/server_info", timeout=30) as r:
            info = json.loads(r.read())
    else:
        info = engine.get_server_info()
    out = []
    for state in info.get("internal_states") or []:
        out.extend((state or {}).get("wbridge") or [])
    if not out:
        raise UsageError("this SGLang engine reports no wbridge stats (not started with engine_args?)")
    return out


def _raise_stopped(stats: list[dict[str, Any]]) -> None:
    """A rank whose puller stopped (a deterministic error, or failures for ``pull_timeout``)
    follows no more: its error, as its own wbridge class."""
    for s in stats:
        if s.get("stopped"):
            raise rebuild({"type": s["error_type"], "message": s["error"]}, "SGLang engine, the puller stopped")


def wait_version(engine: Any, version: int, timeout: float = 60.0, poll: float = 0.05) -> list[dict[str, Any]]:
    """Blocks until every rank of ``engine`` holds ``version`` or newer; returns their stats. A
    rank whose puller stopped on an error raises that error at once."""
    version = _validate.integer(version, "wait_version() version", minimum=1)
    timeout = _validate.timeout(timeout, "wait_version() timeout")
    poll = _validate.timeout(poll, "wait_version() poll", positive=True)
    deadline = time.monotonic() + timeout
    while True:
        stats = server_stats(engine)
        if all((s["version"] or 0) >= version for s in stats):
            return stats
        _raise_stopped(stats)
        if time.monotonic() > deadline:
            raise WaitTimeout(f"SGLang engine: version {version} not committed within {timeout:.1f}s: {stats}")
        time.sleep(poll)


def verify(engine: Any, timeout: float = 60.0) -> dict[str, Any]:
    """Checks what ``engine`` (an ``sgl.Engine`` started with ``engine_args``, or an HTTP server's
    base URL) runs on: each scheduler checks its staging against the publishers' checksums of the
    version it holds and its live parameters against staging (``runtime.Runtime.verify``).
    Returns ``{"version", "tensors": {name: "ok" or why not}, "ok"}``; raises the wbridge error a
    scheduler met (``IntegrityError``: staging does not match the checksums...)."""
    timeout = _validate.timeout(timeout, "verify() timeout", positive=True)
    if isinstance(engine, str):
        body = json.dumps({"server_args": {"wbridge_verify": timeout}}).encode()
        req = urllib.request.Request(
            engine.rstrip("/") + "/set_internal_state", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=timeout + 30) as r:
            r.read()
    else:
        try:
            engine.collective_rpc("wbridge_verify", timeout=timeout)
        except Exception as e:
            err = untag(e)
            if err is None:
                raise
            raise err from e
    results = [s.get("verify") or {} for s in server_stats(engine)]
    for r in results:
        if "error" in r:
            raise rebuild(r["error"])
    return merge_verified(results)
