"""What an SGLang engine needs to join a wbridge channel, and how it travels to the scheduler.

The options ride in SGLang's ``model_loader_extra_config`` (JSON) under the key ``"wbridge"``, so
they reach every scheduler process, of the offline ``sgl.Engine`` and of the HTTP server alike.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from ... import _validate
from ...errors import UsageError
from ...options import Zone
from ...subscriber import Subscriber

#: Subscriber keywords that ``subscriber_options`` may set (JSON values; the zone has its own fields).
SUBSCRIBER_OPTIONS = frozenset(
    {"name", "staged", "verify", "lease_ttl", "connect_timeout", "host", "transport_options"}
)
EXTRA_KEY = "wbridge"
DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class SGLangOptions:
    """How each scheduler process of an SGLang engine subscribes and updates.

    channel: the channel the trainers publish on.
    store: the metadata store URL (``tcp://host:port`` or ``etcd://...``).
    token: the channel's shared secret (None: an open channel).
    transport: ``"auto"`` or a transport name.
    dtype: the dtype the trainers publish (``"bfloat16"``...); None: the engine's own dtype. The
        commit casts where it differs from the engine's.
    pull_timeout: seconds one background pull may take once a version is committed.
    commit: ``"copy"`` (a fused copy from staging into the parameters) or ``"swap"`` (point the
        parameters at staging, a pause independent of the model's size; only where nothing captured
        the parameters' addresses: no CUDA graphs, no repacked kernels, as on SGLang's CPU path).
    flush_cache: flush SGLang's prefix cache after each commit, at the first moment the
        scheduler is idle (its cached KV was computed with the old weights).
    cache_dir: where traced layouts are cached (None: trace at every start).
    zone: the zone (cluster) the engine runs in, as for ``Subscriber(zone=...)``: a
        ``Zone(name, relay=...)``, or its name alone (``Zone(name)``); None: every byte from the
        publishers.
    subscriber_options: more ``Subscriber`` keywords (``SUBSCRIBER_OPTIONS``), e.g. ``{"lease_ttl": 3.0}``.
    """

    channel: str
    store: str
    token: str | None = None
    transport: str = "auto"
    dtype: str | None = None
    pull_timeout: float = 120.0
    commit: str = "copy"
    flush_cache: bool = True
    cache_dir: str | None = None
    zone: Zone | str | None = None
    subscriber_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("channel", "store", "transport"):
            v = getattr(self, name)
            if not isinstance(v, str) or not v:
                raise UsageError(f"wbridge SGLang options: {name} must be a non-empty string, got {v!r}")
        if self.token is not None and not isinstance(self.token, str):
            raise UsageError(f"wbridge SGLang options: token must be a string or None, got {type(self.token).__name__}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise UsageError(f"wbridge SGLang options: dtype must be one of {DTYPES} or None, got {self.dtype!r}")
        if self.commit not in ("copy", "swap"):
            raise UsageError(f"wbridge SGLang options: commit must be 'copy' or 'swap', got {self.commit!r}")
        if self.cache_dir is not None and (not isinstance(self.cache_dir, str) or not self.cache_dir):
            raise UsageError(f"wbridge SGLang options: cache_dir must be a path (str) or None, got {self.cache_dir!r}")
        try:
            _validate.timeout(self.pull_timeout, "pull_timeout", positive=True)
            _validate.boolean(self.flush_cache, "flush_cache")
        except UsageError as e:
            raise UsageError(f"wbridge SGLang options: {e}") from None
        if isinstance(self.zone, dict):  # (as it travels in JSON)
            try:
                object.__setattr__(self, "zone", Zone(**self.zone))
            except TypeError as e:
                raise UsageError(f"wbridge SGLang options: zone: {e}") from e
        elif isinstance(self.zone, str):
            object.__setattr__(self, "zone", Zone(self.zone))
        elif self.zone is not None and not isinstance(self.zone, Zone):
            raise UsageError(f"wbridge SGLang options: zone must be a Zone, a zone name or None, got {self.zone!r}")
        opts = self.subscriber_options
        if not isinstance(opts, dict) or set(opts) - SUBSCRIBER_OPTIONS:
            raise UsageError(
                f"wbridge SGLang options: subscriber_options takes {sorted(SUBSCRIBER_OPTIONS)}, got {opts!r}"
            )
        try:  # what the scheduler's Subscriber would refuse, refused here
            Subscriber.check_arguments(
                self.channel, self.store, token=self.token, transport=self.transport, zone=self.zone, **opts
            )
        except UsageError as e:
            raise UsageError(f"wbridge SGLang options: {e}") from None

    def to_extra_config(self, extra: dict[str, Any] | None = None) -> str:
        """``model_loader_extra_config`` (JSON) carrying these options next to ``extra``."""
        return json.dumps({**(extra or {}), EXTRA_KEY: asdict(self)})

    @classmethod
    def from_extra_config(cls, extra: Any) -> tuple[SGLangOptions, dict[str, Any]]:
        """The options and the rest of a ``model_loader_extra_config`` (a dict or JSON text)."""
        if isinstance(extra, str):
            try:
                extra = json.loads(extra or "{}")
            except ValueError as e:
                raise UsageError(f"wbridge SGLang loader: model_loader_extra_config is not JSON: {e}") from None
        if extra is not None and not isinstance(extra, dict):
            raise UsageError(
                f"wbridge SGLang loader: model_loader_extra_config must be a JSON object (or a dict), got {extra!r:.80}"
            )
        rest = dict(extra or {})
        raw = rest.pop(EXTRA_KEY, None)
        if not isinstance(raw, dict):
            raise UsageError(
                "wbridge SGLang loader: model_loader_extra_config has no 'wbridge' options "
                "(build the engine's arguments with wbridge.integrations.sglang.engine_args)"
            )
        try:
            return cls(**raw), rest
        except TypeError as e:
            raise UsageError(f"wbridge SGLang options: {e}") from e
