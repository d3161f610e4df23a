"""A tiny PEFT LoRA trainer for the LoRA tests, example and benchmark: the small random Qwen2 of
``wbridge.testing.hf`` with a rank-8 adapter on the attention and MLP projections, and an AdamW
step on a fixed random batch (no data set here)."""

from __future__ import annotations

from typing import Any

#: the projections of every decoder layer (attention q/k/v/o, MLP gate/up/down)
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def lora_config(r: int = 8, alpha: int = 16, targets: tuple[str, ...] = TARGETS) -> Any:
    """PEFT's ``LoraConfig``: rank ``r`` on ``targets``, no dropout, B random (not zero) so the
    first version already changes the tokens."""
    from peft import LoraConfig

    return LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0, init_lora_weights=False)


def peft_model(base: str | None = None, seed: int = 0, r: int = 8, targets: tuple[str, ...] = TARGETS) -> Any:
    """A PEFT model of the Qwen2 checkpoint at ``base`` (None: a random ``qwen2_config`` model),
    fp32, its adapter's tensors drawn from ``seed``."""
    import torch
    from peft import get_peft_model
    from transformers import Qwen2ForCausalLM

    from .hf import qwen2_config

    torch.manual_seed(seed)
    if base is None:
        model = Qwen2ForCausalLM(qwen2_config()).float()
    else:
        model = Qwen2ForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
    return get_peft_model(model, lora_config(r, targets=targets))


class Trainer:
    """AdamW steps on a fixed random batch (only the adapter trains: PEFT froze the base).

    model: the PEFT model (may be FSDP2-sharded: every rank steps with the same batch).
    lr: AdamW's learning rate.
    seed: draws the batch.
    """

    def __init__(self, model: Any, lr: float = 1e-2, seed: int = 0) -> None:
        import torch

        self.model = model
        g = torch.Generator().manual_seed(seed)
        vocab = model.get_base_model().config.vocab_size if hasattr(model, "get_base_model") else 256
        self.batch = torch.randint(0, vocab, (2, 16), generator=g)
        self.opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)

    def step(self) -> float:
        loss = self.model(input_ids=self.batch, labels=self.batch).loss
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        return float(loss.detach())


def full_adapter(model: Any) -> dict[str, Any]:
    """The adapter's tensors by canonical (PEFT checkpoint) name, whole (DTensors gathered:
    collective, every rank calls it), cloned."""
    from peft import get_peft_model_state_dict

    out = {}
    for k, v in get_peft_model_state_dict(model).items():
        full = v.full_tensor() if hasattr(v, "full_tensor") else v
        out[k] = full.detach().clone()
    return out
