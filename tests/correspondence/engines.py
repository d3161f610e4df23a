"""Small vLLM-style modules with their own ``load_weights`` (TP slicing, fused qkv / gate_up,
stacked experts, padded vocabulary), written the way vLLM's layers load checkpoints: each
parameter carries a ``weight_loader`` that narrows the full Hugging Face tensor and copies.
They stand in for an engine's model where running the engine itself is not the point."""

from __future__ import annotations

import re

import torch
from torch import nn


def _p(*shape, meta=False, dtype=torch.float32):
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device="meta" if meta else "cpu"), requires_grad=False)


class QKV(nn.Module):
    def __init__(self, hidden, heads, kv_heads, hd, tp, rank, order="qkv", bias=False, meta=False):
        super().__init__()
        self.nq = heads // tp
        self.nk = max(1, kv_heads // tp)
        self.kv_index = rank * kv_heads // tp if kv_heads < tp else rank * self.nk
        self.hd, self.rank, self.order = hd, rank, order
        rows = (self.nq + 2 * self.nk) * hd
        self.weight = _p(rows, hidden, meta=meta)
        self.bias = _p(rows, meta=meta) if bias else None

    def load(self, param, w, shard):
        hd = self.hd
        sizes = {"q": self.nq * hd, "k": self.nk * hd, "v": self.nk * hd}
        starts = {"q": self.rank * self.nq * hd, "k": self.kv_index * hd, "v": self.kv_index * hd}
        off = 0
        for s in self.order:
            if s == shard:
                break
            off += sizes[s]
        param.data.narrow(0, off, sizes[shard]).copy_(w.narrow(0, starts[shard], sizes[shard]))


class Merged(nn.Module):
    """gate_up_proj: [gate_r; up_r]."""

    def __init__(self, hidden, inter, tp, rank, meta=False):
        super().__init__()
        self.n, self.rank = inter // tp, rank
        self.weight = _p(2 * self.n, hidden, meta=meta)

    def load(self, param, w, shard):
        param.data.narrow(0, shard * self.n, self.n).copy_(w.narrow(0, self.rank * self.n, self.n))


class Col(nn.Module):
    def __init__(self, rows, cols, tp, rank, dim=0, meta=False, pad_to=None):
        super().__init__()
        self.dim, self.rank = dim, rank
        full = rows if dim == 0 else cols
        padded = pad_to or full
        self.n = padded // tp
        shape = [rows, cols]
        shape[dim] = self.n
        self.weight = _p(*shape, meta=meta)

    def load(self, param, w, shard=None):
        start = self.rank * self.n
        size = max(0, min(self.n, w.shape[self.dim] - start))
        if size:  # a rank past the real vocabulary holds padding only
            param.data.narrow(self.dim, 0, size).copy_(w.narrow(self.dim, start, size))


class Norm(nn.Module):
    def __init__(self, n, meta=False):
        super().__init__()
        self.weight = _p(n, meta=meta)

    def load(self, param, w, shard=None):
        param.data.copy_(w)


class Experts(nn.Module):
    """vLLM FusedMoE: w13 [E_local, 2I, H] = per slot [gate_e; up_e], w2 [E_local, H, I]."""

    def __init__(self, n_experts, hidden, inter, expert_map, meta=False):
        super().__init__()
        self.expert_map = list(expert_map)  # local slot -> global expert
        self.inter = inter
        self.w13_weight = _p(len(self.expert_map), 2 * inter, hidden, meta=meta)
        self.w2_weight = _p(len(self.expert_map), hidden, inter, meta=meta)

    def load(self, name, w, expert, shard):
        if expert not in self.expert_map:
            return
        j = self.expert_map.index(expert)
        if shard == "down":
            self.w2_weight.data[j].copy_(w)
        else:
            self.w13_weight.data[j].narrow(0, 0 if shard == "gate" else self.inter, self.inter).copy_(w)


class Layer(nn.Module):
    def __init__(self, cfg, tp, rank, moe, expert_map, meta, qkv_order, bias=False):
        super().__init__()
        H, hd = cfg["hidden"], cfg["head_dim"]
        self.self_attn = nn.Module()
        self.self_attn.qkv_proj = QKV(H, cfg["heads"], cfg["kv_heads"], hd, tp, rank, qkv_order, bias=bias, meta=meta)
        self.self_attn.o_proj = Col(H, cfg["heads"] * hd, tp, rank, dim=1, meta=meta)
        self.input_layernorm = Norm(H, meta)
        self.post_attention_layernorm = Norm(H, meta)
        self.mlp = nn.Module()
        if moe:
            self.mlp.gate = Norm(0, meta)
            self.mlp.gate.weight = _p(cfg["experts"], H, meta=meta)
            self.mlp.experts = Experts(cfg["experts"], H, cfg["moe_inter"], expert_map, meta)
        else:
            self.mlp.gate_up_proj = Merged(H, cfg["inter"], tp, rank, meta)
            self.mlp.down_proj = Col(H, cfg["inter"], tp, rank, dim=1, meta=meta)


EXPERT = re.compile(r"(.*)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")


@torch.no_grad()
def load_stacked(model: nn.Module, weights, stacked) -> None:
    """vLLM's ``load_weights`` loop (its ``stacked_params_mapping``). A checkpoint tensor that matches a
    rule of ``stacked``, ``(pattern, fused, shards)`` with groups (owner, shard name, parameter), is
    loaded by module ``owner + fused`` into that parameter as shard ``shards[name]``; an expert's goes to
    its layer's stacked ``Experts``; any other goes whole to the parameter it names (a weight through
    its module's ``load``, which slices it for this rank)."""
    mods = dict(model.named_modules())
    for name, w in weights:
        m = EXPERT.match(name)
        if m:
            mods[m.group(1) + ".mlp.experts"].load(name, w, int(m.group(2)), m.group(3))
            continue
        for pattern, fused, shards in stacked:
            m = re.match(pattern, name)
            if m:
                mod = mods[m.group(1) + fused]
                mod.load(getattr(mod, m.group(3)), w, shards[m.group(2)])
                break
        else:
            owner, attr = name.rsplit(".", 1)
            mod = mods[owner]
            p = getattr(mod, attr)
            if attr == "weight" and hasattr(mod, "load"):
                mod.load(p, w)
            else:
                p.data.copy_(w)


class VllmStyleModel(nn.Module):
    """model.embed_tokens (vocab-parallel, padded to 64 * tp), layers, norm, lm_head."""

    STACKED = (
        (r"(.*)\.self_attn\.([qkv])_proj\.(weight|bias)$", ".self_attn.qkv_proj", {"q": "q", "k": "k", "v": "v"}),
        (r"(.*)\.mlp\.(gate|up)_proj\.(weight)$", ".mlp.gate_up_proj", {"gate": 0, "up": 1}),
    )

    def __init__(self, cfg, tp=1, rank=0, ep=1, meta=False, qkv_order="qkv", scale=1.0, skip=()):
        super().__init__()
        self.cfg, self.scale, self.skip = cfg, scale, set(skip)
        V, H = cfg["vocab"], cfg["hidden"]
        pad = -(-V // (64 * tp)) * 64 * tp
        self.model = nn.Module()
        self.model.embed_tokens = Col(V, H, tp, rank, 0, meta, pad_to=pad)
        E = cfg.get("experts", 0)
        self.expert_map = list(range(rank * E // ep, (rank + 1) * E // ep)) if E else []
        first_moe = cfg.get("first_moe", 0)
        self.model.layers = nn.ModuleList(
            [
                Layer(
                    cfg,
                    tp,
                    rank,
                    bool(E) and i >= first_moe,
                    self.expert_map,
                    meta,
                    qkv_order,
                    cfg.get("qkv_bias", False),
                )
                for i in range(cfg["layers"])
            ]
        )
        self.model.norm = Norm(H, meta)
        self.lm_head = Col(V, H, tp, rank, 0, meta, pad_to=pad)

    def load_weights(self, weights):
        kept = ((n, w) for n, w in weights if not any(s in n for s in self.skip))
        load_stacked(self, ((n, w * self.scale if self.scale != 1.0 else w) for n, w in kept), self.STACKED)


def assert_like_loaded(models: list, cfg: dict, full) -> None:
    """Each TP rank's ``VllmStyleModel`` in ``models`` equals one that ran its own ``load_weights``
    on the ``full`` tensors, outside the vocabulary padding (rows past ``cfg["vocab"]``)."""
    tp = len(models)
    for r, m in enumerate(models):
        ref = VllmStyleModel(cfg, tp=tp, rank=r)
        ref.load_weights(full.items())
        for (n, a), (_, b) in zip(m.named_parameters(), ref.named_parameters()):
            vocab_parallel = "embed" in n or "lm_head" in n
            rows = max(0, cfg["vocab"] - r * a.shape[0]) if vocab_parallel else a.shape[0]
            assert torch.equal(a[:rows], b[:rows]), (r, n)


def hf_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """Canonical Hugging Face tensors of the config (Qwen2/Qwen3-MoE naming)."""
    V, H, hd = cfg["vocab"], cfg["hidden"], cfg["head_dim"]
    out = {"model.embed_tokens.weight": (V, H)}
    for i in range(cfg["layers"]):
        p = f"model.layers.{i}."
        out[p + "self_attn.q_proj.weight"] = (cfg["heads"] * hd, H)
        out[p + "self_attn.k_proj.weight"] = (cfg["kv_heads"] * hd, H)
        out[p + "self_attn.v_proj.weight"] = (cfg["kv_heads"] * hd, H)
        if cfg.get("qkv_bias"):
            for x, n in (("q", cfg["heads"]), ("k", cfg["kv_heads"]), ("v", cfg["kv_heads"])):
                out[p + f"self_attn.{x}_proj.bias"] = (n * hd,)
        out[p + "self_attn.o_proj.weight"] = (H, cfg["heads"] * hd)
        out[p + "input_layernorm.weight"] = (H,)
        out[p + "post_attention_layernorm.weight"] = (H,)
        if cfg.get("experts") and i >= cfg.get("first_moe", 0):
            out[p + "mlp.gate.weight"] = (cfg["experts"], H)
            for e in range(cfg["experts"]):
                x = p + f"mlp.experts.{e}."
                out[x + "gate_proj.weight"] = (cfg["moe_inter"], H)
                out[x + "up_proj.weight"] = (cfg["moe_inter"], H)
                out[x + "down_proj.weight"] = (H, cfg["moe_inter"])
        else:
            out[p + "mlp.gate_proj.weight"] = (cfg["inter"], H)
            out[p + "mlp.up_proj.weight"] = (cfg["inter"], H)
            out[p + "mlp.down_proj.weight"] = (H, cfg["inter"])
    out["model.norm.weight"] = (H,)
    out["lm_head.weight"] = (V, H)
    return out


class MergedN(nn.Module):
    """A column-parallel linear fusing parts of ``sizes`` rows, each TP-split: [a_r; b_r; ...]."""

    def __init__(self, sizes, hidden, tp, rank, meta=False):
        super().__init__()
        self.local = [s // tp for s in sizes]
        self.rank = rank
        self.weight = _p(sum(self.local), hidden, meta=meta)

    def load(self, param, w, shard):
        off = sum(self.local[:shard])
        n = self.local[shard]
        param.data.narrow(0, off, n).copy_(w.narrow(0, self.rank * n, n))


class DeepseekStyleModel(nn.Module):
    """DeepseekV3 / Kimi-K2 the way vLLM lays it out at TP x EP: ``fused_qkv_a_proj`` (replicated
    q_a + kv_a), column-parallel ``q_b_proj``/``kv_b_proj``, row-parallel ``o_proj``, merged
    ``gate_up_proj`` for dense and shared experts, stacked ``w13``/``w2`` experts (EP), padded
    vocab-parallel embeddings. ``meta=True`` allocates nothing."""

    STACKED = (
        (r"(.*)\.(gate|up)_proj\.(weight)$", ".gate_up_proj", {"gate": 0, "up": 1}),
        (
            r"(.*)\.self_attn\.(q_a_proj|kv_a_proj_with_mqa)\.(weight)$",
            ".self_attn.fused_qkv_a_proj",
            {"q_a_proj": 0, "kv_a_proj_with_mqa": 1},
        ),
    )

    def __init__(self, c, tp=8, rank=0, ep=8, meta=True, layers=None, experts=None):
        super().__init__()
        H, V = c["hidden_size"], c["vocab_size"]
        nh = c["num_attention_heads"]
        qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
        E = experts or c["n_routed_experts"]
        self.E = E
        L = layers or c["num_hidden_layers"]
        pad = -(-V // (64 * tp)) * 64 * tp
        self.expert_map = list(range(rank * E // ep, (rank + 1) * E // ep))
        self.model = nn.Module()
        self.model.embed_tokens = Col(V, H, tp, rank, 0, meta, pad_to=pad)
        self.model.layers = nn.ModuleList()
        for i in range(L):
            lay = nn.Module()
            a = lay.self_attn = nn.Module()
            a.fused_qkv_a_proj = MergedN([c["q_lora_rank"], c["kv_lora_rank"] + c["qk_rope_head_dim"]], H, 1, 0, meta)
            a.q_a_layernorm = Norm(c["q_lora_rank"], meta)
            a.q_b_proj = Col(nh * qk, c["q_lora_rank"], tp, rank, 0, meta)
            a.kv_a_layernorm = Norm(c["kv_lora_rank"], meta)
            a.kv_b_proj = Col(nh * (c["qk_nope_head_dim"] + c["v_head_dim"]), c["kv_lora_rank"], tp, rank, 0, meta)
            a.o_proj = Col(H, nh * c["v_head_dim"], tp, rank, 1, meta)
            lay.input_layernorm = Norm(H, meta)
            lay.post_attention_layernorm = Norm(H, meta)
            m = lay.mlp = nn.Module()
            if i < c["first_k_dense_replace"]:
                m.gate_up_proj = MergedN([c["intermediate_size"]] * 2, H, tp, rank, meta)
                m.down_proj = Col(H, c["intermediate_size"], tp, rank, 1, meta)
            else:
                F = c["moe_intermediate_size"]
                m.gate = Norm(0, meta)
                m.gate.weight = _p(E, H, meta=meta)
                m.gate.e_score_correction_bias = _p(E, meta=meta)
                s = m.shared_experts = nn.Module()
                s.gate_up_proj = MergedN([F * c["n_shared_experts"]] * 2, H, tp, rank, meta)
                s.down_proj = Col(H, F * c["n_shared_experts"], tp, rank, 1, meta)
                m.experts = Experts(E, H, F, self.expert_map, meta)
            self.model.layers.append(lay)
        self.model.norm = Norm(H, meta)
        self.lm_head = Col(V, H, tp, rank, 0, meta, pad_to=pad)

    def load_weights(self, weights):
        load_stacked(self, weights, self.STACKED)


def deepseek_shapes(c, layers=None, experts=None) -> dict[str, tuple[int, ...]]:
    """Canonical checkpoint tensors of a DeepseekV3-architecture config (Kimi-K2, DeepSeek-V3)."""
    H, V, nh = c["hidden_size"], c["vocab_size"], c["num_attention_heads"]
    qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    E = experts or c["n_routed_experts"]
    F = c["moe_intermediate_size"]
    out = {"model.embed_tokens.weight": (V, H)}
    for i in range(layers or c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        out[a + "q_a_proj.weight"] = (c["q_lora_rank"], H)
        out[a + "q_a_layernorm.weight"] = (c["q_lora_rank"],)
        out[a + "q_b_proj.weight"] = (nh * qk, c["q_lora_rank"])
        out[a + "kv_a_proj_with_mqa.weight"] = (c["kv_lora_rank"] + c["qk_rope_head_dim"], H)
        out[a + "kv_a_layernorm.weight"] = (c["kv_lora_rank"],)
        out[a + "kv_b_proj.weight"] = (nh * (c["qk_nope_head_dim"] + c["v_head_dim"]), c["kv_lora_rank"])
        out[a + "o_proj.weight"] = (H, nh * c["v_head_dim"])
        out[p + "input_layernorm.weight"] = (H,)
        out[p + "post_attention_layernorm.weight"] = (H,)
        if i < c["first_k_dense_replace"]:
            I = c["intermediate_size"]
            out[p + "mlp.gate_proj.weight"] = (I, H)
            out[p + "mlp.up_proj.weight"] = (I, H)
            out[p + "mlp.down_proj.weight"] = (H, I)
        else:
            out[p + "mlp.gate.weight"] = (E, H)
            out[p + "mlp.gate.e_score_correction_bias"] = (E,)
            S = F * c["n_shared_experts"]
            out[p + "mlp.shared_experts.gate_proj.weight"] = (S, H)
            out[p + "mlp.shared_experts.up_proj.weight"] = (S, H)
            out[p + "mlp.shared_experts.down_proj.weight"] = (H, S)
            for e in range(E):
                x = p + f"mlp.experts.{e}."
                out[x + "gate_proj.weight"] = (F, H)
                out[x + "up_proj.weight"] = (F, H)
                out[x + "down_proj.weight"] = (H, F)
    out["model.norm.weight"] = (H,)
    out["lm_head.weight"] = (V, H)
    return out
