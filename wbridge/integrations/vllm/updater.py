"""Keeps a vLLM engine (``vllm.LLM`` or ``AsyncLLM``) on the newest weights of a channel while it generates (no Ray).

Usage::

    llm = LLM(model=path, worker_extension_cls=EXTENSION, ...)
    with VLLMUpdater(llm, "policy", "tcp://trainer:29700", token=token) as updater:  # waits for a first version
        for version, out in updater.generate(prompts, params): ...   # each completion with its version
        updater.stats()                                               # one dict per committed update

    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=path, worker_extension_cls=EXTENSION, ...))
    async with AsyncVLLMUpdater(engine, "policy", "tcp://trainer:29700", token=token) as updater:
        async for version, out in updater.generate(prompt, params):  # commits land between engine steps
            ...

What runs where: each vLLM worker (``WBridgeWorkerExtension``) holds a registered ``Subscriber`` and
a watcher thread (``watch``) that starts a pull into checkpoint-format staging as soon as a new
version is committed, while the engine keeps generating on its current weights. The updater, in the
user's process, only asks the workers whether a pull is staged (``wbridge_staged``) and commits it
(``wbridge_commit``): ``VLLMUpdater`` before each ``generate`` (the engine is idle then);
``AsyncVLLMUpdater`` from a task of the event loop, with the engine's scheduler paused for the
commit only (``pause_generation(mode="keep")``: requests in flight continue on the new weights;
with prefix caching on, they recompute their KV blocks, since vLLM drops its prefix cache only so).
Each commit also sets the engine's weight-version label, so vLLM's own per-token spans
(``CompletionOutput.weight_versions``) name wbridge versions.

Both updaters run one update logic (``_Updater``): it is written as generators of engine
operations (``flow._Op``), which ``VLLMUpdater`` performs by calling the engine and
``AsyncVLLMUpdater`` by awaiting it (``flow._SyncDriver``, ``flow._AsyncDriver``).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from ... import _validate
from ...errors import UsageError, WBridgeError
from ..remote import merge_verified, rebuild, untag
from .flow import _AsyncDriver, _describe, _Flow, _FlowUpdater, _Op, _SyncDriver
from .worker import EXTENSION, WBridgeWorkerExtension, check_subscriber_options

log = logging.getLogger(__name__)


class _Updater(_FlowUpdater):
    """The update logic both updaters share; each subclass performs its ``_Op``s (``_drive``).
    The parameters are the subclasses'."""

    def __init__(self, engine: Any, channel: str, store: str, **options: Any) -> None:
        super().__init__(engine, channel, store, **options)
        _check_extension(engine, type(self).__name__)
        self._pauses: dict[int, float] = {}  # version -> seconds the engine was paused to commit it

    def _check_arguments(self, channel: Any, store: Any, token: Any, timeout: Any, poll: Any, options: dict) -> tuple:
        who = type(self).__name__
        for name, value in (("channel", channel), ("store", store)):
            if not isinstance(value, str) or not value:
                raise UsageError(f"{who}: {name} must be a non-empty string, got {value!r:.80}")
        if token is not None and not isinstance(token, (str, bytes)):
            raise UsageError(f"{who}: token must be a string or None, got {type(token).__name__}")
        timeout = _validate.timeout(timeout, f"{who} timeout", positive=True)
        poll = _validate.timeout(poll, f"{who} poll", positive=True)
        options = check_subscriber_options(channel, store, token, options, who, also=("cache_dir",))
        # the workers' store connection waits no longer than the updater (the default is longer)
        options.setdefault("connect_timeout", timeout)
        return timeout, poll, options

    @property
    def pulling(self) -> bool:
        """Whether the workers were pulling, or had a pull staged, when last asked."""
        return self.state.startswith(("pulling", "staged"))

    # -- the update logic, as generators of engine operations ---------------------------------
    def _start_flow(self) -> _Flow:
        channel, store, kwargs = self._subscription
        yield _Op("rpc", "wbridge_subscribe", args=(channel, store), kwargs=kwargs)
        yield _Op("rpc", "wbridge_watch", kwargs={"timeout": self.timeout})
        return (yield from self._update_flow(wait=True, min_version=1))

    def _update_flow(self, wait: bool, min_version: int | None) -> _Flow:
        """Commits a staged pull; waits for one in flight (``wait``) or until the kernels hold at
        least ``min_version``; returns the kernels' version. A worker whose watcher stopped
        (a deterministic error, or failures for ``timeout``) makes it raise that error, now and
        at every later call."""
        deadline = time.monotonic() + self.timeout
        while True:
            states = yield _Op("rpc", "wbridge_staged")
            kinds = {s["state"] for s in states}
            stopped = [s for s in states if s["state"] == "failed" and not s["retry"]]
            if stopped:
                self.state = f"failed: {stopped[0]['error']}"
                self.error = _worker_error(stopped[0], self.channel)
                raise self.error
            if kinds == {"ready"}:
                versions = sorted({s["version"] for s in states})
                if len(versions) > 1:  # a version was committed between two ranks' reads
                    self.state = f"pulling v{versions[-1]}"
                    yield _Op("rpc", "wbridge_discard", kwargs={"min_version": versions[-1]})
                    continue
                yield from self._commit_flow(versions[0])
                if min_version is None or self.version >= min_version:
                    return self.version
                continue
            if "failed" in kinds and "pulling" not in kinds:  # a pull started by hand failed
                failed = next(s for s in states if s["state"] == "failed")
                self.state = f"failed: {failed['error']}"
                yield _Op("rpc", "wbridge_discard")  # no rank commits alone; the watchers pull again
                now = time.monotonic()
                self._failing_since = self._failing_since or now
                if now - self._failing_since >= self.timeout:
                    raise _worker_error(failed, self.channel)
                log.warning("wbridge: channel %r: %s; pulling again", self.channel, failed["error"])
                yield _Op("sleep", arg=self.poll)
                continue
            self.state = _describe(states, ready="staged")
            pending = bool(wait and kinds & {"pulling", "ready"})
            if (yield from self._wait_flow(pending, min_version, deadline, "vLLM updater")):
                return self.version

    def _commit_flow(self, version: int) -> _Flow:
        t0 = time.perf_counter()
        yield _Op("pause")
        try:
            committed = yield _Op("rpc", "wbridge_commit", kwargs={"timeout": self.timeout})
            if set(committed) != {version}:
                raise WBridgeError(f"vLLM workers committed versions {committed}, expected {version}")
            yield _Op("reset")  # cached KV blocks were computed with the old weights
            yield _Op("label", arg=str(version))
        except BaseException as e:
            self.state = f"failed: {e}"
            raise
        finally:
            yield _Op("resume")
        self.version, self.state, self._failing_since = version, "idle", None
        self._pauses[version] = time.perf_counter() - t0

    def _staged_flow(self) -> _Flow:
        states = yield _Op("rpc", "wbridge_staged")
        self.state = _describe(states, ready="staged")
        ready = [s["version"] for s in states if s["state"] == "ready"]
        return ready[0] if len(ready) == len(states) and len(set(ready)) == 1 else None

    def _stats_flow(self) -> _Flow:
        ranks = yield _Op("rpc", "wbridge_stats")
        out = []
        for per_rank in zip(*ranks):
            v = per_rank[0]["version"]
            merged = {"version": v, "delta": all(s["delta"] for s in per_rank)}
            merged["delta_reason"] = "; ".join(sorted({s.get("delta_reason") or "" for s in per_rank} - {""}))
            merged["transport"] = ",".join(sorted({t for s in per_rank for t in s["transport"].split(",") if t}))
            merged["time"] = max(s["time"] for s in per_rank)
            merged.update({k: sum(s[k] for s in per_rank) for k in ("nbytes", "repaired", "retries")})
            merged.update({k: max(s[k] for s in per_rank) for k in ("pull_s", "prepare_s", "commit_s")})
            merged["pause_s"] = self._pauses.get(v, merged["commit_s"])
            out.append(merged)
        return out

    def _verify_flow(self, timeout: float | None) -> _Flow:
        timeout = self.timeout if timeout is None else _validate.timeout(timeout, "verify() timeout", positive=True)
        ranks = yield _Op("rpc", "wbridge_verify", kwargs={"timeout": timeout})
        return merge_verified(ranks)

    @staticmethod
    def _update_args(wait: Any, min_version: Any) -> None:
        _validate.boolean(wait, "update() wait")
        if min_version is not None:
            _validate.integer(min_version, "update() min_version", minimum=1)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.channel!r}, version={self.version}, {self.state}, "
            f"updates={len(self._pauses)})"
        )


