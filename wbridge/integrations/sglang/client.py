"""Reading an SGLang engine's wbridge stats: an ``sgl.Engine`` or an HTTP server's URL (this
module needs no SGLang: a trainer host can poll its rollout servers)."""

from __future__ import annotations

import json
import time
import urllib.request
from typing import Any

from ...errors import UsageError, WaitTimeout


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


def wait_version(engine: Any, version: int, timeout: float = 60.0, poll: float = 0.05) -> list[dict[str, Any]]:
    """Blocks until every rank of ``engine`` holds ``version`` or newer; returns their stats."""
    deadline = time.monotonic() + timeout
    while True:
        stats = server_stats(engine)
        if all((s["version"] or 0) >= version for s in stats):
            return stats
        if time.monotonic() > deadline:
            raise WaitTimeout(f"SGLang engine: version {version} not committed within {timeout:.1f}s: {stats}")
        time.sleep(poll)
