"""How a pulled version reaches vLLM's kernels, with the engine paused only for the commit.

vLLM post-processes weights after loading (``process_weights_after_loading``). What a parameter
needs after a pull into its checkpoint-format staging tensor depends on that processing, so each
staged parameter is classified once, on the live (processed) model, into one of three paths:

``direct``
    The processing is the identity for it: its module has no quantisation method (norms, rotary
    caches...), or it is a tensor an unquantised linear / embedding layer still reads at run time
    (biases; an embedding's weight; on GPU every unquantised weight). Its staging lives in one flat
    buffer on the parameter's device and the commit is one fused device copy
    (``torch._foreach_copy_``) into the live parameters.
``repack``
    An unquantised linear or embedding layer whose kernel holds a *processed* copy of the weight
    (on CPU: vLLM's oneDNN / SGL GEMM handles, ``layer.cpu_linear``; the weight parameter is then
    emptied). The expensive part, the layer's own ``process_weights_after_loading``, runs on the
    pull's background thread on a stand-in module holding the staged tensors (the handles copy the
    weights); the commit sets ``layer.cpu_linear`` to the new kernel: a reference swap. The handle
    is built by the same vLLM code from the same values as at start-up, so the result is bit-exact
    against an engine loaded from those weights.
``reload``
    Everything else (fused MoE experts, quantised layers, attention layers with scales): vLLM's
    layerwise reload lifecycle (``initialize_layerwise_reload`` -> load -> ``finalize``) replayed at
    commit on those modules only, with a loader that copies the staged tensors in, so vLLM re-runs
    its processing exactly as at start-up.

(On an AMD Zen CPU with zentorch vLLM's GEMM may keep a reference to the weight instead of a
packed copy, which the next pull would overwrite; there linear layers take the ``reload`` path.)
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ...errors import LayoutError


@dataclass(frozen=True)
class CommitPlan:
    """Which path each staged parameter takes (see the module docstring).

    direct: staged parameter names copied into the live parameter of the same name.
    repack: module names whose kernel (``cpu_linear``) is rebuilt in the background and swapped in.
    reload: module names reloaded through vLLM's layerwise reload at commit.
    """

    direct: tuple[str, ...]
    repack: tuple[str, ...]
    reload: tuple[str, ...]

    def as_dict(self) -> dict[str, list[str]]:
        return {"direct": list(self.direct), "repack": list(self.repack), "reload": list(self.reload)}


def _split(name: str) -> tuple[str, str]:
    mod, _, attr = name.rpartition(".")
    return mod, attr


def _repackable(qm: Any) -> bool:
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
    from vllm.platforms import current_platform

    # exact types: a subclass may process differently
    return type(qm) in (UnquantizedLinearMethod, UnquantizedEmbeddingMethod) and not current_platform.is_zen_cpu()


def plan_commit(model: Any, shapes: Mapping[str, tuple[int, ...]]) -> CommitPlan:
    """Classifies the staged parameters ``shapes`` (checkpoint-format name -> shape) on the live,
    processed ``model``."""
    from vllm.model_executor.layers.attention import is_deferred_attention_layer
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    by_module: dict[str, list[str]] = {}
    for name in shapes:
        by_module.setdefault(_split(name)[0], []).append(name)
    direct: list[str] = []
    repack: list[str] = []
    reload: list[str] = []
    for mod_name, names in by_module.items():
        try:
            mod = model.get_submodule(mod_name)
        except AttributeError as e:
            raise LayoutError(f"staged parameter {names[0]!r}: no module {mod_name!r} in the vLLM model") from e
        qm = getattr(mod, "quant_method", None)
        # a live tensor of the checkpoint shape that the layer still reads as it is
        kept = [n for n in names if _same_shape(getattr(mod, _split(n)[1], None), shapes[n])]
        only_weight_gone = all(n in kept or _split(n)[1] == "weight" for n in names)
        if is_deferred_attention_layer(mod):
            reload.append(mod_name)
        elif not isinstance(qm, QuantizeMethodBase):
            (direct.extend(names) if len(kept) == len(names) else reload.append(mod_name))
        elif _repackable(qm) and hasattr(mod, "cpu_linear") and only_weight_gone:
            direct.extend(kept)  # biases, a kept weight: read by the kernel at run time
            repack.append(mod_name)
        elif _repackable(qm) and len(kept) == len(names):  # no kernel handle (GPU): the identity
            direct.extend(names)
        else:
            reload.append(mod_name)
    return CommitPlan(tuple(direct), tuple(repack), tuple(reload))


def _same_shape(t: Any, shape: tuple[int, ...]) -> bool:
    import torch

    return isinstance(t, torch.Tensor) and tuple(t.shape) == tuple(shape)


def allocate_staging(model: Any, plan: CommitPlan, shapes: Mapping[str, tuple[int, ...]], dtype: Any) -> dict[str, Any]:
    """Checkpoint-format staging tensors: the ``direct`` ones as views of one flat buffer per
    device, on the live parameter's device; the others on the host."""
    import math

    import torch

    staging: dict[str, Any] = {}
    groups: dict[Any, list[str]] = {}
    for name in plan.direct:
        mod_name, attr = _split(name)
        groups.setdefault(getattr(model.get_submodule(mod_name), attr).device, []).append(name)
    for device, names in groups.items():
        flat = torch.zeros(sum(math.prod(shapes[n]) for n in names), dtype=dtype, device=device)
        off = 0
        for n in names:
            k = math.prod(shapes[n])
            staging[n] = flat[off : off + k].view(shapes[n])
            off += k
    for name, shape in shapes.items():
        if name not in staging:
            staging[name] = torch.zeros(shape, dtype=dtype)
    return staging


