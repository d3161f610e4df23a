"""Hugging Face transformers models as trainers or rollout workers (TP=1).

Canonical names are the checkpoint names (what ``save_pretrained`` writes). Most models hold their
parameters under those names; MoE models in transformers 5 fuse experts into ``[E, 2I, H]``
``gate_up_proj`` / ``[E, H, I]`` ``down_proj`` tensors. Their layout is traced through transformers'
own checkpoint conversion, so either kind registers the same way::

    from wbridge.integrations.transformers import entries
    pub.register(entries(model))       # trainer
    sub.register(entries(model))       # rollout worker: pulls straight into model's parameters
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from ..errors import LayoutError, UsageError
from .trace import TraceResult, trace_load_weights


def _model(model: Any, who: str) -> Any:
    """``model`` if it is a ``torch.nn.Module`` (a transformers model), else ``UsageError`` naming ``who``."""
    import torch

    if not isinstance(model, torch.nn.Module):
        raise UsageError(f"{who}(model) takes a transformers model (a torch.nn.Module), got {type(model).__name__}")
    return model


def checkpoint_shapes(model: Any) -> dict[str, tuple[int, ...]]:
    """Canonical (checkpoint) tensor names and shapes of ``model``, without copying weights."""
    import torch

    _model(model, "checkpoint_shapes")
    from transformers.core_model_loading import revert_weight_conversion

    sd = {k: torch.empty(v.shape, device="meta") for k, v in model.state_dict().items()}
    return {k: tuple(v.shape) for k, v in revert_weight_conversion(model, sd).items()}


def config_shapes(hf_config: Any) -> dict[str, tuple[int, ...]]:
    """Canonical (checkpoint) names and shapes for a Hugging Face config, from transformers'
    model class built on the meta device (no memory)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    return checkpoint_shapes(model)


def load_weights(model: Any) -> Callable[[Iterable[tuple[str, Any]]], None]:
    """transformers' own checkpoint loading (with its weight conversions) as a
    ``load_weights(iter[(name, full_tensor)])`` callable."""
    _model(model, "load_weights")
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import convert_and_load_state_dict_in_model
    from transformers.modeling_utils import LoadStateDictConfig

    def load(weights: Iterable[tuple[str, Any]]) -> None:
        cfg = LoadStateDictConfig(weight_mapping=get_model_conversion_mapping(model))
        _, errors = _result(convert_and_load_state_dict_in_model(model, dict(weights), cfg))
        if errors:
            raise LayoutError(f"transformers could not load {errors}")

    return load


def _result(r: Any) -> tuple[Any, Any]:
    # convert_and_load_state_dict_in_model returns (missing, unexpected, mismatched, ...) tuples
    # whose shape changed across versions; only conversion errors matter here.
    errors = getattr(r, "conversion_errors", None)
    if errors is None and isinstance(r, tuple) and r and isinstance(r[-1], dict):
        errors = r[-1]
    return r, errors or None


def trace(model: Any, **kwargs: Any) -> TraceResult:
    """The layout of ``model``'s parameters in checkpoint names, traced through transformers."""
    _model(model, "trace")
    return trace_load_weights(model, load_weights(model), checkpoint_shapes(model), **kwargs)


def entries(model: Any, **kwargs: Any) -> dict[str, tuple[Any, Any]]:
    """``{local name: (tensor, decl)}`` of every parameter of ``model`` (views for fused experts)."""
    return trace(model, **kwargs).bind(model)
