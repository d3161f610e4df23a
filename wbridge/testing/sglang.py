"""SGLang engine arguments for the CPU tests, example and benchmark (their checkpoints:
``wbridge.testing.hf``)."""

from __future__ import annotations

from typing import Any

#: ``sgl.Engine`` / ``ServerArgs`` keywords that run SGLang 0.5.23 on a CPU without AMX (with
#: ``SGLANG_USE_CPU_ENGINE=1`` and tests/sglang_stubs on the path); the radix cache is off so
#: that greedy tokens compare exactly across weight updates. ``max_total_tokens`` sizes the KV
#: pool; ``mem_fraction_static`` only has to exceed what SGLang sees the load take, and on a CPU
#: it sees the machine's free memory, which other processes' allocations during the load lower
#: too (at 0.05 an engine starting beside another engine failed with "no memory for the KV cache").
#: ``sleep_on_idle``: an idle scheduler waits on its sockets (up to 1 s) instead of spinning a
#: core (5.0 CPU-seconds in 5 idle seconds without it, 0.04 with it); wbridge's commit runs after
#: the scheduler takes in requests, so a request (or a state query) finds the staged version
#: committed before its first step, and an idle engine commits within a second.
CPU_ENGINE_ARGS: dict[str, Any] = dict(
    device="cpu",
    attention_backend="torch_native",
    sampling_backend="pytorch",
    disable_cuda_graph=True,
    disable_radix_cache=True,
    max_total_tokens=4096,
    max_running_requests=8,
    chunked_prefill_size=512,
    mem_fraction_static=0.3,
    tp_size=1,
    skip_server_warmup=True,
    sleep_on_idle=True,
    skip_tokenizer_init=True,
    log_level="warning",
)
