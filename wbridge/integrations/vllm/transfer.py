"""wbridge as a vLLM weight-transfer backend (``WeightTransferConfig(backend="wbridge")``).

vLLM 0.32 selects how RL weight updates reach its workers through a registry of weight-transfer
engines (``nccl``, ``ipc``...). This module adds ``"wbridge"`` to it; the engine is the worker
extension's machinery (traced layout, subscriber, reload lifecycle) behind vLLM's own calls::

    # every vLLM process must run register(): install wbridge with its ``vllm.general_plugins``
    # entry point (``wbridge = "wbridge.integrations.vllm.transfer:register"``)
    llm = LLM(model=path, weight_transfer_config=WeightTransferConfig(backend="wbridge"))
    llm.init_weight_transfer_engine({"init_info": {"channel": "policy", "store": "tcp://trainer:29700",
                                                   "token": "..."}})
    # after each trainer publish (``wbridge.Publisher.publish`` returned v):
    llm.start_weight_update()
    llm.update_weights({"update_info": {"min_version": v, "timeout": 60.0}})   # pulls (kernels untouched)
    llm.finish_weight_update(weight_version=str(v))                            # commits into the kernels
    llm.reset_prefix_cache()

The trainer side is ``wbridge.Publisher``. To let vLLM's own trainer-side clients (HTTP routes,
Ray handles) drive start -> update -> finish, use the trainer engine registered with vLLM's
``WeightTransferTrainerFactory`` (``trainer``): its ``send_weights()`` publishes and then drives
the rollouts through the client, labelling the update with the version it published.

``update_info`` may name the exact ``version`` to apply (the trainer engine does): a pull that finds
another version fails instead of labelling the weights wrongly. ``collective_rpc("wbridge_version")``
(with the worker extension) tells which version the kernels hold.

Call protocol (worker side, driven by vLLM): ``init_transfer_engine`` once (traces the layout,
allocates checkpoint-format staging, joins the channel); per update ``start_weight_update`` ->
``update_weights`` (one or more; each pulls the newest version into staging, the last wins) ->
``finish_weight_update`` (commits staging into the kernels, ``commit``: a fused copy where
vLLM's processing is the identity, a swap of kernels rebuilt during the pull for unquantised linear
layers, vLLM's layerwise reload for the rest); ``shutdown`` leaves the channel (idempotent). A
failed pull leaves the kernels on the previous weights.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from ... import _validate
from ...errors import StaleVersionError, UsageError, WBridgeError
from ..remote import tag
from .state import Fetched
from .worker import DEFAULT_CACHE, WBridgeWorkerExtension

BACKEND = "wbridge"
#: Subscriber keywords that ``init_info["subscriber_options"]`` may set.
SUBSCRIBER_OPTIONS = frozenset(
    {"name", "staged", "verify", "lease_ttl", "connect_timeout", "host", "transport_options"}
)


# Not frozen: vLLM's base info classes are plain dataclasses, and a frozen dataclass cannot
# derive from a non-frozen one.
@dataclass
class WBridgeInitInfo(WeightTransferInitInfo):
    """``init_info`` of ``LLM.init_weight_transfer_engine`` for the ``wbridge`` backend."""

    channel: str
    store: str
    token: str | None = None
    transport: str = "auto"
    cache_dir: str | None = DEFAULT_CACHE  # trace cache; None traces every time
    # more Subscriber keywords, e.g. {"name": "rollout-3", "staged": True, "lease_ttl": 5.0}
    subscriber_options: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        for name in ("channel", "store", "transport"):
            v = getattr(self, name)
            if not isinstance(v, str) or not v:
                raise UsageError(f"wbridge init_info: {name} must be a non-empty string, got {v!r}")
        if self.token is not None and not isinstance(self.token, str):
            raise UsageError(f"wbridge init_info: token must be a string or None, got {type(self.token).__name__}")
        if self.cache_dir is not None and not isinstance(self.cache_dir, str):
            raise UsageError(f"wbridge init_info: cache_dir must be a directory path or None, got {self.cache_dir!r}")
        opts = self.subscriber_options or {}
        if not isinstance(opts, dict) or set(opts) - SUBSCRIBER_OPTIONS:
            raise UsageError(f"wbridge init_info: subscriber_options takes {sorted(SUBSCRIBER_OPTIONS)}, got {opts!r}")


@dataclass
class WBridgeUpdateInfo(WeightTransferUpdateInfo):
    """``update_info`` of ``LLM.update_weights``: pull the newest version, at least
    ``min_version``, waiting up to ``timeout`` seconds for it."""

    min_version: int | None = None
    timeout: float = 60.0
    version: int | None = None  # exactly this version (the label the caller will give it), or fail
    # pull on a worker thread and return at once (generation goes on on the old weights);
    # finish_weight_update waits for it and commits: the commit is then the only pause
    background: bool = False

    def __post_init__(self) -> None:
        for name in ("min_version", "version"):
            v = getattr(self, name)
            if v is not None and (type(v) is not int or v < 1):
                raise UsageError(f"wbridge update_info: {name} must be a positive int, got {v!r}")
        self.timeout = _validate.timeout(self.timeout, "wbridge update_info: timeout", positive=True)
        _validate.boolean(self.background, "wbridge update_info: background")


@dataclass(frozen=True)
class _InFlight:
    """A background pull that ``finish_weight_update`` waits for."""

    version: int | None
    timeout: float


def _check_exact(want: int | None, got: int) -> None:
    if want is not None and got != want:
        raise StaleVersionError(
            f"update_info asked for version {want} but the newest committed is {got}; "
            "nothing was applied (the update would carry the wrong label)"
        )


class WBridgeWeightTransferEngine(WeightTransferEngine[WBridgeInitInfo, WBridgeUpdateInfo], WBridgeWorkerExtension):
    """vLLM's worker-side engine for ``backend="wbridge"``: the worker extension's subscribe /
    fetch / reload, driven by vLLM's weight-transfer calls. Created by vLLM in each worker after
    the model is loaded."""

    init_info_cls = WBridgeInitInfo
    update_info_cls = WBridgeUpdateInfo
    # Staging is traced and allocated for the main model only.
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: Any, model: Any) -> None:
        super().__init__(config, vllm_config, device, model)
        self._wbridge = None
        self._wbridge_pending: Fetched | _InFlight | None = None  # fetched, not committed yet

    # The extension's accessors, answered from what vLLM hands the engine.
    def _wbridge_model(self) -> Any:
        return self.model

    def _wbridge_model_config(self) -> Any:
        return self.model_config

    def _wbridge_rank(self) -> int:
        return int(self.parallel_config.rank)

    @contextlib.contextmanager
    def _named(self) -> Iterator[None]:
        """vLLM hands the user only the message of a worker's error (not its type): it carries
        its class and whose it is (``wbridge.integrations.remote.untag`` rebuilds it)."""
        try:
            yield
        except WBridgeError as e:
            raise tag(e, f"wbridge backend, vLLM worker rank {self._wbridge_rank()}") from e

    def init_transfer_engine(self, init_info: WBridgeInitInfo) -> None:
        with self._named():
            self.wbridge_subscribe(
                init_info.channel,
                init_info.store,
                token=init_info.token,
                transport=init_info.transport,
                cache_dir=init_info.cache_dir,
                **(init_info.subscriber_options or {}),
            )

    def start_weight_update(self) -> None:
        with self._named():
            if self._wbridge is None:
                raise UsageError("wbridge: start_weight_update before init_weight_transfer_engine")
        self._wbridge_pending = None

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class ends with torch.accelerator.synchronize(), which raises on a CPU-only
        # build; nothing here is asynchronous (staging is host memory, the kernels are untouched
        # until finish_weight_update).
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: WBridgeUpdateInfo) -> None:
        # A failed pull may have half-overwritten staging: nothing is pending until one succeeds,
        # so finish_weight_update then leaves the kernels on their previous weights.
        self._wbridge_pending = None
        with self._named():
            want = update_info.version
            if update_info.background:
                self.wbridge_pull_start(update_info.timeout, want or update_info.min_version)
                self._wbridge_pending = _InFlight(want, update_info.timeout)
                return
            fetched = self._wbridge_fetch(update_info.timeout, want or update_info.min_version)
            _check_exact(want, fetched.version)
            self._wbridge_pending = fetched

    def finish_weight_update(self) -> None:
        pending, self._wbridge_pending = self._wbridge_pending, None
        if pending is None:
            return
        with self._named():
            if isinstance(pending, _InFlight):
                state = self._wbridge_state("finish_weight_update")
                bg = state.background
                bg.thread.join(pending.timeout)
                if bg.result is not None and pending.version not in (None, bg.result.version):
                    state.background = None  # dropped: staging holds a version nobody asked for
                    _check_exact(pending.version, bg.result.version)
                self.wbridge_commit(timeout=0.0)
            else:
                self._wbridge_commit(pending)

    def shutdown(self) -> None:
        self._wbridge_pending = None
        state = self._wbridge
        if state is not None and state.background is not None:
            state.background.thread.join(5.0)  # a pull in flight ends within its own timeout; closing cuts it
        self.wbridge_close()

    def __repr__(self) -> str:
        state = self._wbridge
        subscribed = "closed" if state is None else f"subscribed {state.sub!r}"
        p = self._wbridge_pending
        pending = "" if p is None else f", pending v{p.version}"
        return f"WBridgeWeightTransferEngine(rank={self._wbridge_rank()}, {subscribed}{pending})"


def register() -> None:
    """Offers ``"wbridge"`` in vLLM's ``WeightTransferEngineFactory`` (workers) and
    ``WeightTransferTrainerFactory`` (trainers); idempotent.

    vLLM creates the engine in its worker processes (spawned on CPU), so registering in the
    user's process is not enough: make vLLM call this in every process through the
    ``vllm.general_plugins`` entry point (``wbridge = "wbridge.integrations.vllm.transfer:register"``).
    """
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from .trainer import register_once, register_trainer

    register_once(WeightTransferEngineFactory, WBridgeWeightTransferEngine)
    register_trainer()
