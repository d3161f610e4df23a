"""The trainer side of vLLM's weight-transfer API for ``backend="wbridge"``.

vLLM's RL clients (``HTTPVLLMWeightSyncClient`` over the server's RL routes,
``RayVLLMWeightSyncClient`` over engine actors) drive a weight update as start -> update -> finish.
A trainer that already uses those clients keeps them; the bytes move over wbridge::

    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    pub = Publisher("policy", store, rank=r, world_size=n, host_store=(r == 0), token=token)
    pub.register(entries, dtype=torch.bfloat16)
    engine = WeightTransferTrainerFactory.trainer_init(
        WBridgeTrainerInitInfo(publisher=pub, rank=r), client=HTTPVLLMWeightSyncClient(url))
    for step in ...:
        train_step()
        engine.send_weights()      # every rank publishes; rank 0 then drives the rollouts

``trainer_init`` (rank 0) tells the rollouts' wbridge engines to join the channel (vLLM's
``init_weight_transfer_engine``); ``send_weights`` publishes the next version on every rank and,
on rank 0, runs ``start_weight_update``, ``update_weights`` with the exact version just published,
and ``finish_weight_update`` labelled with that version. Unlike vLLM's NCCL and IPC backends the
trainer never gathers full tensors: it publishes its own shards, and each rollout rank reads what
it needs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from vllm.distributed.weight_transfer.base import TrainerInitInfo, TrainerWeightTransferEngine

from ...errors import UsageError

BACKEND = "wbridge"


@dataclass
class WBridgeTrainerInitInfo(TrainerInitInfo):
    """Trainer-side init info (``rank`` is vLLM's keyword: the trainer rank; rank 0 drives).

    - ``publisher``: this rank's registered ``wbridge.Publisher`` (the channel, store and token
      the rollouts are told to use come from it).
    - ``token``: the token the rollouts use (default: the publisher's, as text).
    - ``transport``: the rollouts' transport choice (``"auto"``).
    - ``timeout``: seconds each publish and each rollout pull may take.
    - ``subscriber_options``: more ``Subscriber`` keywords for the rollouts (``transfer``).
    - ``cache_dir``: the rollouts' trace cache directory (None: their default).
    """

    backend: ClassVar[str] = BACKEND

    publisher: Any = None
    token: str | None = None
    transport: str = "auto"
    timeout: float = 60.0
    subscriber_options: dict[str, Any] = field(default_factory=dict)
    cache_dir: str | None = None

    def worker_init_info(self) -> dict[str, Any]:
        """The ``init_info`` the rollouts' ``WBridgeWeightTransferEngine`` receives (JSON-safe)."""
        pub = self.publisher
        token = self.token
        if token is None and pub.token is not None:
            token = pub.token.decode()
        info: dict[str, Any] = {
            "channel": pub.channel,
            "store": pub.store_url,
            "token": token,
            "transport": self.transport,
            "subscriber_options": dict(self.subscriber_options),
        }
        if self.cache_dir is not None:
            info["cache_dir"] = self.cache_dir
        return info


class WBridgeTrainerEngine(TrainerWeightTransferEngine[WBridgeTrainerInitInfo]):
    """vLLM's trainer-side engine for ``backend="wbridge"``; built by ``trainer_init``."""

    init_info_cls = WBridgeTrainerInitInfo

    def __init__(self, init_info: WBridgeTrainerInitInfo, *, client: Any, is_sender: bool) -> None:
        super().__init__(client=client, source=None, is_sender=is_sender)
        self.init_info = init_info
        self.version: int | None = None

    @classmethod
    def trainer_init(
        cls, init_info: WBridgeTrainerInitInfo, *, client: Any, source: Any = None
    ) -> WBridgeTrainerEngine:
        from ...publisher import Publisher

        if not isinstance(init_info.publisher, Publisher):
            raise UsageError("wbridge trainer init_info: publisher must be a registered wbridge.Publisher")
        if source is not None:
            raise UsageError("wbridge trainer engine: pass no WeightSource; the publisher serves its registered shards")
        engine = cls(init_info, client=client, is_sender=init_info.is_sender)
        if engine.is_sender:
            client.init_weight_transfer_engine(init_info.worker_init_info())
        return engine

    def send_weights(self) -> None:
        """Publishes the next version (every rank), then drives the rollouts' update (rank 0)."""
        info = self.init_info
        v = info.publisher.publish(timeout=info.timeout)
        self.version = v
        if not self.is_sender:
            return
        self.client.start_weight_update()
        self.client.update_weights({"version": v, "timeout": info.timeout})
        self.client.finish_weight_update(weight_version=str(v))

    def shutdown(self) -> None:
        if self.is_sender:
            self.client.shutdown_weight_transfer_engine()

    def __repr__(self) -> str:
        pub = self.init_info.publisher
        role = "sender" if self.is_sender else "rank"
        return f"WBridgeTrainerEngine({role}, channel={pub.channel!r}, version={self.version})"


_REGISTERED: set[tuple[str, str]] = set()  # (factory, class) pairs this process registered


def register_once(factory: Any, cls: type) -> None:
    """Registers ``cls`` as ``"wbridge"`` in one of vLLM's weight-transfer factories; idempotent,
    and a ``UsageError`` if the name is taken by someone else. Through the factories' public
    ``register_engine`` only (they offer no lookup by name: their registry is private): this
    process remembers what it registered."""
    key = (factory.__qualname__, f"{cls.__module__}.{cls.__qualname__}")
    if key in _REGISTERED:
        return
    try:
        factory.register_engine(BACKEND, cls.__module__, cls.__name__)
    except ValueError as e:  # "... 'wbridge' is already registered": not by this process's wbridge
        raise UsageError(
            f"vLLM's {factory.__name__} has {BACKEND!r} registered already, not by wbridge.integrations.vllm "
            f"in this process ({e}): another package took the name"
        ) from e
    _REGISTERED.add(key)


def register_trainer() -> None:
    """Offers ``"wbridge"`` in vLLM's ``WeightTransferTrainerFactory``; idempotent."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    register_once(WeightTransferTrainerFactory, WBridgeTrainerEngine)
