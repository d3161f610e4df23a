"""Stand-in for ``sgl_kernel``, SGLang's CUDA kernel package, for the CPU-only test machine.

No CPU build of sgl-kernel exists on the package registry (0.3.21 and sglang-kernel 0.4.10 are
CUDA-only). SGLang 0.5.23's CPU path imports it (``sglang/kernels/ops/kvcache/cache_move.py``
takes ``copy_all_layer_kv_cache_cpu``) but, on a CPU without AMX/AVX-512, runs the model layers on
plain torch and calls none of its functions. This module makes that import succeed; any function
actually called raises, naming itself, so a code path that needs the real kernels fails loudly.
"""


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)

    def missing(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name}: the CPU test stand-in has no kernels")

    missing.__name__ = name
    return missing
