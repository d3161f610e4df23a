"""Megatron-style trainer layouts, declared in Hugging Face (canonical) names.

Building blocks (each returns a planner declaration for the calling rank's local tensor):

- ``column_parallel`` / ``row_parallel``: a TP shard of dim 0 / dim 1.
- ``vocab_parallel``: a TP shard of a padded vocabulary (rows past the real vocabulary unmapped).
- ``qkv_interleaved``: Megatron's ``linear_qkv``, per query group ``[q_g; k_g; v_g]``, TP-split by
  groups. ``qkv_fused``: the rollout-engine layout ``[q_r; k_r; v_r]`` (vLLM ``qkv_proj``) with kv
  heads replicated when there are fewer kv heads than TP ranks.
  Both take ``QKVGeometry``'s keywords and call its ``interleaved`` / ``fused``.
- ``gate_up_fused``: ``linear_fc1`` / ``gate_up_proj``: ``[gate_r; up_r]``.
- ``pp_layers`` / ``ep_experts``: which global layers a PP stage holds, which global experts an EP
  rank holds.

``MegatronGPT`` puts them together for a GPT/Llama/Qwen-style model (dense or MoE): it names each
of the rank's Megatron parameters and gives its local shape and declaration, so
``MegatronGPT(...).entries(model.state_dict())`` is ready for ``Publisher.register``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from planner.layout import Declaration, Fused, Shard

from .. import _validate
from ..errors import LayoutError, UsageError


def _sizes(who: str, minimum: int = 1, **values: Any) -> None:
    """Each of ``values`` an integer >= ``minimum``; ``UsageError`` names ``who(keyword)``."""
    for key, value in values.items():
        _validate.integer(value, f"{who}({key})", minimum)


def _rank(who: str, rank_name: str, rank: Any, size_name: str, size: Any) -> None:
    """``0 <= rank < size``, both integers; ``UsageError`` names them."""
    _sizes(who, **{size_name: size})
    _sizes(who, 0, **{rank_name: rank})
    if rank >= size:
        raise UsageError(f"{who}({rank_name}={rank}) out of range for {size_name}={size}")


def _shape(who: str, shape: Any, ndim: int) -> tuple[int, ...]:
    """A shape of at least ``ndim`` dimensions, each an integer >= 1."""
    if isinstance(shape, (str, bytes)) or not isinstance(shape, Sequence) or len(shape) < ndim:
        raise UsageError(f"{who}(shape) must be a sequence of at least {ndim} sizes, got {shape!r:.80}")
    for i, n in enumerate(shape):
        _validate.integer(n, f"{who}(shape[{i}])", 1)
    return tuple(shape)


def _split(n: int, parts: int, rank: int, what: str) -> tuple[int, int]:
    if parts <= 0 or not 0 <= rank < parts:
        raise LayoutError(f"{what}: rank {rank} out of range for {parts} ranks")
    if n % parts:
        raise LayoutError(f"{what}: {n} is not divisible by {parts} ranks")
    size = n // parts
    return rank * size, size


def column_parallel(name: str, shape: Sequence[int], tp_rank: int, tp_size: int) -> Shard:
    """A TP shard of dim 0 (column-parallel linear weight or bias)."""
    shape = _shape("column_parallel", shape, 1)
    _rank("column_parallel", "tp_rank", tp_rank, "tp_size", tp_size)
    start, size = _split(shape[0], tp_size, tp_rank, name)
    return Shard(name, shape, (start,) + (0,) * (len(shape) - 1))


def row_parallel(name: str, shape: Sequence[int], tp_rank: int, tp_size: int) -> Shard:
    """A TP shard of dim 1 (row-parallel linear weight)."""
    shape = _shape("row_parallel", shape, 2)
    _rank("row_parallel", "tp_rank", tp_rank, "tp_size", tp_size)
    start, size = _split(shape[1], tp_size, tp_rank, name)
    return Shard(name, shape, (0, start) + (0,) * (len(shape) - 2))


def padded_vocab(vocab: int, tp_size: int, divisible_by: int = 128) -> int:
    """Megatron's padded vocabulary size: a multiple of ``divisible_by * tp_size``."""
    _sizes("padded_vocab", vocab=vocab, tp_size=tp_size, divisible_by=divisible_by)
    m = divisible_by * tp_size
    return -(-vocab // m) * m


def vocab_parallel(
    name: str, vocab: int, hidden: int, tp_rank: int, tp_size: int, divisible_by: int = 128
) -> tuple[tuple[int, int], Shard]:
    """Local shape and declaration of a vocab-parallel embedding / output layer shard.

    Rows past ``vocab`` (padding) are unmapped: never read, never written."""
    _sizes("vocab_parallel", vocab=vocab, hidden=hidden, divisible_by=divisible_by)
    _rank("vocab_parallel", "tp_rank", tp_rank, "tp_size", tp_size)
    start, rows = _split(padded_vocab(vocab, tp_size, divisible_by), tp_size, tp_rank, name)
    return (rows, hidden), Shard(name, (vocab, hidden), (start, 0), padded=True)


def _names(pattern: str | Sequence[str]) -> tuple[str, str, str]:
    if isinstance(pattern, str):
        return pattern.format("q"), pattern.format("k"), pattern.format("v")
    q, k, v = pattern
    return q, k, v


@dataclass(frozen=True, kw_only=True)
class QKVGeometry:
    """The q, k and v projections of one attention layer as one TP rank holds them: the keywords
    of ``qkv_interleaved`` and ``qkv_fused``, which build one and call its method of that name.

    hidden: the model width (the weights' second dimension; a bias has none)
    num_heads: query heads
    num_kv_heads: key/value heads (Megatron's query groups)
    head_dim: rows per head
    tp_rank: this rank's tensor-parallel rank
    tp_size: tensor-parallel ranks
    bias: declare the 1-D bias instead of the weight
    """

    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tp_rank: int
    tp_size: int
    bias: bool = False

    def __post_init__(self) -> None:
        who = "QKVGeometry"
        sizes = ("hidden", "num_heads", "num_kv_heads", "head_dim")
        _sizes(who, **{k: getattr(self, k) for k in sizes})
        _rank(who, "tp_rank", self.tp_rank, "tp_size", self.tp_size)
        _validate.boolean(self.bias, f"{who}(bias)")

    def heads(self, name: str, of: int, first: int, count: int) -> Shard:
        """Heads ``first .. first + count - 1`` of ``name``, a projection of ``of`` heads."""
        hd = self.head_dim
        tail = () if self.bias else (self.hidden,)
        zero = () if self.bias else (0,)
        return Shard(name, (of * hd,) + tail, (first * hd,) + zero, (count * hd,) + tail)

    def interleaved(self, names: str | Sequence[str]) -> Fused:
        """Megatron ``linear_qkv``; see ``qkv_interleaved``."""
        q, k, v = _names(names)
        if self.num_heads % self.num_kv_heads:
            raise LayoutError(f"{q}: {self.num_heads} heads not divisible by {self.num_kv_heads} query groups")
        g0, ng = _split(self.num_kv_heads, self.tp_size, self.tp_rank, f"{q} query groups")
        hpg = self.num_heads // self.num_kv_heads
        parts: list[Shard] = []
        for g in range(g0, g0 + ng):
            parts += [
                self.heads(q, self.num_heads, g * hpg, hpg),
                self.heads(k, self.num_kv_heads, g, 1),
                self.heads(v, self.num_kv_heads, g, 1),
            ]
        return Fused(0, tuple(parts))

    def fused(self, names: str | Sequence[str]) -> Fused:
        """A rollout engine's ``qkv_proj``; see ``qkv_fused``."""
        q, k, v = _names(names)
        q0, nq = _split(self.num_heads, self.tp_size, self.tp_rank, f"{q} heads")
        if self.num_kv_heads >= self.tp_size:
            k0, nk = _split(self.num_kv_heads, self.tp_size, self.tp_rank, f"{k} heads")
        else:
            if self.tp_size % self.num_kv_heads:
                raise LayoutError(f"{k}: {self.tp_size} TP ranks not divisible by {self.num_kv_heads} kv heads")
            k0, nk = self.tp_rank * self.num_kv_heads // self.tp_size, 1
        kv = self.num_kv_heads
        return Fused(0, (self.heads(q, self.num_heads, q0, nq), self.heads(k, kv, k0, nk), self.heads(v, kv, k0, nk)))


def qkv_interleaved(names: str | Sequence[str], **geometry: int) -> Fused:
    """Megatron ``linear_qkv``: per query group ``[q_g (heads/groups rows of heads); k_g; v_g]``.

    ``names`` is a pattern with ``{}`` for q/k/v or a (q, k, v) triple; the keywords are
    ``QKVGeometry``'s (``hidden``, ``num_heads``, ``num_kv_heads``, ``head_dim``, ``tp_rank``,
    ``tp_size``, optional ``bias``). TP splits the groups, so ``num_kv_heads`` must be divisible by
    ``tp_size``. ``bias=True`` declares the 1-D bias."""
    return QKVGeometry(**geometry).interleaved(names)


def qkv_fused(names: str | Sequence[str], **geometry: int) -> Fused:
    """A rollout engine's ``qkv_proj`` (vLLM ``QKVParallelLinear``): ``[q_r; k_r; v_r]``.

    ``names`` and the keywords as for ``qkv_interleaved``. With fewer kv heads than TP ranks each
    kv head is replicated on ``tp_size / num_kv_heads`` consecutive ranks (rank ``r`` holds kv head
    ``r * num_kv_heads // tp_size``)."""
    return QKVGeometry(**geometry).fused(names)


def gate_up_fused(names: str | Sequence[str], *, hidden: int, intermediate: int, tp_rank: int, tp_size: int) -> Fused:
    """Megatron ``linear_fc1`` / engine ``gate_up_proj``: ``[gate_r; up_r]`` (each a TP row shard)."""
    _sizes("gate_up_fused", hidden=hidden, intermediate=intermediate)
    _rank("gate_up_fused", "tp_rank", tp_rank, "tp_size", tp_size)
    if isinstance(names, str):
        gate, up = names.format("gate"), names.format("up")
    else:
        gate, up = names
    start, size = _split(intermediate, tp_size, tp_rank, gate)
    shape = (intermediate, hidden)
    return Fused(0, (Shard(gate, shape, (start, 0), (size, hidden)), Shard(up, shape, (start, 0), (size, hidden))))


def pp_layers(num_layers: int, pp_rank: int, pp_size: int, first_stage_layers: int | None = None) -> range:
    """Global layer indices held by pipeline stage ``pp_rank`` (even split; optionally an uneven
    first stage as Megatron's ``decoder_first_pipeline_num_layers``)."""
    _sizes("pp_layers", num_layers=num_layers)
    _rank("pp_layers", "pp_rank", pp_rank, "pp_size", pp_size)
    if first_stage_layers is not None:
        _sizes("pp_layers", 0, first_stage_layers=first_stage_layers)
        if first_stage_layers > num_layers:
            raise UsageError(f"pp_layers(first_stage_layers={first_stage_layers}) exceeds num_layers={num_layers}")
    if first_stage_layers is None:
        start, n = _split(num_layers, pp_size, pp_rank, "decoder layers")
        return range(start, start + n)
    rest = num_layers - first_stage_layers
    if pp_rank == 0:
        return range(0, first_stage_layers)
    start, n = _split(rest, pp_size - 1, pp_rank - 1, "decoder layers after the first stage")
    return range(first_stage_layers + start, first_stage_layers + start + n)


def ep_experts(num_experts: int, ep_rank: int, ep_size: int) -> range:
    """Global expert indices held by expert-parallel rank ``ep_rank`` (contiguous blocks)."""
    _sizes("ep_experts", 0, num_experts=num_experts)
    _rank("ep_experts", "ep_rank", ep_rank, "ep_size", ep_size)
    start, n = _split(num_experts, ep_size, ep_rank, "experts")
    return range(start, start + n)


@dataclass(frozen=True)
class MegatronGPT:
    """A Megatron-core GPT model (TE layer spec) and one rank's position in TP x PP x EP.

    Canonical names are Hugging Face Llama/Qwen names (``model.layers.{i}.self_attn.q_proj.weight``;
    MoE experts ``model.layers.{i}.mlp.experts.{e}.gate_proj.weight``). ``moe_layers=None`` means
    every layer is MoE when ``num_experts`` is set. Expert weights are TP=1 inside EP (ETP=1).
    """

    hidden: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1
    num_experts: int = 0
    moe_ffn: int = 0
    moe_layers: tuple[int, ...] | None = None
    qkv_bias: bool = False
    qk_norm: bool = False
    tie_embeddings: bool = False
    vocab_divisible_by: int = 128

    def __post_init__(self) -> None:
        who = "MegatronGPT"
        sizes = ("hidden", "num_layers", "num_heads", "num_kv_heads", "head_dim", "ffn", "vocab", "vocab_divisible_by")
        _sizes(who, **{k: getattr(self, k) for k in sizes})
        _sizes(who, 0, num_experts=self.num_experts, moe_ffn=self.moe_ffn)
        for kind in ("tp", "pp", "ep"):
            _rank(who, f"{kind}_rank", getattr(self, f"{kind}_rank"), f"{kind}_size", getattr(self, f"{kind}_size"))
        for flag in ("qkv_bias", "qk_norm", "tie_embeddings"):
            _validate.boolean(getattr(self, flag), f"{who}({flag})")
        if self.num_experts and not self.moe_ffn:
            raise UsageError(f"{who}: num_experts={self.num_experts} needs moe_ffn (the experts' width)")
        if self.moe_layers is not None:
            if not isinstance(self.moe_layers, tuple):
                got = f"{self.moe_layers!r:.80}"
                raise UsageError(f"{who}(moe_layers) must be a tuple of layer indices or None, got {got}")
            for i in self.moe_layers:
                _sizes(who, 0, moe_layers=i)

    def is_moe(self, layer: int) -> bool:
        if not self.num_experts:
            return False
        return self.moe_layers is None or layer in self.moe_layers

    def params(self) -> dict[str, tuple[tuple[int, ...], Declaration]]:
        """``{megatron local name: (local shape, declaration)}`` of this rank."""
        H, tp, r = self.hidden, self.tp_size, self.tp_rank
        out: dict[str, tuple[tuple[int, ...], Declaration]] = {}
        layers = pp_layers(self.num_layers, self.pp_rank, self.pp_size)
        first, last = self.pp_rank == 0, self.pp_rank == self.pp_size - 1
        if first:
            out["embedding.word_embeddings.weight"] = vocab_parallel(
                "model.embed_tokens.weight", self.vocab, H, r, tp, self.vocab_divisible_by
            )
        if last:
            out["decoder.final_layernorm.weight"] = ((H,), Shard("model.norm.weight", (H,)))
            if not self.tie_embeddings:
                out["output_layer.weight"] = vocab_parallel(
                    "lm_head.weight", self.vocab, H, r, tp, self.vocab_divisible_by
                )
        qd, kd = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        rows = (qd + 2 * kd) // tp
        qkv = QKVGeometry(
            hidden=H,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            tp_rank=r,
            tp_size=tp,
        )
        for local, g in enumerate(layers):
            m, h = f"decoder.layers.{local}.", f"model.layers.{g}."
            att = h + "self_attn.{}_proj"
            out[m + "self_attention.linear_qkv.weight"] = ((rows, H), qkv.interleaved(att + ".weight"))
            if self.qkv_bias:
                bias = replace(qkv, bias=True).interleaved(att + ".bias")
                out[m + "self_attention.linear_qkv.bias"] = ((rows,), bias)
            out[m + "self_attention.linear_qkv.layer_norm_weight"] = ((H,), Shard(h + "input_layernorm.weight", (H,)))
            out[m + "self_attention.linear_proj.weight"] = (
                (H, qd // tp),
                row_parallel(h + "self_attn.o_proj.weight", (H, qd), r, tp),
            )
            if self.qk_norm:
                for a, b in (("q", "q_layernorm"), ("k", "k_layernorm")):
                    out[m + f"self_attention.{b}.weight"] = (
                        (self.head_dim,),
                        Shard(h + f"self_attn.{a}_norm.weight", (self.head_dim,)),
                    )
            if self.is_moe(g):
                out[m + "pre_mlp_layernorm.weight"] = ((H,), Shard(h + "post_attention_layernorm.weight", (H,)))
                out[m + "mlp.router.weight"] = (
                    (self.num_experts, H),
                    Shard(h + "mlp.gate.weight", (self.num_experts, H)),
                )
                F = self.moe_ffn
                for j, e in enumerate(ep_experts(self.num_experts, self.ep_rank, self.ep_size)):
                    x, ex = m + f"mlp.experts.local_experts.{j}.", h + f"mlp.experts.{e}."
                    out[x + "linear_fc1.weight"] = (
                        (2 * F, H),
                        gate_up_fused(ex + "{}_proj.weight", hidden=H, intermediate=F, tp_rank=0, tp_size=1),
                    )
                    out[x + "linear_fc2.weight"] = ((H, F), Shard(ex + "down_proj.weight", (H, F)))
            else:
                out[m + "mlp.linear_fc1.layer_norm_weight"] = ((H,), Shard(h + "post_attention_layernorm.weight", (H,)))
                out[m + "mlp.linear_fc1.weight"] = (
                    (2 * self.ffn // tp, H),
                    gate_up_fused(h + "mlp.{}_proj.weight", hidden=H, intermediate=self.ffn, tp_rank=r, tp_size=tp),
                )
                out[m + "mlp.linear_fc2.weight"] = (
                    (H, self.ffn // tp),
                    row_parallel(h + "mlp.down_proj.weight", (H, self.ffn), r, tp),
                )
        return out

    def entries(
        self, state_dict: Mapping[str, Any], *, prefix: str = "", strict: bool = True
    ) -> dict[str, tuple[Any, Declaration]]:
        """Pairs the rank's live tensors (a Megatron state dict) with their declarations.

        Checks every tensor's shape against the declared local shape; with ``strict`` every
        expected parameter must be present and every floating tensor of the state dict known
        (``_extra_state`` entries are ignored). Errors name the parameter."""
        want = self.params()
        out: dict[str, tuple[Any, Declaration]] = {}
        for name, t in state_dict.items():
            key = name[len(prefix) :] if prefix and name.startswith(prefix) else name
            if key.endswith("_extra_state"):
                continue
            if key not in want:
                if strict:
                    raise LayoutError(
                        f"{name}: not a parameter of the declared Megatron layout "
                        f"(tp={self.tp_rank}/{self.tp_size}, pp={self.pp_rank}/{self.pp_size}, "
                        f"ep={self.ep_rank}/{self.ep_size})"
                    )
                continue
            shape, decl = want[key]
            if tuple(t.shape) != tuple(shape):
                raise LayoutError(f"{name}: local shape {tuple(t.shape)} differs from the declared {shape}")
            out[name] = (t, decl)
        missing = sorted(set(want) - {n[len(prefix) :] if prefix and n.startswith(prefix) else n for n in state_dict})
        if strict and missing:
            raise LayoutError(
                f"parameters missing from the state dict: {missing[:5]}{' ...' if len(missing) > 5 else ''}"
            )
        return out


def canonical_shapes(cfg: MegatronGPT) -> dict[str, tuple[int, ...]]:
    """Every canonical (Hugging Face) tensor the model has, with its shape."""
    H, qd, kd = cfg.hidden, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    out = {"model.embed_tokens.weight": (cfg.vocab, H), "model.norm.weight": (H,)}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = (cfg.vocab, H)
    for g in range(cfg.num_layers):
        h = f"model.layers.{g}."
        out[h + "self_attn.q_proj.weight"] = (qd, H)
        out[h + "self_attn.k_proj.weight"] = (kd, H)
        out[h + "self_attn.v_proj.weight"] = (kd, H)
        if cfg.qkv_bias:
            out[h + "self_attn.q_proj.bias"] = (qd,)
            out[h + "self_attn.k_proj.bias"] = (kd,)
            out[h + "self_attn.v_proj.bias"] = (kd,)
        out[h + "self_attn.o_proj.weight"] = (H, qd)
        if cfg.qk_norm:
            out[h + "self_attn.q_norm.weight"] = (cfg.head_dim,)
            out[h + "self_attn.k_norm.weight"] = (cfg.head_dim,)
        out[h + "input_layernorm.weight"] = (H,)
        out[h + "post_attention_layernorm.weight"] = (H,)
        if cfg.is_moe(g):
            out[h + "mlp.gate.weight"] = (cfg.num_experts, H)
            for e in range(cfg.num_experts):
                x = h + f"mlp.experts.{e}."
                out[x + "gate_proj.weight"] = (cfg.moe_ffn, H)
                out[x + "up_proj.weight"] = (cfg.moe_ffn, H)
                out[x + "down_proj.weight"] = (H, cfg.moe_ffn)
        else:
            out[h + "mlp.gate_proj.weight"] = (cfg.ffn, H)
            out[h + "mlp.up_proj.weight"] = (cfg.ffn, H)
            out[h + "mlp.down_proj.weight"] = (H, cfg.ffn)
    return out
