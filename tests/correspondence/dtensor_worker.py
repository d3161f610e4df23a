"""One trainer rank of the DTensor tests: builds FSDP2 / TP / FSDP2 x TP sharded models on gloo,
runs ``from_dtensor`` and writes its entries (local arrays + declarations) and, on rank 0, the
full tensors to ``OUT/rank{r}.pt``. Run as ``python dtensor_worker.py RANK WORLD PORT OUT MODEL``.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from wbridge.integrations.dtensor import from_dtensor  # run with the repo on PYTHONPATH (run_ranks)
from wbridge.protocol.declarations import decl_to_dict


def tiny_qwen2(hf: bool) -> torch.nn.Module:
    """A tiny Qwen2 (GQA: 4 query heads, 1 kv head, head_dim 32) with Hugging Face names.

    ``hf=True`` builds the transformers model; otherwise plain ``nn.Linear`` modules named alike
    (the same parameter names and shapes, imports in a second instead of twenty)."""
    torch.manual_seed(0)
    if hf:
        from transformers import Qwen2ForCausalLM

        from wbridge.testing.hf import qwen2_config

        cfg = qwen2_config(vocab_size=131, intermediate_size=96, num_key_value_heads=1)
        return Qwen2ForCausalLM(cfg).float()
    nn = torch.nn
    H, I, V, hd = 128, 96, 131, 32

    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj = nn.Linear(H, 4 * hd)
            self.k_proj = nn.Linear(H, hd)
            self.v_proj = nn.Linear(H, hd)
            self.o_proj = nn.Linear(4 * hd, H, bias=False)

    class Mlp(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_proj = nn.Linear(H, I, bias=False)
            self.up_proj = nn.Linear(H, I, bias=False)
            self.down_proj = nn.Linear(I, H, bias=False)

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.self_attn, self.mlp = Attn(), Mlp()
            self.input_layernorm = nn.LayerNorm(H, bias=False)
            self.post_attention_layernorm = nn.LayerNorm(H, bias=False)

    class Inner(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = nn.Embedding(V, H)
            self.layers = nn.ModuleList([Layer(), Layer()])
            self.norm = nn.LayerNorm(H, bias=False)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = Inner()
            self.lm_head = nn.Linear(H, V, bias=False)

    m = Model()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_()
    return m


TP_PLAN = {
    "self_attn.q_proj": "col",
    "self_attn.k_proj": "col",
    "self_attn.v_proj": "col",
    "self_attn.o_proj": "row",
    "mlp.gate_proj": "col",
    "mlp.up_proj": "col",
    "mlp.down_proj": "row",
}


def apply_tp(model: torch.nn.Module, tp_mesh) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {}
    for i, _ in enumerate(model.model.layers):
        for k, v in TP_PLAN.items():
            plan[f"model.layers.{i}.{k}"] = ColwiseParallel() if v == "col" else RowwiseParallel()
    plan["model.embed_tokens"] = RowwiseParallel()  # vocab-parallel embedding: Shard(0)
    plan["lm_head"] = ColwiseParallel()
    parallelize_module(model, tp_mesh, plan)


def dump(entries, full, path) -> None:
    torch.save(
        {
            "entries": {k: (t.detach().clone(), decl_to_dict(d)) for k, (t, d) in entries.items()},
            "full": full,
        },
        path,
    )


def main() -> None:
    rank, world, port, out, model_kind = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=__import__("datetime").timedelta(seconds=60),
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    hf = model_kind == "hf"
    results = {}

    # 1) FSDP2 alone over 4 ranks: Shard(0), uneven (131-row embedding, 32-row k_proj...).
    mesh1 = init_device_mesh("cpu", (world,))
    m = tiny_qwen2(hf)
    full = {k: v.detach().clone() for k, v in m.state_dict().items()}
    for layer in m.model.layers:
        fully_shard(layer, mesh=mesh1)
    fully_shard(m, mesh=mesh1)
    results["fsdp"] = (from_dtensor(m.state_dict()), full)

    # 2) FSDP2 x TP on a (dp=2, tp=2) mesh: _StridedShard(0) x Shard(0) for colwise weights,
    #    Shard(0) x Shard(1) for rowwise ones; kv heads (1) fewer than TP ranks (2).
    mesh2 = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    m = tiny_qwen2(hf)
    full = {k: v.detach().clone() for k, v in m.state_dict().items()}
    apply_tp(m, mesh2["tp"])
    for layer in m.model.layers:
        fully_shard(layer, mesh=mesh2["dp"])
    fully_shard(m, mesh=mesh2["dp"])
    results["fsdp_tp"] = (from_dtensor(m.state_dict()), full)

    # 3) Raw placements: Replicate x Shard(1), Shard(1) x Shard(1) (uneven), a _StridedShard whose
    #    rows are two separate runs (a Fused declaration).
    g = torch.Generator().manual_seed(1)
    a = torch.randn(6, 10, generator=g)
    b = torch.randn(5, 11, generator=g)
    c = torch.randn(7, 3, generator=g)
    d = torch.randn(8, 3, generator=g)
    tensors = {
        "a": distribute_tensor(a, mesh2, [Replicate(), Shard(1)]),
        "b": distribute_tensor(b, mesh2, [Shard(1), Shard(1)]),
        "c": distribute_tensor(c, mesh2, [Shard(0), Replicate()]),
        "d": distribute_tensor(d, mesh2, [_StridedShard(0, split_factor=2), Replicate()]),
    }
    results["raw"] = (from_dtensor(tensors), {"a": a, "b": b, "c": c, "d": d})

    # Local shards must agree with full_tensor() (the collective view of the same DTensors).
    for kind, (entries, full) in results.items():
        dump(entries, full, os.path.join(out, f"{kind}.rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
