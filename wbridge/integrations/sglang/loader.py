"""``WBridgeModelLoader``: SGLang's checkpoint loader, then a wbridge subscription (``runtime``)."""

from __future__ import annotations

from typing import Any

from sglang.srt.configs.load_config import LoadFormat
from sglang.srt.model_loader.loader import DefaultModelLoader

from ...errors import UsageError
from .options import SGLangOptions
from .runtime import start


class WBridgeModelLoader(DefaultModelLoader):
    """Loads the checkpoint as SGLang's default loader does, then subscribes the scheduler
    process to the channel named by the ``"wbridge"`` options in ``model_loader_extra_config``.
    Pass it as ``load_format`` (``engine_args`` builds both).

    load_config: SGLang's LoadConfig (its ``model_loader_extra_config`` carries the options).
    """

    def __init__(self, load_config: Any) -> None:
        self.wbridge_options, rest = SGLangOptions.from_extra_config(load_config.model_loader_extra_config)
        load_config.model_loader_extra_config = rest
        load_config.load_format = LoadFormat.AUTO  # the default loader's format checks
        super().__init__(load_config)

    def load_model(self, *, model_config: Any, device_config: Any) -> Any:
        from sglang.srt.runtime_context import get_parallel

        model = super().load_model(model_config=model_config, device_config=device_config)
        par = get_parallel()
        if par.tp_size != 1:
            # each rank would commit at its own step; a cross-rank agreement is not built yet
            raise UsageError(f"wbridge SGLang: tp_size={par.tp_size}; only tp_size=1 engines are supported so far")
        start(model, model_config, self.wbridge_options, par.tp_rank, par.tp_size)
        return model
