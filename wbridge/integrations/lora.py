"""LoRA adapters as channels: what a trainer publishes, and what an engine builds the adapter from.

A channel carries one PEFT LoRA adapter: its A/B tensors under the names PEFT's ``save_pretrained``
writes (``base_model.model.<module>.lora_A.weight``, ``... .lora_B.weight``: the canonical names)
and, in the channel's metadata (``Publisher.register(metadata=)``, ``wbridge.protocol.meta``), its
config: rank, alpha, target modules, dtype, each adapted module's shape and PEFT's own
``adapter_config.json`` dict. An engine reads that (``Subscriber.metadata()``), allocates the
tensors, pulls them and builds its adapter from memory: no file on either side.

Trainer side (plain, or FSDP2 / DTensor-sharded on any number of ranks: each rank publishes its
shards, declared as in ``wbridge.integrations.dtensor``)::

    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=[...]))
    lora = from_peft(model)                  # after fully_shard(...) too
    lora.register(pub)                       # pub.register(lora.entries, dtype=..., metadata=lora.metadata)
    for step in ...:
        train_step(); pub.publish()

Engine side: ``LoRAAdapter.from_metadata(sub.metadata())`` and ``adapter.allocate()`` /
``adapter.entries(...)``; the vLLM and SGLang integrations do this for each adapter channel
(``wbridge.integrations.vllm.lora``, ``wbridge.integrations.sglang.lora``). The base model is
either a channel of its own or not published at all (the engine loads it from its checkpoint).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from planner.layout import Shard

from ..errors import UsageError
from .dtensor import Entry, from_dtensor

__all__ = ["LoRAAdapter", "PeftAdapter", "from_peft", "canonical_name"]

KEY = "lora"  # the metadata key of an adapter channel
FORMAT = 1  # of the value under it
PREFIX = "base_model.model."
# wrapper segments training frameworks put into parameter names (FSDP1, activation checkpointing,
# torch.compile); canonical names have none
_WRAPPERS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")
_DTYPES = ("float32", "bfloat16", "float16")


def canonical_name(module: str, which: str) -> str:
    """The canonical (PEFT checkpoint) name of the ``which`` (``"A"`` or ``"B"``) tensor of the
    adapted ``module`` (``model.layers.0.self_attn.q_proj``)."""
    return f"{PREFIX}{module}.lora_{which}.weight"


@dataclass(frozen=True)
class LoRAAdapter:
    """A LoRA adapter as its channel's metadata describes it (the value under ``"lora"``).

    - ``rank``: PEFT's ``r`` (the largest rank, where ``rank_pattern`` gives some modules others).
    - ``alpha``: PEFT's ``lora_alpha``.
    - ``target_modules``: the adapted modules' last names (``q_proj``, ``down_proj``...), sorted.
    - ``dtype``: the dtype the A/B tensors are published in (``float32``, ``bfloat16``, ``float16``).
    - ``modules``: each adapted module's path in the base model (``model.layers.0.self_attn.q_proj``)
      and ``(rank, in_features, out_features)``: A is ``[rank, in]``, B is ``[out, rank]``.
    - ``peft_config``: the ``adapter_config.json`` dict PEFT's ``save_pretrained`` writes; engines
      build their adapter config from it, as from that file.
    """

    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    dtype: str
    modules: Mapping[str, tuple[int, int, int]]
    peft_config: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise UsageError(f"LoRA adapter: dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if not self.modules:
            raise UsageError("LoRA adapter: no adapted module")
        for m, dims in self.modules.items():
            if len(dims) != 3 or not all(isinstance(d, int) and d > 0 for d in dims):
                raise UsageError(f"LoRA adapter: module {m}: (rank, in, out) must be positive integers, got {dims!r}")

    # -- the channel's metadata ------------------------------------------------------------------
    @property
    def metadata(self) -> dict:
        """The channel metadata that carries this adapter (``Publisher.register(metadata=)``)."""
        return {
            KEY: {
                "format": FORMAT,
                "rank": self.rank,
                "alpha": self.alpha,
                "target_modules": list(self.target_modules),
                "dtype": self.dtype,
                "modules": {m: list(d) for m, d in sorted(self.modules.items())},
                "peft_config": dict(self.peft_config),
            }
        }

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any], channel: str = "") -> LoRAAdapter:
        """The adapter a channel's metadata (``Subscriber.metadata()``) describes; a
        ``UsageError`` if the channel carries none."""
        where = f"channel {channel!r}" if channel else "the channel"
        raw = meta.get(KEY) if isinstance(meta, Mapping) else None
        if not isinstance(raw, Mapping):
            raise UsageError(
                f"{where} carries no LoRA adapter in its metadata (publish one with "
                "wbridge.integrations.lora.from_peft(model).register(publisher))"
            )
        if raw.get("format") != FORMAT:
            raise UsageError(f"{where}: LoRA metadata format {raw.get('format')!r}, this wbridge reads {FORMAT}")
        try:
            return cls(
                rank=int(raw["rank"]),
                alpha=float(raw["alpha"]),
                target_modules=tuple(raw["target_modules"]),
                dtype=str(raw["dtype"]),
                modules={str(m): tuple(int(x) for x in d) for m, d in raw["modules"].items()},
                peft_config=dict(raw.get("peft_config") or {}),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise UsageError(f"{where}: malformed LoRA metadata: {type(e).__name__}: {e}") from None

    # -- what an engine allocates and pulls ------------------------------------------------------
    def shapes(self) -> dict[str, tuple[int, int]]:
        """Canonical tensor name -> shape, every adapted module's A then B, in module order."""
        out: dict[str, tuple[int, int]] = {}
        for m, (r, n_in, n_out) in sorted(self.modules.items()):
            out[canonical_name(m, "A")] = (r, n_in)
            out[canonical_name(m, "B")] = (n_out, r)
        return out

    @property
    def nbytes(self) -> int:
        """The adapter's bytes in its published dtype (what a full pull reads)."""
        item = 4 if self.dtype == "float32" else 2
        return item * sum(math.prod(s) for s in self.shapes().values())

    def allocate(self, device: str = "cpu") -> dict[str, Any]:
        """Zeroed tensors of every A/B tensor, in one flat buffer (one region to read into)."""
        import torch

        shapes = self.shapes()
        flat = torch.zeros(sum(math.prod(s) for s in shapes.values()), dtype=getattr(torch, self.dtype), device=device)
        out, off = {}, 0
        for name, shape in shapes.items():
            n = math.prod(shape)
            out[name] = flat[off : off + n].view(shape)
            off += n
        return out

    @staticmethod
    def entries(tensors: Mapping[str, Any]) -> dict[str, Entry]:
        """``{name: (tensor, Shard(name, shape))}`` of whole canonical tensors (``Subscriber.register``)."""
        return {name: (t, Shard(name, tuple(t.shape))) for name, t in tensors.items()}

    def check_base(self, base_shapes: Mapping[str, tuple[int, ...]], supported: Any, max_rank: int, who: str) -> None:
        """Refuses (``UsageError`` naming the module) an adapter an engine cannot serve:
        ``base_shapes``: the base model's checkpoint names and shapes (``<module>.weight``);
        ``supported``: the module names (last part) the engine's LoRA layers adapt;
        ``max_rank``: the engine's ``max_lora_rank``."""
        for m, (r, n_in, n_out) in sorted(self.modules.items()):
            leaf = m.rsplit(".", 1)[-1]
            if leaf not in supported:
                raise UsageError(
                    f"{who}: the adapter targets module {m}, which the engine's LoRA layers lack "
                    f"(it adapts {sorted(supported)})"
                )
            if r > max_rank:
                raise UsageError(f"{who}: module {m} has LoRA rank {r}, above the engine's max_lora_rank {max_rank}")
            shape = base_shapes.get(f"{m}.weight")
            if shape is None:
                raise UsageError(f"{who}: the adapter targets module {m}, which the engine's base model does not have")
            if tuple(shape) != (n_out, n_in):
                raise UsageError(
                    f"{who}: module {m} of the adapter is {n_in} -> {n_out} but the base model's "
                    f"weight is {tuple(shape)}: the adapter does not fit this base model"
                )


