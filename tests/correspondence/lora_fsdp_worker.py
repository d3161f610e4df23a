"""One trainer rank of the LoRA channel test: a tiny Qwen2 with a PEFT LoRA adapter, FSDP2-sharded
over gloo (``WORLD`` ranks), publishing the adapter with ``from_peft`` after each AdamW step.

    python lora_fsdp_worker.py RANK WORLD PORT STORE_PORT OUT STEPS

Rank 0 hosts the store. ``mode="sync"``: each publish returns once the test's subscriber acked it;
then every rank gathers the whole adapter and rank 0 writes it to ``OUT/v<v>.pt``. After the first
step AdamW steps only layer 0's ``q_proj`` adapter, so later versions change a few tensors: what
deltas are for.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist


def main(rank: int, world: int, port: int, store_port: int, out: str, steps: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from wbridge import Delta, Publisher, Staging
    from wbridge.integrations.lora import from_peft
    from wbridge.testing.lora import Trainer, full_adapter, peft_model

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    model = peft_model(seed=0)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.base_model.model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    trainer = Trainer(model, lr=1e-2, seed=rank)
    lora = from_peft(model)
    with open(os.path.join(out, f"entries{rank}.txt"), "w") as f:
        f.write("\n".join(f"{k} {tuple(t.shape)} {d}" for k, (t, d) in lora.entries.items()))
    store = f"tcp://127.0.0.1:{store_port}"
    staging = Staging(delta=Delta())
    with Publisher("lora-fsdp", store, rank=rank, world_size=world, host_store=rank == 0, mode="sync",
                   staging=staging) as pub:  # fmt: skip
        lora.register(pub)
        if rank == 0:
            pub.wait_for_subscribers(1, timeout=120)
        dist.barrier()
        for step in range(1, steps + 1):
            if step == 2:  # from now on AdamW steps layer 0's q_proj adapter only
                few = [p for n, p in model.named_parameters() if "layers.0.self_attn.q_proj.lora_" in n]
                trainer.opt = torch.optim.AdamW(few, lr=1e-2)
            trainer.step()
            v = pub.publish(timeout=120)
            full = full_adapter(model)  # a collective
            if rank == 0:
                torch.save(full, os.path.join(out, f"v{v}.pt"))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*map(int, sys.argv[1:5]), sys.argv[5], int(sys.argv[6]))
