"""Small Hugging Face model configs and random checkpoints of them, for tests, examples and
benchmarks (no model hub here)."""

from __future__ import annotations

from typing import Any

# The small shape both configs share: GQA, head_dim 32 (which vLLM's CPU attention needs at
# least), fp32, untied embeddings.
_SMALL: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "bos_token_id": 0,
    "eos_token_id": 1,
}


def qwen2_config(**overrides: Any) -> Any:
    """A small random-init Qwen2 config (GQA; head_dim 32, which vLLM's CPU attention needs at
    least), fp32, untied embeddings; ``overrides`` replace any field."""
    from transformers import Qwen2Config

    return Qwen2Config(**{**_SMALL, **overrides})


def qwen3_moe_config(**overrides: Any) -> Any:
    """A small random-init Qwen3-MoE config: ``qwen2_config``'s shape with 4 experts (2 per token)
    of intermediate size 64 in every layer; ``overrides`` replace any field."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        **{**_SMALL, "moe_intermediate_size": 64, "num_experts": 4, "num_experts_per_tok": 2, **overrides}
    )


def make_qwen2(path: str, seed: int = 0, **overrides: Any) -> None:
    """Saves a random fp32 Qwen2 (``qwen2_config``) at ``path``."""
    from transformers import Qwen2ForCausalLM

    _save_random(Qwen2ForCausalLM(qwen2_config(**overrides)), path, seed)


def make_qwen3_moe(path: str, seed: int = 0, **overrides: Any) -> None:
    """Saves a random fp32 Qwen3-MoE (``qwen3_moe_config``: 4 experts, 2 per
    token) at ``path``."""
    from transformers import Qwen3MoeForCausalLM

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
