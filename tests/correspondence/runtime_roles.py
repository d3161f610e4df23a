"""A Megatron-style trainer rank publishing through the real runtime (for test_runtime.py).

    python runtime_roles.py RANK WORLD PORT OUT TP EP VERSIONS
Publishes ``VERSIONS`` versions (weights of version v: seed v), each after OUT/want{v} appears,
and exits when OUT/done appears (bounded waits).
"""

from __future__ import annotations

import os
import sys
import time

TOKEN = "corr-token"


def wait_for(path: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.05)


def main() -> None:
    import torch

    from tests.correspondence.megatron_ref import megatron_config, megatron_rank_tensors
    from tests.correspondence.test_trace import MOE, full_weights
    from wbridge import Publisher

    rank, world, port, out, tp, ep, versions = (
        int(sys.argv[1]),
        int(sys.argv[2]),
        int(sys.argv[3]),
        sys.argv[4],
        int(sys.argv[5]),
        int(sys.argv[6]),
        int(sys.argv[7]),
    )
    tr, er = rank % tp, rank // tp
    tensors = megatron_rank_tensors(full_weights(MOE, seed=1), MOE, tr, tp, er, ep)
    entries = megatron_config(MOE, tr, tp, er, ep).entries(tensors)
    with Publisher(
        "corr",
        f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        host_store=rank == 0,
        token=TOKEN,
        transport="tcp",
    ) as pub:
        pub.register(entries)
        for v in range(1, versions + 1):
            wait_for(os.path.join(out, f"want{v}"), 120)
            new = megatron_rank_tensors(full_weights(MOE, seed=v), MOE, tr, tp, er, ep)
            with torch.no_grad():
                for k, t in tensors.items():
                    t.copy_(new[k])
            pub.publish(timeout=60.0)
            open(os.path.join(out, f"published{v}.rank{rank}"), "w").close()
        wait_for(os.path.join(out, "done"), 120)


if __name__ == "__main__":
    main()
