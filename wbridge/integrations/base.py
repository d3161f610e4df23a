"""What every engine updater is: an object that keeps an inference engine on the newest version of
a channel (``ChannelUpdater``; ``AdapterUpdater`` for LoRA adapters). The updaters: ``vllm.updater``
(weights), ``vllm.lora_updater`` and ``sglang.lora`` (LoRA adapters); each one's docstring lists
the parameters with what it does with them.
"""

from __future__ import annotations

from typing import Any

from ..errors import UsageError


class ChannelUpdater:
    """The channel an updater follows and the state every updater keeps.

    - ``engine``: the engine kept on the channel's newest version.
    - ``channel``: the channel name.
    - ``store``: the store URL (``tcp://host:port`` or ``etcd://...``).
    - ``token``: the channel's shared secret (None: unsigned, unauthenticated).
    - ``timeout``: seconds to wait for the first version and for each pull.
    - ``poll``: seconds between two looks while an update waits.
    - ``subscriber_options``: more ``Subscriber`` keywords for the subscribers the updater makes.
    """

    def __init__(
        self,
        engine: Any,
        channel: str,
        store: str,
        *,
        token: str | None = None,
        timeout: float = 60.0,
        poll: float = 0.05,
        **subscriber_options: Any,
    ) -> None:
        timeout, poll, subscriber_options = self._check_arguments(
            channel, store, token, timeout, poll, subscriber_options
        )
        self.engine, self.channel, self.timeout, self.poll = engine, channel, timeout, poll
        self.version: int | None = None  # what the engine serves now
        # the channel, the store and the keywords of a Subscriber of it
        self._subscription = (channel, store, {"token": token, **subscriber_options})
        self._closed = False

    def _check_arguments(self, channel: Any, store: Any, token: Any, timeout: Any, poll: Any, options: dict) -> tuple:
        """``(timeout, poll, subscriber options)`` as the updater keeps them, or a ``UsageError``
        for what cannot work; here: as given (a subclass checks)."""
        return timeout, poll, options

    def _check_open(self) -> None:
        if self._closed:
            raise UsageError(f"{type(self).__name__} of channel {self.channel!r} is closed")


class AdapterUpdater(ChannelUpdater):
    """A LoRA adapter updater: each version goes to the engine under a name of its own,
    ``<name>@v<version>``.

    - ``name``: the adapter's name in requests (default: the channel).
    - ``poll``: as ``ChannelUpdater``'s; 5 ms by default.
    - ``options``: ``ChannelUpdater``'s other parameters.
    """

    def __init__(
        self, engine: Any, channel: str, store: str, *, name: str | None = None, poll: float = 0.005, **options: Any
    ) -> None:
        super().__init__(engine, channel, store, poll=poll, **options)
        self.name = name or channel

    def adapter_name(self, version: int) -> str:
        """The name version ``version`` has in the engine."""
        return f"{self.name}@v{version}"