def _worker_error(state: dict, channel: str) -> WBridgeError:
    """The error a worker reported in ``wbridge_staged``, as its own wbridge class."""
    return rebuild({"type": state["error_type"] or "WBridgeError", "message": state["error"]}, f"channel {channel!r}")


def _check_extension(engine: Any, who: str) -> None:
    """A ``UsageError`` if ``engine``'s workers were started without wbridge's worker extension
    (read from its config; an engine object whose config is not found is left to the first RPC)."""
    config = getattr(engine, "vllm_config", None) or getattr(getattr(engine, "llm_engine", None), "vllm_config", None)
    parallel = getattr(config, "parallel_config", None)
    if parallel is None:
        return
    ext = getattr(parallel, "worker_extension_cls", "") or ""
    if ext == EXTENSION or ext is WBridgeWorkerExtension:
        return
    if isinstance(ext, str) and ext:
        import importlib

        module, _, name = ext.rpartition(".")
        try:
            ext = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError, ValueError):
            return  # not importable here: the workers know
    if isinstance(ext, type) and issubclass(ext, WBridgeWorkerExtension):
        return
    raise UsageError(
        f"{who}: the engine's workers lack wbridge's worker extension (worker_extension_cls={ext!r}): "
        f"start the engine with worker_extension_cls=EXTENSION (EXTENSION = {EXTENSION!r}, "
        "from wbridge.integrations.vllm)"
    )