def prepare(
    model: Any, plan: CommitPlan, staging: Mapping[str, Any], only: tuple[str, ...] | None = None
) -> dict[str, Any]:
    """The ``repack`` layers' new kernels (``only`` those named), built from staging off the
    engine's critical path (nothing live is touched): ``{module name: cpu_linear}``."""
    import torch

    out: dict[str, Any] = {}
    with torch.no_grad():
        members = _by_module(staging)
        for mod_name in plan.repack if only is None else only:
            mod = model.get_submodule(mod_name)
            shadow = torch.nn.Module()
            for attr, t in members[mod_name].items():
                # SGL's prepack may convert the bias in place (``.data = ...``): the stand-in's own
                # Parameter takes it, not the staging tensor
                shadow.register_parameter(attr, torch.nn.Parameter(t, requires_grad=False))
            # MLA's kv_b_proj: vLLM marks the layers it leaves unpacked (no public accessor)
            skip = getattr(mod, "_cpu_skip_gemm_dispatch", None)
            if skip is not None:
                shadow._cpu_skip_gemm_dispatch = skip
            mod.quant_method.process_weights_after_loading(shadow)
            out[mod_name] = shadow.cpu_linear
    return out


#: How ``check`` marks a tensor whose kernel it cannot compare (its staging was checked only).
UNCHECKED = "unchecked"
PROBE_ROWS = 256  # rows of the identity probe run through a kernel at a time


def check(model: Any, plan: CommitPlan, staging: Mapping[str, Any]) -> dict[str, str]:
    """Whether the live model runs on ``staging``, per staged tensor: ``"ok"``, or why not.

    ``direct`` parameters: byte for byte (cast to the live dtype where vLLM's processing changed
    it, e.g. a bias the CPU kernel reads in fp32). ``repack`` layers: a kernel built from staging
    by ``prepare`` (the commit's own path) and the live kernel are run on an identity probe (each
    output row is one row of the weight, exactly) and must agree bit for bit. ``reload`` layers:
    vLLM processed them its own way; they are marked ``UNCHECKED`` (their staging is what the
    caller checks against the publishers' checksums)."""
    import torch

    out: dict[str, str] = {}
    with torch.no_grad():
        for name in plan.direct:
            mod_name, attr = _split(name)
            live = getattr(model.get_submodule(mod_name), attr).data
            out[name] = "ok" if _same_bytes(live, staging[name].to(live.dtype)) else "differs from staging"
        members = _by_module(staging)
        for mod_name in plan.repack:
            fresh = prepare(model, plan, staging, only=(mod_name,))[mod_name]
            same = _same_kernel(model.get_submodule(mod_name), fresh, members[mod_name]["weight"])
            for attr in members[mod_name]:
                if f"{mod_name}.{attr}" not in plan.direct:  # (a kept bias was compared above)
                    out[f"{mod_name}.{attr}"] = "ok" if same else "kernel differs from one built from staging"
        for mod_name in plan.reload:
            for attr in members[mod_name]:
                out[f"{mod_name}.{attr}"] = f"{UNCHECKED}: reloaded through vLLM's own processing (staging checked)"
    return out


def _same_bytes(a: Any, b: Any) -> bool:
    import torch

    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))


def _same_kernel(layer: Any, fresh: Any, weight: Any) -> bool:
    """Whether ``layer``'s live kernel and ``fresh`` (built from the staged ``weight``) give the
    same bytes on each row of the identity of the weight's input width. (A packed kernel ignores
    the weight it is passed; a plain one reads the parameter.)"""
    import torch

    k = weight.shape[1]
    for start in range(0, k, PROBE_ROWS):
        rows = min(PROBE_ROWS, k - start)
        x = torch.zeros(rows, k, dtype=weight.dtype)
        x[torch.arange(rows), torch.arange(start, start + rows)] = 1
        if not _same_bytes(layer.cpu_linear(x, layer.weight, None), fresh(x, weight, None)):
            return False
    return True


