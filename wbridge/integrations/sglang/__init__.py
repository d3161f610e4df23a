"""SGLang rollout engines as wbridge subscribers.

Usage (offline engine; the HTTP server takes the same arguments in its ``ServerArgs``)::

    import sglang as sgl
    from wbridge.integrations.sglang import SGLangOptions, engine_args, server_stats

    opts = SGLangOptions(channel="policy", store="tcp://trainer:29700", token="...", dtype="bfloat16")
    engine = sgl.Engine(model_path=ckpt, dtype="bfloat16", **engine_args(opts))
    out = engine.generate(input_ids=ids, sampling_params={...})
    out["meta_info"]["weight_version"]      # the wbridge version that produced it ("default" before)
    server_stats(engine)                    # per rank: version, bytes, delta, pull_s, pause_s, history
    verify(engine)                          # {"version", "tensors", "ok"}: what the engine runs on

Each scheduler process subscribes at start, right after loading its checkpoint; a background
thread pulls every newly published version into staging while the engine keeps generating, and
the scheduler commits it between two steps (``runtime``). A restarted engine joins again and
pulls the newest version. See docs/sglang.md. ``server_stats``, ``wait_version`` and ``verify``
also work without SGLang installed, on an HTTP server's URL (a trainer host polling its rollouts).
``SGLangLoRAUpdater`` (``lora``) keeps a LoRA adapter channel's newest version loaded in an
engine, from memory (docs/lora.md).
"""

from __future__ import annotations

from typing import Any

from ...errors import MissingExtraError, UsageError
from .client import server_stats, verify, wait_version
from .lora import SGLangLoRAUpdater
from .options import SGLangOptions

__all__ = ["SGLangLoRAUpdater", "SGLangOptions", "engine_args", "server_stats", "verify", "wait_version"]


def engine_args(options: SGLangOptions, extra_config: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``sgl.Engine`` / ``ServerArgs`` keywords that subscribe the engine: ``load_format``
    (``WBridgeModelLoader``) and ``model_loader_extra_config`` (the options, next to ``extra_config``)."""
    try:
        from .loader import WBridgeModelLoader
    except ImportError as e:
        raise MissingExtraError(
            f"wbridge.integrations.sglang needs SGLang ({e}); scripts/setup.sh builds it in .venv-sglang"
        ) from e

    if not isinstance(options, SGLangOptions):
        raise UsageError(f"engine_args needs SGLangOptions, got {type(options).__name__}")
    return {"load_format": WBridgeModelLoader, "model_loader_extra_config": options.to_extra_config(extra_config)}