def _from_rpc(e: BaseException, method: str) -> BaseException | None:
    """The wbridge error an engine RPC's exception carries (``remote.untag``), or a
    ``UsageError`` for a worker without the extension; None: neither."""
    err = untag(e)
    if err is None and f"has no attribute '{method}'" in str(e):
        err = UsageError(
            f"the engine's workers have no {method!r}: start the engine with worker_extension_cls=EXTENSION "
            f"(EXTENSION = {EXTENSION!r}, from wbridge.integrations.vllm)"
        )
    return err


class VLLMUpdater(_SyncDriver, _Updater):
    """Keeps a vLLM ``LLM`` on the newest committed version of a channel, pulling in the background.

    - ``llm``: a ``vllm.LLM`` started with ``worker_extension_cls=EXTENSION``.
    - ``channel``: the channel name.
    - ``store``: the store URL (``tcp://host:port`` or ``etcd://...``).
    - ``token``: the channel's shared secret (None: unsigned, unauthenticated).
    - ``timeout``: seconds to wait for the first version and for each pull.
    - ``poll``: seconds between two looks at the workers while ``update`` waits for a pull.
    - ``subscriber_options``: more ``Subscriber`` keywords for the workers' subscribers (``host``,
      ``transport``, ``lease_ttl``, ``name``, ``cache_dir``...).
    """

    def _do(self, op: _Op) -> Any:
        if op.kind == "rpc":
            try:
                return self.llm.collective_rpc(op.method, args=op.args, kwargs=op.kwargs)
            except Exception as e:
                err = _from_rpc(e, op.method)
                if err is None:
                    raise
                raise err from e
        if op.kind == "reset":
            return self.llm.reset_prefix_cache()
        if op.kind == "label":
            return self.llm.llm_engine.set_weight_version(op.arg)
        if op.kind == "sleep":
            return time.sleep(op.arg)
        return None  # pause, resume: the engine generates only inside generate(), not now

    def update(self, wait: bool = False, min_version: int | None = None) -> int | None:
        """Commits a pull the workers' watchers have staged and returns the version the kernels
        hold. ``wait=True`` also waits for a pull in flight; ``min_version`` waits (at most
        ``timeout``) until the kernels hold at least that version. An error that stopped the
        updates (a deterministic one, e.g. a ``PlanError``, at once) is raised, by every call."""
        self._check()
        self._update_args(wait, min_version)
        return self._drive(self._update_flow(wait, min_version))

    def staged(self) -> int | None:
        """The version every worker has pulled and staged (the next ``update`` commits it at
        once), or None; commits nothing."""
        self._check_open()
        return self._drive(self._staged_flow())

    def generate(self, prompts: Any, params: Any) -> list[tuple[int, Any]]:
        """``llm.generate`` after ``update()``: ``[(version, RequestOutput)]``, each completion
        with the version of the weights that produced it."""
        v = self.update()
        return [(v, out) for out in self.llm.generate(prompts, params, use_tqdm=False)]

    def stats(self) -> list[dict]:
        """One dict per committed update, over the engine's workers: ``version``, ``time`` (of the
        commit, seconds since the epoch), ``transport`` (what the pulls read over), ``nbytes``
        (read by all ranks), ``delta`` (every rank applied deltas) and ``delta_reason`` (why or
        why not, where the subscribers say), ``repaired`` chunks, ``retries`` (failed pulls before
        it, retried with backoff), ``pull_s`` and ``prepare_s`` (in the background while the
        engine generated), ``commit_s`` (the workers' commit) and ``pause_s`` (the engine's whole
        pause for it), each the slowest rank's."""
        return self._drive(self._stats_flow())

    def verify(self, timeout: float | None = None) -> dict[str, Any]:
        """Checks what the engine runs on: ``{"version": the kernels' version, "tensors": {name:
        "ok" or why not}, "ok": bool}``. Each worker checks its checkpoint-format staging against
        the publishers' checksums of the version it holds (``Subscriber.verify``), then that its
        live tensors and kernels derive from that staging by the commit's own path (on vLLM's CPU
        build the linear layers' weights live only inside repacked kernels: those are rebuilt from
        staging and compared on an identity probe). A version staged but not committed yet makes
        it ``ok=False`` (``update()`` commits it). ``timeout``: per worker (default: the
        updater's). Raises ``IntegrityError`` (staging does not match the checksums),
        ``StaleVersionError`` (they were collected: the engine is far behind)."""
        self._check_open()
        return self._drive(self._verify_flow(timeout))

    def close(self) -> None:
        """Commits a pull in flight, stops the workers' watchers and leaves the channel
        (idempotent); the engine stays usable on the weights it holds."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.version is not None and self.error is None:
                self._drive(self._update_flow(wait=True, min_version=None))
        finally:
            self.state = "closed"
            self.llm.collective_rpc("wbridge_close")


class AsyncVLLMUpdater(_AsyncDriver, _Updater):
    """Keeps a vLLM ``AsyncLLM`` on the newest committed version of a channel: the workers pull in
    the background and a task of the event loop commits each version between two engine steps.

    - ``engine``: a ``vllm.v1.engine.async_llm.AsyncLLM`` (``vllm.AsyncLLMEngine``) started with
      ``worker_extension_cls=EXTENSION``.
    - ``channel``: the channel name.
    - ``store``: the store URL (``tcp://host:port`` or ``etcd://...``).
    - ``token``: the channel's shared secret (None: unsigned, unauthenticated).
    - ``timeout``: seconds to wait for the first version and for each pull.
    - ``poll``: seconds between two looks at the workers (one RPC, served between engine steps).
    - ``subscriber_options``: more ``Subscriber`` keywords for the workers' subscribers (``host``,
      ``transport``, ``lease_ttl``, ``name``, ``cache_dir``...).

    Nothing happens at construction: ``start()`` (or ``async with``, or the first ``generate``)
    subscribes and waits for the first version.
    """

    _background = ("wbridge", "vLLM updater", "committing")

    async def _do(self, op: _Op) -> Any:
        if op.kind == "rpc":
            try:
                return await self.engine.collective_rpc(op.method, args=op.args, kwargs=op.kwargs)
            except Exception as e:
                err = _from_rpc(e, op.method)
                if err is None:
                    raise
                raise err from e
        if op.kind == "pause":  # requests in flight stay queued and resume on the new weights
            return await self.engine.pause_generation(mode="keep", clear_cache=False)
        if op.kind == "resume":
            return await self.engine.resume_generation()
        if op.kind == "reset":  # vLLM drops cached blocks only with no request holding any:
            cache = getattr(getattr(self.engine, "vllm_config", None), "cache_config", None)
            if getattr(cache, "enable_prefix_caching", True):  # so requests in flight recompute theirs
                return await self.engine.reset_prefix_cache(reset_running_requests=True)
            return None
        if op.kind == "label":
            return await self.engine.update_weight_version(op.arg)
        return await asyncio.sleep(op.arg)

    async def start(self) -> int:
        """Subscribes the workers, starts their watchers, waits for the first version and commits
        it, then commits each new version from a background task; returns the version. Idempotent."""
        return await self._start_once()

    async def generate(
        self, prompt: Any, params: Any, request_id: str | None = None, **kwargs: Any
    ) -> AsyncIterator[tuple[int, Any]]:
        """``engine.generate`` (``kwargs`` passed on), each output with a version: for a finished
        output the oldest version that produced any of its tokens (vLLM's per-token spans,
        ``outputs[i].weight_versions``, have them all: a request in flight over a commit
        continues on the new weights); for a partial (streamed) output the version the kernels
        held when the request was sent, a lower bound."""
        if request_id is not None and (not isinstance(request_id, str) or not request_id):
            raise UsageError(f"AsyncVLLMUpdater.generate: request_id must be a non-empty string, got {request_id!r}")
        await self.start()
        self._check()
        sent = self.version
        request_id = request_id or f"wbridge-{uuid.uuid4().hex}"
        async for out in self.engine.generate(prompt, params, request_id, **kwargs):
            yield _oldest(out, sent), out

    async def update(self, wait: bool = False, min_version: int | None = None) -> int | None:
        """What the background task does, now: commits a staged pull and returns the kernels'
        version; ``wait=True`` also waits for a pull in flight; ``min_version`` waits (at most
        ``timeout``) until the kernels hold at least that version. An error that stopped the
        updates is raised, by every call."""
        self._update_args(wait, min_version)
        await self.start()
        self._check()
        return await self._locked(self._update_flow(wait, min_version))

    async def staged(self) -> int | None:
        """The version every worker has pulled and staged (committed at the task's next look), or None."""
        self._check_open()
        return await self._drive(self._staged_flow())

    async def stats(self) -> list[dict]:
        """One dict per committed update, as ``VLLMUpdater.stats``; ``pause_s`` is how long the
        engine's scheduler was paused for it."""
        return await self._drive(self._stats_flow())

    async def verify(self, timeout: float | None = None) -> dict[str, Any]:
        """What the engine runs on, checked as ``VLLMUpdater.verify`` does (never in the middle of a
        commit)."""
        await self.start()
        self._check_open()
        return await self._locked(self._verify_flow(timeout))

    async def close(self) -> None:
        """Stops the background commits, commits a pull in flight, stops the workers' watchers and
        leaves the channel (idempotent); the engine stays usable on the weights it holds."""
        if self._closed:
            return
        self._closed = True
        try:
            await self._stop_updates()
            if self.version is not None and self.error is None:
                await self._drive(self._update_flow(wait=True, min_version=None))
        finally:
            self.state = "closed"
            await self.engine.collective_rpc("wbridge_close")


def _oldest(out: Any, default: int | None) -> int | None:
    """The oldest wbridge version in a finished output's weight-version spans, else ``default``."""
    versions = [
        int(span.version)
        for completion in getattr(out, "outputs", ())
        for span in getattr(completion, "weight_versions", None) or ()
        if str(span.version).isdigit()
    ]
    return min(versions) if versions else default