def commit(
    model: Any, model_config: Any, plan: CommitPlan, staging: Mapping[str, Any], prepared: Mapping[str, Any]
) -> None:
    """Puts the staged version into the kernels: one fused copy for ``direct``, a swap of the
    prepared kernels for ``repack``, vLLM's layerwise reload for ``reload``."""
    import torch

    with torch.no_grad():
        if plan.direct:
            live = [getattr(model.get_submodule(m), a).data for m, a in map(_split, plan.direct)]
            torch._foreach_copy_(live, [staging[n] for n in plan.direct])
        for mod_name in plan.repack:
            model.get_submodule(mod_name).cpu_linear = prepared[mod_name]
        members = _by_module(staging) if plan.reload else {}
        for mod_name in plan.reload:
            mod = model.get_submodule(mod_name)
            with Reload(mod, model_config) as rl:
                rl.copy_loaders()
                params = dict(mod.named_parameters(recurse=False))
                for attr, t in members[mod_name].items():
                    params[attr].weight_loader(params[attr], t)
            repack_cpu_moe(mod)


def _by_module(staging: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for name, t in staging.items():
        mod, attr = _split(name)
        out.setdefault(mod, {})[attr] = t
    return out


def _copy_loader(param: Any, loaded_weight: Any) -> None:
    """A weight loader for tensors already in the parameter's (checkpoint) format."""
    if tuple(param.shape) != tuple(loaded_weight.shape):
        raise LayoutError(f"reload: shape {tuple(loaded_weight.shape)} for a parameter of shape {tuple(param.shape)}")
    param.data.copy_(loaded_weight)


class _NothingLoaded(logging.Filter):
    """Drops vLLM's "Failed to load weights" warning: a reload that only traces or reads shapes
    loads nothing on purpose, and vLLM then puts every layer's kernel tensors back (as it says)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Failed to load weights" not in record.getMessage()


_LAYERWISE_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


def _original_loader(loader: Any) -> Any:
    """``loader`` without vLLM's layerwise wrappers (``online_process_loader``, which
    ``functools.wraps`` its original: ``__wrapped__``)."""
    import inspect

    return inspect.unwrap(loader, stop=lambda f: getattr(f, "__name__", "") != "online_process_loader")


class Reload:
    """vLLM's layerwise reload of ``model`` (a model or one of its modules); inside it every layer
    holds its checkpoint-format parameters (restored on the meta device) and processing runs when
    a layer is complete.

    model: the module whose layers are reloaded.
    model_config: vLLM's ModelConfig (attention layers' processing needs it).
    loads: False when the block loads nothing (tracing, reading shapes): vLLM's warning that a
        layer loaded nothing is then expected and silenced.
    """

    def __init__(self, model: Any, model_config: Any, *, loads: bool = True) -> None:
        self.model, self.model_config, self.loads = model, model_config, loads

    def __enter__(self) -> Reload:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)
        return self

    def unwrapped(self) -> None:
        """Puts the original weight loaders back (for tracing, which must not trigger processing)."""
        for p in self.model.parameters():
            if hasattr(p, "weight_loader"):
                p.weight_loader = _original_loader(p.weight_loader)

    def copy_loaders(self) -> None:
        """Makes every parameter load a checkpoint-format tensor by plain copy, still deferred
        through vLLM's layerwise wrappers (so processing runs once a layer is complete)."""
        from vllm.model_executor.model_loader.reload.layerwise import initialize_online_processing
        from vllm.model_executor.model_loader.reload.meta import SKIP_LOAD_TENSORS
        from vllm.model_executor.model_loader.reload.utils import get_layer_tensors

        for layer in self.model.modules():
            for name, t in get_layer_tensors(layer).items():
                if name not in SKIP_LOAD_TENSORS:
                    t.weight_loader = _copy_loader
            initialize_online_processing(layer)  # wraps them again (and counts what the layer loads)

    def __exit__(self, *exc: Any) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        if self.loads:
            finalize_layerwise_reload(self.model, self.model_config)
            return
        quiet, logger = _NothingLoaded(), logging.getLogger(_LAYERWISE_LOGGER)
        logger.addFilter(quiet)
        try:
            finalize_layerwise_reload(self.model, self.model_config)
        finally:
            logger.removeFilter(quiet)


def repack_cpu_moe(model: Any) -> None:
    """Works around vLLM 0.32 on CPU: a weight update of an unquantized fused-MoE layer copies the
    new weights in kernel *input* format but skips the CPU grouped-GEMM prepack
    (``fused_experts.process_weights_after_loading`` runs only on the first load), so the kernel
    would read unpacked weights. Re-run that prepack, as start-up does."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    for mod in model.modules():
        kernel = getattr(getattr(mod, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is not None and hasattr(mod, "w13_weight") and "CPU" in type(experts).__name__:
            experts.process_weights_after_loading(mod)
