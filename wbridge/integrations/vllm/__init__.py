"""vLLM rollout engines as wbridge subscribers.

- ``worker``: ``WBridgeWorkerExtension``, mixed into vLLM's workers (``worker_extension_cls``).
- ``updater``: ``VLLMUpdater`` and ``AsyncVLLMUpdater`` keep a ``vllm.LLM`` / ``AsyncLLM`` on the newest
  version in the background.
- ``flow``: the updaters' logic as generators of engine operations, and the sync and async drivers
  that perform them (the LoRA updaters use them too).
- ``state``: what one worker holds for its subscription (``WorkerState``).
- ``commit``: how a pulled version reaches the kernels, with the engine paused only for the commit.
- ``transfer``: the ``"wbridge"`` weight-transfer backend (``WeightTransferConfig(backend="wbridge")``).
- ``trainer``: the trainer side of vLLM's weight-transfer API for that backend.
- ``lora``, ``lora_updater``: LoRA adapter channels: ``VLLMLoRAUpdater`` / ``AsyncVLLMLoRAUpdater``
  keep a named adapter on the newest version, installed from memory (``lora_internals`` names
  every vLLM internal that takes).

Importing this package does not import vLLM: the names of ``transfer`` and ``trainer`` (which
subclass vLLM's classes) load on first use, and raise ``MissingExtraError`` where vLLM is absent.
"""

from __future__ import annotations

from typing import Any

from .lora_updater import AsyncVLLMLoRAUpdater, VLLMLoRAUpdater
from .updater import AsyncVLLMUpdater, VLLMUpdater
from .worker import DEFAULT_CACHE, EXTENSION, WBridgeWorkerExtension, hf_checkpoint_shapes, portable_to_tensor

_LAZY = {
    "WBridgeInitInfo": "transfer",
    "WBridgeUpdateInfo": "transfer",
    "WBridgeWeightTransferEngine": "transfer",
    "register": "transfer",
    "WBridgeTrainerInitInfo": "trainer",
    "WBridgeTrainerEngine": "trainer",
}

__all__ = [
    "AsyncVLLMLoRAUpdater",
    "AsyncVLLMUpdater",
    "DEFAULT_CACHE",
    "EXTENSION",
    "VLLMLoRAUpdater",
    "VLLMUpdater",
    "WBridgeWorkerExtension",
    "hf_checkpoint_shapes",
    "portable_to_tensor",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    from ...errors import MissingExtraError

    try:
        mod = importlib.import_module(f"{__name__}.{module}")
    except ImportError as e:
        raise MissingExtraError(
            f"wbridge.integrations.vllm.{name} needs vllm ({e}); pip install 'wbridge[vllm]'"
        ) from e
    return getattr(mod, name)