@dataclass(frozen=True)
class PeftAdapter:
    """What ``from_peft`` found in a trainer rank's model.

    - ``entries``: ``{parameter name: (live local tensor, declaration)}`` of its A/B tensors.
    - ``adapter``: the adapter's description (``LoRAAdapter``), the same on every rank.
    - ``cast``: the dtype to publish in (``register(dtype=)``), or None (as trained).
    """

    entries: dict[str, Entry]
    adapter: LoRAAdapter
    cast: Any = None

    @property
    def metadata(self) -> dict:
        return self.adapter.metadata

    def register(self, publisher: Any) -> int:
        """``publisher.register(entries, dtype=cast, metadata=metadata)``; returns the epoch."""
        return publisher.register(self.entries, dtype=self.cast, metadata=self.metadata)

    def __repr__(self) -> str:
        a = self.adapter
        return (
            f"PeftAdapter(rank={a.rank}, alpha={a.alpha}, targets={list(a.target_modules)}, dtype={a.dtype}, "
            f"modules={len(a.modules)}, local_tensors={len(self.entries)}, cast={self.cast})"
        )


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _peft_config_dict(config: Any) -> dict:
    """The dict PEFT's ``save_pretrained`` writes as ``adapter_config.json`` (sets as sorted lists)."""
    out = config.to_dict()
    for k, v in list(out.items()):
        if isinstance(v, (set, frozenset)):
            out[k] = sorted(v)
    return out


