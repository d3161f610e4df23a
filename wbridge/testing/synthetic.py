"""A synthetic Llama/Qwen-style transformer for the demo, tests and benchmarks.

Values are a pure function of (canonical tensor, global element index, version), so any process can
compute what any of its local tensors must hold after a pull without the other side's help, and a
version's bytes differ from every other version's. With a change ``period`` p > 1 each element
changes only once every p versions (a fraction 1/p of the elements per version, each at its own
phase), as a trainer's small steps do: what delta updates are for.

Two ways from canonical tensors to a local layout, kept apart on purpose: ``fill_expected`` writes
a layout through the planner's mapping (``planner.compiler.pieces_for``, the code the transfer
plans with) and fills the publishers' tensors; ``expected_bits``, which ``mismatches`` checks pulls
against, builds each canonical tensor whole and cuts the layout out of it by plain numpy slicing and
concatenation. A mapping bug that moved the bytes and computed the expectation alike would pass a
check that used the mapping on both sides; against the slices it fails.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from planner.compiler import pieces_for
from planner.layout import Declaration, Fused, Shard, Stack, TensorSpec


@dataclass(frozen=True)
class ModelConfig:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    layers: int
    vocab: int
    dtype: str = "bfloat16"

    @classmethod
    def demo(cls) -> ModelConfig:
        """About 512 MiB in bf16."""
        return cls(hidden=2048, heads=16, kv_heads=4, head_dim=128, intermediate=5632, layers=4, vocab=16384)

    @classmethod
    def tiny(cls) -> ModelConfig:
        """About 1.5 MiB; GQA with 2 kv heads, vocabulary not divisible by 4."""
        return cls(hidden=128, heads=4, kv_heads=2, head_dim=32, intermediate=320, layers=2, vocab=1001)

    @classmethod
    def named(cls, name: str) -> ModelConfig:
        """One of ``MODELS``: ``tiny``, ``demo`` (above), and the benchmarks' ``256m``, ``512m``, ``1g``
        (Qwen-like, GQA 4:1: 2, 4 and 9 layers of hidden 2048, vocabularies of 8k, 16k and 32k; every
        split by TP=2 even)."""
        if name == "tiny":
            return cls.tiny()
        if name == "demo":
            return cls.demo()
        shapes = dict(hidden=2048, heads=16, kv_heads=4, head_dim=128, intermediate=5632)
        sized = {"256m": (2, 8192), "512m": (4, 16384), "1g": (9, 32768)}
        if name not in sized:
            raise ValueError(f"unknown model {name!r}; choose one of {MODELS}")
        layers, vocab = sized[name]
        return cls(**shapes, layers=layers, vocab=vocab)

    @classmethod
    def from_params(cls, params: int) -> ModelConfig:
        """A Llama-style model of about ``params`` parameters: the width of a Llama model of that
        size (hidden 2048 below 1.5B, 4096 below 11B, 5120 below 40B, 8192 above; GQA with 8 kv heads
        of 128, SwiGLU, untied embeddings of a 32k vocabulary, 128k from hidden 4096) and as many
        layers as it takes (at least one)."""
        if params <= 0:
            raise ValueError(f"a model has a positive number of parameters, not {params}")
        widths = ((1.5e9, 2048, 5632), (11e9, 4096, 14336), (40e9, 5120, 27648), (float("inf"), 8192, 28672))
        hidden, inter = next((h, i) for limit, h, i in widths if params < limit)
        vocab = 32768 if hidden == 2048 else 128256
        base = cls(hidden=hidden, heads=hidden // 128, kv_heads=min(8, hidden // 128 // 2), head_dim=128,
                   intermediate=inter, layers=1, vocab=vocab)  # fmt: skip
        per_layer = sum(s.numel for s in base.specs() if ".layers.0." in s.name)
        fixed = sum(s.numel for s in base.specs()) - per_layer
        layers = max(1, round((params - fixed) / per_layer))
        return cls(hidden=hidden, heads=hidden // 128, kv_heads=base.kv_heads, head_dim=128,
                   intermediate=inter, layers=layers, vocab=vocab)  # fmt: skip

    @property
    def params(self) -> int:
        return sum(s.numel for s in self.specs())

    def specs(self) -> list[TensorSpec]:
        h, q, kv, i = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.intermediate
        out = [TensorSpec("model.embed_tokens.weight", (self.vocab, h), self.dtype)]
        for n in range(self.layers):
            p = f"model.layers.{n}."
            out += [
                TensorSpec(p + "input_layernorm.weight", (h,), self.dtype),
                TensorSpec(p + "self_attn.q_proj.weight", (q, h), self.dtype),
                TensorSpec(p + "self_attn.k_proj.weight", (kv, h), self.dtype),
                TensorSpec(p + "self_attn.v_proj.weight", (kv, h), self.dtype),
                TensorSpec(p + "self_attn.o_proj.weight", (h, q), self.dtype),
                TensorSpec(p + "post_attention_layernorm.weight", (h,), self.dtype),
                TensorSpec(p + "mlp.gate_proj.weight", (i, h), self.dtype),
                TensorSpec(p + "mlp.up_proj.weight", (i, h), self.dtype),
                TensorSpec(p + "mlp.down_proj.weight", (h, i), self.dtype),
            ]
        out += [
            TensorSpec("model.norm.weight", (h,), self.dtype),
            TensorSpec("lm_head.weight", (self.vocab, h), self.dtype),
        ]
        return out

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.specs())


def _split(n: int, parts: int, k: int) -> tuple[int, int]:
    """Offset and size of part k of n split as evenly as possible (earlier parts larger)."""
    base, extra = divmod(n, parts)
    return k * base + min(k, extra), base + (1 if k < extra else 0)


def _row_shard(spec: TensorSpec, tp: int, rank: int) -> tuple[tuple[int, ...], Shard]:
    off, size = _split(spec.shape[0], tp, rank)
    shape = (size,) + spec.shape[1:]
    return shape, Shard(spec.name, spec.shape, (off,) + (0,) * (len(spec.shape) - 1))


def _col_shard(spec: TensorSpec, tp: int, rank: int) -> tuple[tuple[int, ...], Shard]:
    off, size = _split(spec.shape[1], tp, rank)
    return (spec.shape[0], size), Shard(spec.name, spec.shape, (0, off))


def _kv_rows(cfg: ModelConfig, spec: TensorSpec, tp: int, rank: int) -> tuple[int, int]:
    """Rows of k/v a TP rank holds: a head range, or one replicated head when kv_heads < tp."""
    if cfg.kv_heads >= tp:
        off, size = _split(cfg.kv_heads, tp, rank)
        return off * cfg.head_dim, size * cfg.head_dim
    head = rank * cfg.kv_heads // tp
    return head * cfg.head_dim, cfg.head_dim


def layout_decls(
    cfg: ModelConfig, tp: int, rank: int, *, fused: bool
) -> dict[str, tuple[tuple[int, ...], Declaration]]:
    """``{local name: (local shape, declaration)}`` of TP rank ``rank`` of ``tp``.

    ``fused=False`` is a Megatron-like trainer (separate q/k/v and gate/up, column- and row-parallel
    linears, vocab-parallel embeddings, replicated norms); ``fused=True`` a vLLM-like rollout with
    ``qkv_proj = [q; k; v]`` and ``gate_up_proj = [gate; up]``.
    """
    out: dict[str, tuple[tuple[int, ...], Declaration]] = {}
    specs = {s.name: s for s in cfg.specs()}
    for name, spec in specs.items():
        if name.endswith(("layernorm.weight", "norm.weight")):
            out[name] = (spec.shape, Shard(name, spec.shape))
        elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
            out[name] = _row_shard(spec, tp, rank)
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            out[name] = _col_shard(spec, tp, rank)
        elif name.endswith(("k_proj.weight", "v_proj.weight")):
            if not fused:
                off, size = _kv_rows(cfg, spec, tp, rank)
                out[name] = ((size, spec.shape[1]), Shard(name, spec.shape, (off, 0)))
        elif name.endswith(("q_proj.weight", "gate_proj.weight", "up_proj.weight")):
            if not fused:
                out[name] = _row_shard(spec, tp, rank)
            elif name.endswith("q_proj.weight"):
                p = name[: -len("q_proj.weight")]
                parts, rows = [], 0
                qoff, qsize = _split(spec.shape[0], tp, rank)
                parts.append(Shard(name, spec.shape, (qoff, 0), (qsize, cfg.hidden)))
                rows += qsize
                for kvn in ("k_proj.weight", "v_proj.weight"):
                    kspec = specs[p + kvn]
                    off, size = _kv_rows(cfg, kspec, tp, rank)
                    parts.append(Shard(kspec.name, kspec.shape, (off, 0), (size, cfg.hidden)))
                    rows += size
                out[p + "qkv_proj.weight"] = ((rows, cfg.hidden), Fused(0, tuple(parts)))
            elif name.endswith("gate_proj.weight"):
                p = name[: -len("gate_proj.weight")]
                parts, rows = [], 0
                for gn in ("gate_proj.weight", "up_proj.weight"):
                    gspec = specs[p + gn]
                    off, size = _split(gspec.shape[0], tp, rank)
                    parts.append(Shard(gspec.name, gspec.shape, (off, 0), (size, cfg.hidden)))
                    rows += size
                out[p + "gate_up_proj.weight"] = ((rows, cfg.hidden), Fused(0, tuple(parts)))
    return out


# ----------------------------------------------------------------------------------------------
# Values
# ----------------------------------------------------------------------------------------------

_TORCH_TO_BITS = {2: np.uint16, 4: np.uint32, 8: np.uint64, 1: np.uint8}


_BITS = {
    1: (np.uint8, 0x80, 0x3F),
    2: (np.uint16, 0x807F, 0x3F00),
    4: (np.uint32, 0x807FFFFF, 0x3F000000),
    8: (np.uint64, 0x800FFFFFFFFFFFFF, 0x3FE0000000000000),
}


def _mix(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        x = x * np.uint64(0x9E3779B97F4A7C15)
        x ^= x >> np.uint64(29)
        x *= np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(32)
    return x


def canonical_bits(
    name: str, shape: tuple[int, ...], offsets: tuple[int, ...], sizes: tuple[int, ...], itemsize: int, version: int
) -> np.ndarray:
    """Bit patterns of the box ``offsets/sizes`` of canonical ``name`` at ``version``.

    Each element is the XOR of a hash of each of its indices (seeded by name, dimension and
    version), masked to finite values near +-1 for float types: cheap to generate at memory speed,
    different for every version, every tensor and every row and column.
    """
    utype, mask, one = _BITS[itemsize]
    seed = (zlib.crc32(name.encode()) << 20) ^ (version * 0x9E3779B1)
    out = None
    for d, (o, s) in enumerate(zip(offsets, sizes)):
        idx = np.arange(o, o + s, dtype=np.uint64) + np.uint64(((seed + d * 0x632BE5AB) & 0xFFFFFFFF) << 24)
        part = (_mix(idx) & np.uint64(mask)).astype(utype)
        part = part.reshape([-1 if i == d else 1 for i in range(len(sizes))])
        out = part if out is None else out ^ part
    if out is None:  # a 0-d tensor
        out = (_mix(np.array(seed, dtype=np.uint64)) & np.uint64(mask)).astype(utype)
    return np.broadcast_to(out | utype(one), sizes)


def version_bits(
    name: str,
    shape: tuple[int, ...],
    offsets: tuple[int, ...],
    sizes: tuple[int, ...],
    itemsize: int,
    version: int,
    period: int = 1,
) -> np.ndarray:
    """``canonical_bits`` of the box at ``version`` when each element changes once every ``period``
    versions: element e changes at version u >= 2 where ``(phase(e) + u) % period == 0`` (a hash
    of e), so it holds its values of the newest such u up to ``version`` (of version 1 if none).
    ``period`` 1: every element changes at every version (``canonical_bits`` itself)."""
    if period <= 1 or version <= 1:
        return canonical_bits(name, shape, offsets, sizes, itemsize, version)
    phase = canonical_bits(name + "#phase", shape, offsets, sizes, 4, 0) & np.uint32(0x7FFFFF)  # 23 random bits
    last = version - ((phase + np.uint32(version)) % np.uint32(period)).astype(np.int32)
    out = np.array(canonical_bits(name, shape, offsets, sizes, itemsize, 1))
    for u in range(max(2, version - period + 1), version + 1):
        sel = last == u
        out[sel] = canonical_bits(name, shape, offsets, sizes, itemsize, u)[sel]
    return out


def fill_pieces(
    flat_bits: np.ndarray,
    name: str,
    shape: tuple[int, ...],
    decl: Declaration,
    itemsize: int,
    source: Callable[[str, tuple[int, ...], tuple[int, ...], tuple[int, ...]], np.ndarray],
) -> None:
    """Writes into ``flat_bits`` (a flat unsigned-int view of local tensor ``name``, declared ``decl``)
    what each of its pieces maps from: ``source(canonical name, global shape, offsets, sizes)`` gives
    the bits of that box. Unmapped elements are left alone."""
    for piece in pieces_for(name, decl, shape):
        vals = source(piece.tensor, _global_shape(decl, piece.tensor), piece.box.offsets, piece.box.sizes)
        dst = np.lib.stride_tricks.as_strided(
            flat_bits[piece.offset :],
            shape=piece.box.sizes,
            strides=tuple(s * itemsize for s in piece.strides),
            writeable=True,
        )
        dst[...] = vals


def fill_expected(
    flat_bits: np.ndarray,
    name: str,
    shape: tuple[int, ...],
    decl: Declaration,
    itemsize: int,
    version: int,
    period: int = 1,
) -> None:
    """Writes what local tensor ``name`` (declared ``decl``) holds at ``version`` (of change
    ``period``, see ``version_bits``) into ``flat_bits``, a flat unsigned-int view of it. Unmapped
    elements are left alone."""

    def source(tensor: str, gshape: tuple[int, ...], offsets: tuple[int, ...], sizes: tuple[int, ...]) -> np.ndarray:
        return version_bits(tensor, gshape, offsets, sizes, itemsize, version, period)

    fill_pieces(flat_bits, name, shape, decl, itemsize, source)


def _global_shape(decl: Declaration, tensor: str) -> tuple[int, ...]:
    if isinstance(decl, Shard):
        return decl.global_shape
    for p in getattr(decl, "parts", ()):
        if p.name == tensor:
            return p.global_shape
    for n, s, _, _ in getattr(decl, "segments", ()):
        if n == tensor:
            return s
    raise KeyError(tensor)


def bits_view(t: Any) -> np.ndarray:
    """A flat unsigned-int numpy view of a CPU torch tensor or numpy array (no copy)."""
    if isinstance(t, np.ndarray):
        arr = t.reshape(-1)
    else:
        import torch

        arr = t.detach().reshape(-1).view(torch.uint8).numpy()
        isz = t.element_size()
        return arr.view(_TORCH_TO_BITS[isz])
    return arr.view(_TORCH_TO_BITS[arr.itemsize])


def make_tensors(
    cfg: ModelConfig, tp: int, rank: int, *, fused: bool, version: int | None = 0, fill_value: int | None = None
) -> dict[str, tuple[Any, Declaration]]:
    """Allocates the local tensors of a TP rank (torch, CPU) filled for ``version`` (or with the
    byte ``fill_value``) and returns them ready for ``register``."""
    import torch

    dtype = getattr(torch, cfg.dtype)
    out = {}
    for name, (shape, decl) in layout_decls(cfg, tp, rank, fused=fused).items():
        t = torch.empty(shape, dtype=dtype)
        if fill_value is not None:
            t.view(torch.uint8).fill_(fill_value)
        elif version is not None:
            fill_expected(bits_view(t), name, shape, decl, t.element_size(), version)
        out[name] = (t, decl)
    return out


def set_version(tensors: dict[str, tuple[Any, Declaration]], version: int, period: int = 1) -> None:
    """Overwrites every tensor with its values at ``version`` (a fake training step; ``period``:
    see ``version_bits``)."""
    for name, (t, decl) in tensors.items():
        fill_expected(bits_view(t), name, tuple(t.shape), decl, t.element_size(), version, period)


def expected_bits(
    name: str,
    shape: tuple[int, ...],
    decl: Declaration,
    itemsize: int,
    version: int,
    base: np.ndarray,
    period: int = 1,
) -> np.ndarray:
    """What local tensor ``name`` (``shape``, declared ``decl``) holds at ``version``, as unsigned ints
    of ``shape``: ``base`` (a flat view of the same size) where the declaration maps nothing, else
    the canonical values (of change ``period``, see ``version_bits``). Each canonical tensor is
    generated whole (``version_bits`` over its full shape) and cut by plain slicing: a ``Shard`` is
    the box ``[offsets, offsets + sizes)`` (clipped to the canonical shape where ``padded``), a
    ``Fused`` its parts' boxes concatenated along ``dim`` in order (each part with its ``sizes``
    given, as ``layout_decls`` writes them), a ``Stack`` its parts stacked. Shares no code with the
    planner's mapping."""
    whole: dict[str, np.ndarray] = {}

    def canonical(part: Shard) -> np.ndarray:
        if part.name not in whole:
            zeros = (0,) * len(part.global_shape)
            gshape = part.global_shape
            whole[part.name] = version_bits(part.name, gshape, zeros, gshape, itemsize, version, period)
        return whole[part.name]

    def fill(out: np.ndarray, d: Declaration) -> None:
        if isinstance(d, Shard):
            box = out
            if d.sizes is not None and tuple(d.sizes) != out.shape:  # the same elements, row-major
                box = out.view()
                box.shape = d.sizes  # a view or an error, never a silent copy
            offsets = d.offsets or (0,) * box.ndim
            inside = tuple(slice(0, max(0, min(n, g - o))) for n, g, o in zip(box.shape, d.global_shape, offsets))
            box[inside] = canonical(d)[tuple(slice(o, o + s.stop) for o, s in zip(offsets, inside))]
        elif isinstance(d, Fused):
            start = 0
            for part in d.parts:
                if part.sizes is None:
                    raise ValueError(f"{name}: the slicing reference needs sizes on every Fused part")
                stop = start + part.sizes[d.dim]
                fill(out[(slice(None),) * d.dim + (slice(start, stop),)], part)
                start = stop
        elif isinstance(d, Stack):
            for i, part in enumerate(d.parts):
                fill(out[i], part)
        else:
            raise TypeError(f"{name}: the slicing reference covers Shard, Fused and Stack, not {type(d).__name__}")

    want = base.copy().reshape(shape)
    fill(want, decl)
    return want


def mismatches(tensors: dict[str, tuple[Any, Declaration]], version: int, period: int = 1) -> list[str]:
    """Names of local tensors whose mapped bytes differ from ``version``'s values (of change
    ``period``, see ``version_bits``), as ``expected_bits`` cuts them out of the canonical tensors
    (not through the planner's mapping)."""
    bad = []
    for name, (t, decl) in tensors.items():
        got = bits_view(t)
        want = expected_bits(name, tuple(t.shape), decl, t.element_size(), version, got, period)
        if not np.array_equal(got, want.reshape(-1)):
            bad.append(name)
    return bad


def total_bytes(tensors: dict[str, tuple[Any, Declaration]]) -> int:
    return sum(int(t.numel()) * t.element_size() for t, _ in tensors.values())


#: the model shapes ``ModelConfig.named`` knows
MODELS = ("tiny", "demo", "256m", "512m", "1g")

__all__ = [
    "MODELS",
    "ModelConfig",
    "version_bits",
    "layout_decls",
    "make_tensors",
    "set_version",
    "mismatches",
    "canonical_bits",
    "expected_bits",
    "fill_expected",
    "fill_pieces",
    "total_bytes",
]
