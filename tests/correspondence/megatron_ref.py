"""Megatron-core tensors built from full Hugging Face tensors by Megatron's own conventions,
written independently of ``wbridge.integrations.megatron`` (reshape/cat/chunk), so tests compare two codes."""

from __future__ import annotations

import torch


def megatron_rank_tensors(full, cfg, tp_rank, tp, ep_rank=0, ep=1, divisible_by=128, pp_rank=0, pp=1):
    H, hd, nh, ng = cfg["hidden"], cfg["head_dim"], cfg["heads"], cfg["kv_heads"]
    out = {}
    V = cfg["vocab"]
    padded = -(-V // (divisible_by * tp)) * divisible_by * tp

    def vocab(w):
        p = torch.full((padded, H), float("nan"), dtype=w.dtype)  # padding rows: never read
        p[:V] = w
        return p.chunk(tp)[tp_rank].clone()

    L = cfg["layers"]
    per = L // pp
    layers = range(pp_rank * per, (pp_rank + 1) * per)
    if pp_rank == 0:
        out["embedding.word_embeddings.weight"] = vocab(full["model.embed_tokens.weight"])
    if pp_rank == pp - 1:
        out["output_layer.weight"] = vocab(full["lm_head.weight"])
        out["decoder.final_layernorm.weight"] = full["model.norm.weight"].clone()
    for j, i in enumerate(layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{j}."
        q = full[h + "self_attn.q_proj.weight"].view(ng, nh // ng * hd, H)
        k = full[h + "self_attn.k_proj.weight"].view(ng, hd, H)
        v = full[h + "self_attn.v_proj.weight"].view(ng, hd, H)
        qkv = torch.cat([q, k, v], dim=1).reshape(-1, H)
        out[m + "self_attention.linear_qkv.weight"] = qkv.chunk(tp)[tp_rank].clone()
        out[m + "self_attention.linear_qkv.layer_norm_weight"] = full[h + "input_layernorm.weight"].clone()
        out[m + "self_attention.linear_proj.weight"] = full[h + "self_attn.o_proj.weight"].chunk(tp, 1)[tp_rank].clone()
        moe = cfg.get("experts") and i >= cfg.get("first_moe", 0)
        if moe:
            E = cfg["experts"]
            out[m + "pre_mlp_layernorm.weight"] = full[h + "post_attention_layernorm.weight"].clone()
            out[m + "mlp.router.weight"] = full[h + "mlp.gate.weight"].clone()
            for jj, e in enumerate(range(ep_rank * E // ep, (ep_rank + 1) * E // ep)):
                x = h + f"mlp.experts.{e}."
                y = m + f"mlp.experts.local_experts.{jj}."
                out[y + "linear_fc1.weight"] = torch.cat(
                    [full[x + "gate_proj.weight"], full[x + "up_proj.weight"]]
                ).clone()
                out[y + "linear_fc2.weight"] = full[x + "down_proj.weight"].clone()
        else:
            g = full[h + "mlp.gate_proj.weight"].chunk(tp)[tp_rank]
            u = full[h + "mlp.up_proj.weight"].chunk(tp)[tp_rank]
            out[m + "mlp.linear_fc1.weight"] = torch.cat([g, u]).clone()
            out[m + "mlp.linear_fc1.layer_norm_weight"] = full[h + "post_attention_layernorm.weight"].clone()
            out[m + "mlp.linear_fc2.weight"] = full[h + "mlp.down_proj.weight"].chunk(tp, 1)[tp_rank].clone()
    return out


def megatron_config(cfg, tp_rank, tp, ep_rank=0, ep=1, pp_rank=0, pp=1):
    from wbridge.integrations.megatron import MegatronGPT

    E = cfg.get("experts", 0)
    return MegatronGPT(
        hidden=cfg["hidden"],
        num_layers=cfg["layers"],
        num_heads=cfg["heads"],
        num_kv_heads=cfg["kv_heads"],
        head_dim=cfg["head_dim"],
        ffn=cfg["inter"],
        vocab=cfg["vocab"],
        tp_rank=tp_rank,
        tp_size=tp,
        pp_rank=pp_rank,
        pp_size=pp,
        ep_rank=ep_rank,
        ep_size=ep,
        num_experts=E,
        moe_ffn=cfg.get("moe_inter", 0),
        moe_layers=tuple(range(cfg.get("first_moe", 0), cfg["layers"])) if E else None,
    )
