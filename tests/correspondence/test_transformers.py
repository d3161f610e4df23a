"""Hugging Face transformers models as trainers and rollout workers (TP=1): a tiny random Qwen2
(GQA, 1 kv head) and a tiny Qwen3-MoE (experts fused by transformers 5 into [E, 2I, H]), built
from configs (no hub). Layouts are traced through transformers' own checkpoint conversion."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from wbridge.integrations.dtensor import from_module
from wbridge.integrations.trace import trace_load_weights
from wbridge.testing.hf import qwen2_config, qwen3_moe_config

from .engines import VllmStyleModel, assert_like_loaded, hf_shapes
from .helpers import check_entries, plan_transfer

if importlib.util.find_spec("transformers") is None:  # found, not imported: each collecting worker would pay
    pytest.skip("transformers is not installed (pip install -e '.[transformers]')", allow_module_level=True)
pytestmark = pytest.mark.slow


def qwen2(seed):
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = qwen2_config(vocab_size=131, hidden_size=64, intermediate_size=48, num_key_value_heads=1, head_dim=16)
    return Qwen2ForCausalLM(cfg).float()


def qwen3_moe(seed):
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    cfg = qwen3_moe_config(
        vocab_size=131, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_key_value_heads=1
    )
    return Qwen3MoeForCausalLM(cfg).float()


def _perturb(model):
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))


def test_qwen3_moe_trainer_to_qwen3_moe_rollout():
    from wbridge.integrations.transformers import checkpoint_shapes, entries, load_weights, trace

    trainer, rollout = qwen3_moe(0), qwen3_moe(1)
    _perturb(trainer)
    res = trace(rollout)
    gu = res.entries["model.layers.0.mlp.experts.gate_up_proj"]
    assert [v for v, _ in gu] == [(0,), (1,), (2,), (3,)]  # [gate_e; up_e] per expert view
    assert [s.name for s in gu[2][1].parts] == [
        "model.layers.0.mlp.experts.2.gate_proj.weight",
        "model.layers.0.mlp.experts.2.up_proj.weight",
    ]
    assert set(checkpoint_shapes(rollout)) == res.canonical_names()
    src, dst = entries(trainer), res.bind(rollout)
    plan_transfer([src], [dst])
    for (n, a), (_, b) in zip(trainer.state_dict().items(), rollout.state_dict().items()):
        assert torch.equal(a, b), n
    # Ground truth the other way: transformers' own loader, fed the trainer's checkpoint tensors.
    from transformers.core_model_loading import revert_weight_conversion

    third = qwen3_moe(2)
    load_weights(third)(revert_weight_conversion(trainer, dict(trainer.state_dict())).items())
    for (n, a), (_, b) in zip(trainer.state_dict().items(), third.state_dict().items()):
        assert torch.equal(a, b), n


def test_qwen2_trainer_to_vllm_style_rollout_gqa_kv_replicated():
    """transformers Qwen2 trainer (1 kv head) -> vLLM-style TP=2 rollout (kv head on both ranks)."""
    trainer = qwen2(0)
    _perturb(trainer)
    src = from_module(trainer)
    full = {n: t for n, (t, _) in src.items()}
    assert check_entries(src, full) == sum(p.numel() for p in trainer.parameters())
    cfg = dict(vocab=131, hidden=64, heads=4, kv_heads=1, head_dim=16, inter=48, layers=2, qkv_bias=True)
    assert set(hf_shapes(cfg)) == set(full)
    dests, models = [], []
    for r in range(2):
        m = VllmStyleModel(cfg, tp=2, rank=r)
        dests.append(trace_load_weights(m, m.load_weights, hf_shapes(cfg)).bind(m))
        models.append(m)
    plan_transfer([src], dests)
    assert_like_loaded(models, cfg, full)


def test_qwen2_rollout_from_module_matches_trace():
    from wbridge.integrations.transformers import trace

    m = qwen2(0)
    traced = trace(m)
    plain = from_module(m)
    from planner.compiler import pieces_for

    assert set(plain) == set(traced.entries)
    for n, (t, d) in plain.items():
        ((view, td),) = traced.entries[n]
        assert view == () and pieces_for(n, d, t.shape) == pieces_for(n, td, t.shape), n
    rollout = qwen2(3)
    plan_transfer([plain], [from_module(rollout)])
    for (n, a), (_, b) in zip(m.state_dict().items(), rollout.state_dict().items()):
        assert np.array_equal(a.numpy(), b.numpy()), n
