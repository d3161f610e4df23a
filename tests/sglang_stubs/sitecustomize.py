"""Test stand-in: lets the PyPI torchvision wheel (a CUDA build) import next to CPU torch.

torchvision 0.28.0 from PyPI ships its C++ ops built against CUDA torch; with ``torch==2.13.0+cpu``
they fail to load, and ``torchvision/_meta_registrations.py`` then stops the import with
``RuntimeError: operator torchvision::nms does not exist`` (it registers fake kernels for
``torchvision::nms`` and ``torchvision::qnms`` unconditionally). SGLang imports torchvision on its
text-only path. This hook, active only where ``tests/sglang_stubs`` is on ``PYTHONPATH``, declares
those two operator schemas just before torchvision is first imported, so its pure-Python part
imports; calling either operator still fails (there is no kernel).

Second stand-in: SGLang 0.5.23's LoRA layers and memory pool ask for pinned host memory
(``pin_memory=True``, ``.pin_memory()``), which torch refuses where no accelerator exists
(``RuntimeError: pin_memory=True requires a CUDA or other accelerator backend``). Pinning only
speeds up host-to-device copies; on a CPU-only machine there are none, so just before SGLang is
first imported, and only where torch has no CUDA, pinned memory becomes plain host memory.
"""

import importlib.abc
import sys


class _DeclareTorchvisionOps(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname != "torchvision":
            return None
        sys.meta_path.remove(self)
        import torch

        lib = torch.library.Library("torchvision", "FRAGMENT")  # noqa: TID251
        for op in ("nms", "qnms"):
            try:
                lib.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
            except RuntimeError:  # a working build already declares it
                pass
        _DeclareTorchvisionOps.lib = lib  # the declarations live as long as the library object
        return None  # the regular finders import torchvision


class _UnpinWithoutAccelerator(importlib.abc.MetaPathFinder):
    FACTORIES = ("tensor", "empty", "zeros", "ones", "full", "arange", "empty_strided")

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "sglang":
            return None
        sys.meta_path.remove(self)
        import functools

        import torch

        if torch.cuda.is_available():
            return None

        def unpinned(factory):
            @functools.wraps(factory)
            def call(*args, **kwargs):
                if kwargs.get("pin_memory"):
                    kwargs["pin_memory"] = False
                return factory(*args, **kwargs)

            return call

        for name in self.FACTORIES:
            setattr(torch, name, unpinned(getattr(torch, name)))
        torch.Tensor.pin_memory = lambda self, *args, **kwargs: self
        return None


sys.meta_path.insert(0, _DeclareTorchvisionOps())
sys.meta_path.insert(0, _UnpinWithoutAccelerator())
