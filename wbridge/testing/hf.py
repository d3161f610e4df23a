"""Small Hugging Face model configs for tests, examples and benchmarks (no model hub here)."""

from __future__ import annotations

from typing import Any


def qwen2_config(**overrides: Any) -> Any:
    """A small random-init Qwen2 config (GQA; head_dim 32, which vLLM's CPU attention needs at
    least), fp32, untied embeddings; ``overrides`` replace any field."""
    from transformers import Qwen2Config

    fields: dict[str, Any] = dict(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        torch_dtype="float32",
        bos_token_id=0,
        eos_token_id=1,
    )
    fields.update(overrides)
    return Qwen2Config(**fields)
