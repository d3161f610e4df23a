"""LoRA adapters as channels, without an engine: ``from_peft`` on plain and FSDP2-sharded PEFT models,
the channel metadata an engine builds the adapter from, deltas and checksums on adapter channels,
and the adapters ``from_peft`` refuses.

The FSDP2 test runs two gloo trainer processes (``lora_fsdp_worker.py``) publishing their adapter
shards; this process reads the adapter from the channel's metadata, allocates it and pulls every
version bit-exactly (checked against the whole adapter the trainers gather), verifying checksums,
with deltas where few tensors changed.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from wbridge import Publisher, Subscriber
from wbridge.errors import AuthError, UsageError, WaitTimeout
from wbridge.integrations.lora import LoRAAdapter, canonical_name, from_peft

from .helpers import free_port

if importlib.util.find_spec("peft") is None:  # found, not imported: peft costs 2.6 CPU-s per collecting worker
    pytest.skip("peft is not installed (pip install -e '.[lora]')", allow_module_level=True)
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def _model(**kw):
    from wbridge.testing.lora import peft_model

    return peft_model(**kw)


def test_metadata_is_signed_bounded_and_readable_before_a_version() -> None:
    model = _model()
    lora = from_peft(model)
    with Publisher("meta", "tcp://127.0.0.1:0", host_store=True, token="t") as pub:
        with pytest.raises(UsageError, match="metadata is not JSON"):
            pub.register(lora.entries, metadata={"x": float("nan")})
        with pytest.raises(UsageError, match="more than 65536"):
            pub.register(lora.entries, metadata={"x": "y" * 70000})
        with pytest.raises(UsageError, match="must be a mapping"):
            pub.register(lora.entries, metadata=[1, 2])
        with Subscriber("meta", pub.store_url, token="t") as sub:
            with pytest.raises(WaitTimeout, match="no publisher registered"):
                sub.metadata(timeout=0.2)
            lora.register(pub)
            meta = sub.metadata(timeout=10)  # no version published yet
            assert LoRAAdapter.from_metadata(meta, "meta") == lora.adapter
            pub.register(lora.entries)  # registered again without metadata: the channel has none
            assert sub.metadata(timeout=10) == {}
            with pytest.raises(UsageError, match="carries no LoRA adapter"):
                LoRAAdapter.from_metadata({}, "meta")
            lora.register(pub)
        with Subscriber("meta", pub.store_url, token="wrong") as bad:
            with pytest.raises(AuthError, match="bad signature"):
                bad.metadata(timeout=10)


def test_plain_adapter_pulls_bit_exact_and_reads_the_adapters_bytes() -> None:
    from wbridge.testing.lora import Trainer, full_adapter

    model = _model(seed=3)
    lora = from_peft(model, dtype=torch.bfloat16)
    a = lora.adapter
    assert a.rank == 8 and a.alpha == 16.0 and a.dtype == "bfloat16"
    assert a.target_modules == ("down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj")
    assert a.modules["model.layers.1.mlp.down_proj"] == (8, 256, 128)
    assert set(a.shapes()) == set(full_adapter(model))  # the names PEFT's save_pretrained writes
    assert a.peft_config["r"] == 8 and sorted(a.peft_config["target_modules"]) == list(a.target_modules)
    with Publisher("plain", "tcp://127.0.0.1:0", host_store=True, token="t") as pub:
        lora.register(pub)
        with Subscriber("plain", pub.store_url, token="t") as sub:
            got = LoRAAdapter.from_metadata(sub.metadata(timeout=10), "plain")
            tensors = got.allocate()
            sub.register(got.entries(tensors))
            trainer = Trainer(model)
            for _ in range(2):
                trainer.step()
                v = pub.publish(timeout=30)
                assert sub.pull(timeout=30) == v
                want = full_adapter(model)
                for k, t in tensors.items():
                    assert torch.equal(t, want[k].to(torch.bfloat16)), k
                assert sub.stats.last.nbytes == got.nbytes == a.nbytes


@pytest.mark.slow
@pytest.mark.heavy  # two gloo trainer processes train for a while
@pytest.mark.timeout(300)
def test_fsdp2_trainer_ranks_publish_their_shards_deltas_and_checksums(tmp_path) -> None:
    world, steps = 2, 4
    port, store_port = free_port(), free_port()
    env = dict(os.environ, PYTHONPATH=ROOT)
    script = os.path.join(HERE, "lora_fsdp_worker.py")
    logs = [open(tmp_path / f"rank{r}.log", "w") for r in range(world)]
    procs = [
        subprocess.Popen(
            [sys.executable, script, str(r), str(world), str(port), str(store_port), str(tmp_path), str(steps)],
            stdout=logs[r],
            stderr=subprocess.STDOUT,
            env=env,
        )
        for r in range(world)
    ]
    pulled = []
    try:
        with Subscriber("lora-fsdp", f"tcp://127.0.0.1:{store_port}", verify=True, connect_timeout=60) as sub:
            adapter = LoRAAdapter.from_metadata(sub.metadata(timeout=120), "lora-fsdp")
            tensors = adapter.allocate()
            sub.register(adapter.entries(tensors))
            for v in range(1, steps + 1):
                assert sub.pull(min_version=v, timeout=120) == v
                last = sub.stats.last
                pulled.append(({k: t.clone() for k, t in tensors.items()}, last.nbytes, last.delta, last.delta_reason))
        for p in procs:
            p.wait(timeout=120)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
        for f in logs:
            f.close()
    tails = [open(tmp_path / f"rank{r}.log").read()[-3000:] for r in range(world)]
    assert all(p.returncode == 0 for p in procs), tails
    # each rank published its own row shards of every A/B tensor
    entries = open(tmp_path / "entries1.txt").read()
    q_a = canonical_name("model.layers.0.self_attn.q_proj", "A")
    assert f"(4, 128) Shard(name='{q_a}', global_shape=(8, 128), offsets=(4, 0)" in entries, entries
    print(f"\nper version: bytes {[n for _, n, _, _ in pulled]}, delta {[(d, r) for _, _, d, r in pulled]}")
    for v, (got, nbytes, _, _) in enumerate(pulled, 1):
        want = torch.load(tmp_path / f"v{v}.pt")
        assert got.keys() == want.keys()
        for k in want:
            assert torch.equal(got[k], want[k]), (v, k)
        # the adapter's bytes, never the model's: a version read whole after a delta declined
        # (by cost, on a loaded machine) adds the delta tables read to decide, a few hundred bytes
        assert nbytes <= adapter.nbytes + 4096, (v, nbytes, adapter.nbytes)
    assert pulled[0][1] == adapter.nbytes  # the first version whole
    assert any(delta for _, _, delta, _ in pulled[1:]), "later versions, one tensor pair changed: deltas"
    assert min(n for _, n, _, _ in pulled[1:]) < adapter.nbytes // 4


def test_from_peft_refuses_what_engines_cannot_serve() -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2ForCausalLM

    from wbridge.testing.hf import qwen2_config

    def peft_of(**kw):
        torch.manual_seed(0)
        base = Qwen2ForCausalLM(qwen2_config()).float()
        return get_peft_model(base, LoraConfig(r=4, lora_alpha=8, **kw))

    with pytest.raises(UsageError, match=r"module base_model\.model\.model\.layers\.0\.self_attn\.q_proj uses DoRA"):
        from_peft(peft_of(target_modules=["q_proj"], use_dora=True))
    with pytest.raises(UsageError, match=r"module .*embed_tokens is an embedding"):
        from_peft(peft_of(target_modules=["embed_tokens"]))
    with pytest.raises(UsageError, match="modules_to_save"):
        from_peft(peft_of(target_modules=["q_proj"], modules_to_save=["lm_head"]))
    with pytest.raises(UsageError, match="LoRA biases"):
        from_peft(peft_of(target_modules=["q_proj"], bias="lora_only"))
    with pytest.raises(UsageError, match="no adapter 'other'"):
        from_peft(peft_of(target_modules=["q_proj"]), adapter_name="other")
    with pytest.raises(UsageError, match="has no PEFT adapter"):
        from_peft(torch.nn.Linear(2, 2))


def test_adapter_check_names_the_module() -> None:
    a = from_peft(_model()).adapter
    base = {f"model.layers.{i}.{m}.weight": (128, 128) for i in range(2) for m in ("self_attn.q_proj",)}
    with pytest.raises(UsageError, match=r"targets module model\.layers\.0\.mlp\.down_proj, which the engine's LoRA"):
        a.check_base(base, {"q_proj"}, 8, "engine")
    with pytest.raises(UsageError, match=r"module model\.layers\.0\.mlp\.down_proj has LoRA rank 8, above .* 4"):
        a.check_base(base, set(a.target_modules), 4, "engine")
    with pytest.raises(UsageError, match=r"targets module model\.layers\.0\.mlp\.down_proj, which the engine's base"):
        a.check_base(base, set(a.target_modules), 8, "engine")
