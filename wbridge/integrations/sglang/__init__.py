"""SGLang rollout engines as wbridge subscribers.

Usage (offline engine; the HTTP server takes the same arguments in its ``ServerArgs``)::

    import sglang as sgl
    from wbridge.integrations.sglang import SGLangOptions, engine_args, server_stats

    opts = SGLangOptions(channel="policy", store="tcp://trainer:29700", token="...", dtype="bfloat16")
    engine = sgl.Engine(model_path=ckpt, dtype="bfloat16", **engine_args(opts))
    out = engine.generate(input_ids=ids, sampling_params={...})
    out["meta_info"]["weight_version"]      # the wbridge version that produced it ("default" before)
    server_stats(engine)                    # per rank: version, bytes, delta, pull_s, pause_s, history

Each scheduler process subscribes at start, right after loading its checkpoint; a background
thread pulls every newly published version into staging while the engine keeps generating, and
the scheduler commits it between two steps (``runtime``). A restarted engine joins again and
pulls the newest version. See docs/sglang.md.
"""

from __future__ import annotations

from typing import Any

from ...errors import MissingExtraError, UsageError
from .options import SGLangOptions

try:
    import sglang  # noqa: F401
except ImportError as e:
    raise MissingExtraError(
        f"wbridge.integrations.sglang needs SGLang ({e}); scripts/setup.sh builds it in .venv-sglang"
    ) from e

__all__ = ["SGLangOptions", "engine_args", "server_stats", "wait_version"]


def engine_args(options: SGLangOptions, extra_config: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``sgl.Engine`` / ``ServerArgs`` keywords that subscribe the engine: ``load_format``
    (``WBridgeModelLoader``) and ``model_loader_extra_config`` (the options, next to ``extra_config``)."""
    from .loader import WBridgeModelLoader

    if not isinstance(options, SGLangOptions):
        raise UsageError(f"engine_args needs SGLangOptions, got {type(options).__name__}")
    return {"load_format": WBridgeModelLoader, "model_loader_extra_config": options.to_extra_config(extra_config)}


def server_stats(engine: Any) -> list[dict[str, Any]]:
    """Each scheduler rank's wbridge stats: an ``sgl.Engine``, or an HTTP server's base URL."""
    if isinstance(engine, str):
        import json
        import urllib.request

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
    import time

    from ...errors import WaitTimeout

    deadline = time.monotonic() + timeout
    while True:
        stats = server_stats(engine)
        if all((s["version"] or 0) >= version for s in stats):
            return stats
        if time.monotonic() > deadline:
            raise WaitTimeout(f"SGLang engine: version {version} not committed within {timeout:.1f}s: {stats}")
        time.sleep(poll)
