"""Keeps a plain ``vllm.LLM`` on the newest weights of a channel while it generates (no Ray).

Usage::

    llm = LLM(model=path, worker_extension_cls=EXTENSION, ...)
    updater = VLLMUpdater(llm, "policy", "tcp://trainer:29700", token=token)  # waits for a first version
    for version, out in updater.generate(prompts, params): ...   # each completion with its version
    updater.stats()                                               # one dict per committed update
    updater.close()

What runs where: the updater lives in the user's process and holds one unregistered ``Subscriber``
that only watches the channel's committed version. The pulls run on a thread inside each vLLM
worker (``WBridgeWorkerExtension.wbridge_pull_start``), into checkpoint-format staging, while the
engine keeps generating on its current weights; ``generate`` commits a finished pull before it
generates (the only pause) and starts the next pull when a newer version is committed.
"""

from __future__ import annotations

from typing import Any

from ...errors import UsageError


class VLLMUpdater:
    """Keeps a vLLM ``LLM`` on the newest committed version of a channel, pulling in the background.

    - ``llm``: a ``vllm.LLM`` started with ``worker_extension_cls=EXTENSION``.
    - ``channel``: the channel name.
    - ``store``: the store URL (``tcp://host:port`` or ``etcd://...``).
    - ``token``: the channel's shared secret (None: unsigned, unauthenticated).
    - ``timeout``: seconds to wait for the first version and for each pull.
    - ``subscriber_options``: more ``Subscriber`` keywords for the workers' subscribers (``host``,
      ``transport``, ``lease_ttl``, ``name``, ``cache_dir``...).
    """

    def __init__(
        self,
        llm: Any,
        channel: str,
        store: str,
        *,
        token: str | None = None,
        timeout: float = 60.0,
        **subscriber_options: Any,
    ) -> None:
        from ...subscriber import Subscriber

        self.llm, self.timeout = llm, timeout
        self.version: int | None = None  # what the kernels hold
        self._pulling = False
        self._closed = False
        self._watch = Subscriber(channel, store, token=token, host=subscriber_options.get("host", "127.0.0.1"))
        try:
            llm.collective_rpc(
                "wbridge_subscribe", args=(channel, store), kwargs={"token": token, **subscriber_options}
            )
            self._watch.wait_version(after=0, timeout=timeout)
            self.update(wait=True)
        except BaseException:
            self.close()
            raise

    def update(self, wait: bool = False) -> int | None:
        """Commits a finished background pull, starts one when a newer version is committed, and
        returns the version the kernels hold. ``wait=True`` waits for the pull and commits it."""
        if self._pulling and (wait or all(self.llm.collective_rpc("wbridge_pull_done"))):
            self._commit()
        latest = self._watch.latest()
        if not self._pulling and latest is not None and latest > (self.version or 0):
            self.llm.collective_rpc("wbridge_pull_start", kwargs={"timeout": self.timeout, "min_version": latest})
            self._pulling = True
            if wait:
                self._commit()
        return self.version

    @property
    def pulling(self) -> bool:
        """Whether a background pull is in flight (committed by the next ``update``)."""
        return self._pulling

    def _commit(self) -> None:
        self._pulling = False
        versions = set(self.llm.collective_rpc("wbridge_commit", kwargs={"timeout": self.timeout}))
        if len(versions) != 1:
            raise UsageError(f"vLLM workers committed different versions {sorted(versions)}")
        self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights
        self.version = versions.pop()

    def generate(self, prompts: Any, params: Any) -> list[tuple[int, Any]]:
        """``llm.generate`` after ``update()``: ``[(version, RequestOutput)]``, each completion
        with the version of the weights that produced it."""
        v = self.update()
        return [(v, out) for out in self.llm.generate(prompts, params, use_tqdm=False)]

    def stats(self) -> list[dict]:
        """One dict per committed update, over the engine's workers: ``version``, ``nbytes`` (read
        by all ranks), ``delta`` (every rank applied deltas), ``repaired`` chunks, ``pull_s`` and
        ``prepare_s`` (in the background while the engine generated) and ``commit_s`` (the pause),
        each the slowest rank's."""
        ranks = self.llm.collective_rpc("wbridge_stats")
        out = []
        for per_rank in zip(*ranks):
            merged = {"version": per_rank[0]["version"], "delta": all(s["delta"] for s in per_rank)}
            merged.update({k: sum(s[k] for s in per_rank) for k in ("nbytes", "repaired")})
            merged.update({k: max(s[k] for s in per_rank) for k in ("pull_s", "prepare_s", "commit_s")})
            out.append(merged)
        return out

    def close(self) -> None:
        """Leaves the channel (idempotent); the engine stays usable on the weights it holds."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._pulling:
                self._commit()
            self.llm.collective_rpc("wbridge_close")
        finally:
            self._watch.close()
