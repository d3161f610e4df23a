"""SGLang engine arguments and a tiny Qwen2 checkpoint for the CPU tests, example and benchmark."""

from __future__ import annotations

from typing import Any

#: ``sgl.Engine`` / ``ServerArgs`` keywords that run SGLang 0.5.23 on a CPU without AMX (with
#: ``SGLANG_USE_CPU_ENGINE=1`` and tests/sglang_stubs on the path); the radix cache is off so
#: that greedy tokens compare exactly across weight updates.
CPU_ENGINE_ARGS: dict[str, Any] = dict(
    device="cpu",
    attention_backend="torch_native",
    sampling_backend="pytorch",
    disable_cuda_graph=True,
    disable_radix_cache=True,
    max_total_tokens=4096,
    max_running_requests=8,
    chunked_prefill_size=512,
    mem_fraction_static=0.05,
    tp_size=1,
    skip_server_warmup=True,
    skip_tokenizer_init=True,
    log_level="warning",
)


def make_qwen2(path: str, seed: int = 0, **overrides: Any) -> None:
    """Saves a random fp32 Qwen2 (``wbridge.testing.hf.qwen2_config``) at ``path``."""
    from transformers import Qwen2ForCausalLM

    from .hf import qwen2_config

    _save_random(Qwen2ForCausalLM(qwen2_config(**overrides)), path, seed)


def make_qwen3_moe(path: str, seed: int = 0, **overrides: Any) -> None:
    """Saves a random fp32 Qwen3-MoE (``wbridge.testing.hf.qwen3_moe_config``: 4 experts, 2 per
    token) at ``path``."""
    from transformers import Qwen3MoeForCausalLM

    from .hf import qwen3_moe_config

    _save_random(Qwen3MoeForCausalLM(qwen3_moe_config(**overrides)), path, seed)


def _save_random(model: Any, path: str, seed: int) -> None:
    import torch

    torch.manual_seed(seed)
    model = model.float()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    model.save_pretrained(path, safe_serialization=True)


def save_bf16(model: Any, path: str) -> None:
    """Saves ``model`` (fp32 masters) as the bf16 checkpoint a publisher with ``dtype=bfloat16``
    serves: each tensor cast once, as the publisher casts it."""
    import copy

    import torch

    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
