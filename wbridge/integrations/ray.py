"""Ray: who hosts the store, how actors find the channel, and vLLM rollout actors that keep up.

Usage (``pip install 'wbridge[ray]'``)::

    ch = host_channel("policy")                  # the store in an actor of its own (outlives trainers)
    trainers = [Trainer.remote(ch, r, 2) for r in range(2)]   # ch pickles: name, store URL, token

    # in a trainer actor
    pub = ch.publisher(rank, world_size, mode=Async(max_staleness=1))

    # in a rollout actor (a restarted one runs this again: it rejoins and pulls the newest version)
    llm = LLM(model=path, worker_extension_cls=EXTENSION, ...)
    rollout = VLLMRollout(llm, ch)
    for version, out in rollout.generate(prompts, params): ...   # each completion with its version

    ch.evict(rollout_actor)                      # driver: the actor died (ray.kill, ActorDiedError)
    close_channel(ch)                            # after trainers and rollouts are gone

Who outlives whom: the store lives in ``_StoreHost`` (no CPU reserved, on the driver's node), so a
trainer or rollout actor can die and be restarted by Ray without taking the channel with it;
``close_channel`` ends it. Every actor binds its transports to its node's address
(``ray.util.get_node_ip_address()``), never to all interfaces.

A rollout actor that dies would be waited for (``max_staleness``, slot guards) until its lease
lapses. Its subscribers are named after the actor (``actor_subscriber_name``: the Ray actor id,
which a restart keeps), so it stops counting as soon as someone who knows says so: the driver
(``ch.evict(actor)``, when Ray reports the actor died or it killed it), or else the restarted actor
itself, whose ``VLLMRollout`` evicts its predecessor's subscribers before subscribing again.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from typing import Any

from ..errors import MissingExtraError, UsageError
from .vllm import EXTENSION as EXTENSION  # re-exported: rollout actors start their LLM with it
from .vllm import VLLMUpdater

# The store-host actors this process started: Ray ends a (non-detached) actor once no handle to
# it is left, even a named one, so the handle is kept here until close_channel.
_HOSTS: dict[str, Any] = {}


def _ray() -> Any:
    try:
        import ray
    except ImportError as e:
        raise MissingExtraError(f"wbridge.integrations.ray needs ray ({e}); pip install 'wbridge[ray]'") from e
    return ray


def actor_subscriber_name(actor: Any = None) -> str | None:
    """The subscriber name of a Ray actor: ``actor`` (a handle), or the calling actor (None: not
    in one). Built from the actor id, which stays the same when Ray restarts the actor."""
    if actor is None:
        actor_id = _ray().get_runtime_context().get_actor_id()
        return None if actor_id is None else f"ray-actor-{actor_id}"
    actor_id = getattr(actor, "_actor_id", None)  # ActorHandle keeps its id there
    if actor_id is None:
        raise UsageError(f"not a Ray actor handle: {actor!r:.80}")
    return f"ray-actor-{actor_id.hex()}"


def node_address() -> str:
    """The address of the Ray node this process runs on (loopback outside Ray)."""
    ray = _ray()
    return ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"


@dataclass(frozen=True)
class Channel:
    """What an actor needs to join a channel; small and picklable, passed to actors' constructors.

    - ``name``: the channel name.
    - ``store``: the store URL (``tcp://host:port`` hosted by ``host_channel``, or ``etcd://...``).
    - ``token``: the channel's shared secret (None: unsigned, unauthenticated).
    - ``actor``: the name of the store-host actor (None: the store is hosted elsewhere).
    """

    name: str
    store: str
    token: str | None = None
    actor: str | None = None

    def publisher(self, rank: int, world_size: int, **options: Any) -> Any:
        """A ``Publisher`` for this trainer rank; transports bind to this node's address."""
        from ..publisher import Publisher

        options.setdefault("host", node_address())
        return Publisher(self.name, self.store, rank=rank, world_size=world_size, token=self.token, **options)

    def subscriber(self, **options: Any) -> Any:
        """A ``Subscriber`` (register it to pull; unregistered it only watches versions)."""
        from ..subscriber import Subscriber

        options.setdefault("host", node_address())
        return Subscriber(self.name, self.store, token=self.token, **options)

    def evict(self, who: Any, timeout: float = 30.0) -> int:
        """Stops counting a dead subscriber at once instead of after its lease (see
        ``Publisher.evict``; harmless to one that is alive). ``who``: a Ray actor handle (the
        subscribers ``VLLMRollout`` made in it), a subscriber name or id. Returns how many."""
        from .. import _validate
        from ..protocol.channel import ChannelStore
        from ..protocol.keys import Keys
        from ..publish.tracker import evict
        from ..store import open_store

        if not isinstance(who, (int, str)):
            who = actor_subscriber_name(who)
        with open_store(self.store, connect_timeout=timeout) as store:
            with store.deadline(time.monotonic() + timeout):
                return len(evict(ChannelStore(store, Keys(self.name), _validate.token(self.token)), who))

    def __repr__(self) -> str:  # the token stays out of logs
        return f"Channel({self.name!r}, store={self.store!r}, token={'set' if self.token else None})"


class _StoreHost:
    """Hosts the ``tcp://`` store of a channel in a Ray actor (see ``host_channel``).

    - ``host``: the address to bind (this node's).
    - ``port``: the port (0: any free one).
    """

    def __init__(self, host: str, port: int) -> None:
        from ..store import open_store

        self._store = open_store(f"tcp://{host}:{port}", host_store=True)

    def url(self) -> str:
        return self._store.url

    def close(self) -> None:
        self._store.close()


def host_channel(
    name: str = "policy",
    *,
    token: str | None = None,
    port: int = 0,
    actor_name: str | None = None,
    detached: bool = False,
) -> Channel:
    """Starts an actor that hosts the channel's store on the caller's node (it reserves no CPU)
    and returns the ``Channel`` to hand to trainer and rollout actors.

    ``token`` None draws a random one. ``actor_name`` names the actor (default
    ``wbridge-store-<name>``) so that ``close_channel`` (or another driver) finds it;
    ``detached=True`` lets it outlive the driver that started it.
    """
    ray = _ray()
    if not ray.is_initialized():
        raise UsageError("host_channel: call ray.init() first")
    actor_name = actor_name or f"wbridge-store-{name}"
    node = ray.get_runtime_context().get_node_id()
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    opts: dict[str, Any] = dict(
        name=actor_name,
        num_cpus=0,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
    )
    if detached:
        opts["lifetime"] = "detached"
    actor = ray.remote(_StoreHost).options(**opts).remote(node_address(), port)
    url = ray.get(actor.url.remote())
    _HOSTS[actor_name] = actor
    return Channel(name, url, token if token is not None else secrets.token_hex(16), actor_name)


def close_channel(channel: Channel, timeout: float = 30.0) -> None:
    """Ends the store-host actor of ``channel``; idempotent (a gone actor is fine)."""
    ray = _ray()
    if channel.actor is None or not ray.is_initialized():
        return
    actor = _HOSTS.pop(channel.actor, None)
    if actor is None:
        try:
            actor = ray.get_actor(channel.actor)
        except ValueError:
            return  # already gone
    try:
        ray.get(actor.close.remote(), timeout=timeout)
    finally:
        ray.kill(actor, no_restart=True)


class VLLMRollout(VLLMUpdater):
    """Keeps a vLLM ``LLM`` on the newest weights of a channel while it generates, in a Ray actor.

    ``VLLMUpdater`` (pulls on the workers' threads while generation goes on, the commit between two
    ``generate`` calls the only pause, each completion with its version), made in a rollout actor's
    constructor, so an actor that Ray restarts subscribes again and pulls the newest version before
    it generates. In an actor the subscribers are named after it (``actor_subscriber_name``) unless
    ``name`` is given, and those of its previous incarnation, if still counted, are evicted first
    (``Channel.evict``).

    - ``llm``: a ``vllm.LLM`` started with ``worker_extension_cls=EXTENSION``.
    - ``channel``: the ``Channel`` to subscribe to.
    - ``timeout``: seconds to wait for the first version and for each pull.
    - ``subscriber_options``: more ``Subscriber`` keywords (``lease_ttl``, ``transport``, ``cache_dir``...).

    As a ``VLLMUpdater`` it follows a store that was lost and came back (the trainers registered
    again), raises a deterministic error its workers met at the next ``generate``, and ``verify()``
    checks what the engine runs on.
    """

    def __init__(self, llm: Any, channel: Channel, *, timeout: float = 60.0, **subscriber_options: Any) -> None:
        from .. import _validate

        if not isinstance(channel, Channel):
            raise UsageError(f"VLLMRollout: channel must be a Channel (host_channel), got {channel!r:.80}")
        timeout = _validate.timeout(timeout, "VLLMRollout timeout", positive=True)
        self.channel = channel
        subscriber_options.setdefault("host", node_address())
        own = actor_subscriber_name() if "name" not in subscriber_options and _ray().is_initialized() else None
        if own is not None:
            subscriber_options["name"] = own
            channel.evict(own, timeout)  # a restarted actor: its dead predecessor stops counting now
        super().__init__(llm, channel.name, channel.store, token=channel.token, timeout=timeout, **subscriber_options)