def _prefix(model: Any) -> str:
    """What to put before a parameter name of ``model`` to get PEFT's checkpoint name."""
    try:
        from peft import PeftModel
        from peft.tuners.lora import LoraModel
    except ImportError as e:  # pragma: no cover - the extra is missing
        from ..errors import MissingExtraError

        raise MissingExtraError(f"from_peft needs peft ({e}); pip install 'wbridge[lora]'") from e
    if isinstance(model, PeftModel):
        return ""
    if isinstance(model, LoraModel):
        return "base_model."
    return PREFIX  # a transformers model with an adapter injected (model.add_adapter)


def from_peft(model: Any, adapter_name: str | None = None, dtype: Any = None) -> PeftAdapter:
    """Declares the LoRA adapter ``adapter_name`` (default: the active one) of a PEFT model as a
    channel: its A/B tensors (plain or DTensor / FSDP2 shards: this rank's part, live) under
    canonical names, and its config as metadata. ``dtype``: publish the tensors in this dtype
    (``torch.bfloat16``...; None: as trained).

    ``model``: a ``PeftModel``, its ``LoraModel``, or a transformers model with an adapter added.
    Adapters engines cannot serve from these names are refused with a ``UsageError`` naming the
    module: DoRA, LoRA on embeddings, ``modules_to_save``, LoRA biases."""
    prefix = _prefix(model)
    configs = getattr(model, "peft_config", None)
    if not isinstance(configs, Mapping) or not configs:
        raise UsageError(f"from_peft: {type(model).__name__} has no PEFT adapter (peft_config)")
    if adapter_name is None:
        active = getattr(model, "active_adapter", None)
        adapter_name = active if isinstance(active, str) else next(iter(configs))
    if adapter_name not in configs:
        raise UsageError(f"from_peft: no adapter {adapter_name!r}; the model has {sorted(configs)}")
    config = configs[adapter_name]
    if str(getattr(config, "peft_type", "")).rsplit(".", 1)[-1] != "LORA":
        raise UsageError(f"from_peft: adapter {adapter_name!r} is {config.peft_type}, not LoRA")
    if getattr(config, "modules_to_save", None):
        raise UsageError(f"from_peft: modules_to_save {config.modules_to_save} are full modules, not LoRA tensors")
    if getattr(config, "bias", "none") != "none" or getattr(config, "lora_bias", False):
        raise UsageError("from_peft: adapters with LoRA biases are not supported (bias='none', lora_bias=False)")

    named: list[tuple[str, Any]] = []
    rename: dict[str, str] = {}
    dims: dict[str, list[int]] = {}  # module -> [rank, in, out]
    for name, p in model.named_parameters():
        clean = name
        for w in _WRAPPERS:
            clean = clean.replace(w, "")
        parts = clean.split(".")
        if "lora_magnitude_vector" in parts and adapter_name in parts:
            raise UsageError(f"from_peft: module {'.'.join(parts[: parts.index('lora_magnitude_vector')])} uses DoRA")
        if any(s in parts for s in ("lora_embedding_A", "lora_embedding_B")) and adapter_name in parts:
            raise UsageError(f"from_peft: module {'.'.join(parts[:-2])} is an embedding with LoRA; not supported")
        if len(parts) < 4 or parts[-1] != "weight" or parts[-2] != adapter_name:
            continue
        if parts[-3] not in ("lora_A", "lora_B"):
            continue
        which = parts[-3][-1]
        full = prefix + ".".join(parts[:-3])
        if not full.startswith(PREFIX):
            raise UsageError(f"from_peft: parameter {name} does not map to a PEFT checkpoint name ({full})")
        module = full[len(PREFIX) :]
        shape = tuple(int(s) for s in p.shape)  # global shape, for DTensors too
        d = dims.setdefault(module, [0, 0, 0])
        if which == "A":
            d[0], d[1] = shape
        else:
            d[2], rb = shape
            if d[0] and rb != d[0]:
                raise UsageError(f"from_peft: module {module}: lora_B has rank {rb}, lora_A {d[0]}")
        named.append((name, p))
        rename[name] = canonical_name(module, which)
    if not named:
        raise UsageError(f"from_peft: adapter {adapter_name!r} has no lora_A/lora_B weights in this model")
    missing = sorted(m for m, d in dims.items() if 0 in d)
    if missing:
        raise UsageError(f"from_peft: module {missing[0]} has only one of lora_A / lora_B")
    entries = from_dtensor(named, rename=rename, skip_empty=True)
    dtypes = {_dtype_name(getattr(p, "dtype", None)) for _, p in named}
    if dtype is not None:
        published = _dtype_name(dtype)
    elif len(dtypes) == 1:
        published = dtypes.pop()
    else:
        raise UsageError(f"from_peft: the adapter's tensors have dtypes {sorted(dtypes)}; pass dtype= to publish one")
    targets = sorted({m.rsplit(".", 1)[-1] for m in dims})
    adapter = LoRAAdapter(
        rank=max(d[0] for d in dims.values()),
        alpha=float(config.lora_alpha),
        target_modules=tuple(targets),
        dtype=published,
        modules={m: tuple(d) for m, d in dims.items()},
        peft_config=_peft_config_dict(config),
    )
    return PeftAdapter(entries, adapter, None if dtype is None else dtype)
