"""vLLM rollout workers as wbridge subscribers.

Usage::

    llm = LLM(model=path, worker_extension_cls="wbridge.integrations.vllm.WBridgeWorkerExtension")
    llm.collective_rpc("wbridge_subscribe", args=("policy", "tcp://trainer:29700"), kwargs={"token": "..."})
    v = llm.collective_rpc("wbridge_pull", kwargs={"timeout": 60.0})[0]   # after each trainer publish
    llm.reset_prefix_cache()      # cached KV blocks were computed with the old weights

The same machinery is offered as vLLM's weight-transfer backend ``"wbridge"``
(``WeightTransferConfig(backend="wbridge")``, driven by ``LLM.init_weight_transfer_engine`` /
``start_weight_update`` / ``update_weights`` / ``finish_weight_update``): see ``transfer``.

How a pull reaches the kernels
------------------------------
vLLM post-processes weights after loading (on CPU it repacks linear weights for its GEMM kernels
and drops the original parameter; on GPU it derives FP8 scales and kernel layouts), so writing
into ``param.data`` after start-up changes nothing the kernels read for those layers. wbridge
therefore pulls into a *checkpoint-format* copy of each rank's parameters (fused ``qkv_proj``,
``gate_up_proj``, stacked experts, TP-sliced, as ``load_weights`` leaves them before processing),
and then, per parameter (``commit``): copies it into the live parameter where vLLM's
processing is the identity (one fused copy from a flat staging buffer on the parameter's device);
rebuilds the kernel of an unquantised linear layer from staging on the pull's thread and swaps it
in at commit; and replays vLLM's own reload lifecycle (``initialize_layerwise_reload`` -> load ->
``finalize_layerwise_reload``) for the remaining layers, so vLLM re-runs its processing exactly as
at start-up. With a background pull (``wbridge_pull_start`` / ``update_info["background"]``) the
engine keeps generating on its old weights until the commit, which is the only pause.

The destination layout is traced from the engine's own ``load_weights`` (``wbridge.integrations.trace``), run on
the checkpoint-format parameters that the reload machinery restores, and cached as JSON keyed by
the model config, the vLLM version and the rank.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from ... import _validate
from ...errors import LayoutError, PlanError, UsageError, WaitTimeout, WBridgeError
from ..follow import Watcher
from ..remote import describe, tag
from ..trace import TraceResult, trace_load_weights, traced
from .commit import UNCHECKED, Reload, allocate_staging, check, commit, plan_commit, prepare
from .lora import LoRAWorkerMixin
from .state import Background, Fetched, WorkerState

DEFAULT_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "wbridge", "traces")
#: What to pass vLLM as ``worker_extension_cls``.
EXTENSION = "wbridge.integrations.vllm.WBridgeWorkerExtension"

log = logging.getLogger(__name__)

_F = TypeVar("_F", bound=Callable[..., Any])


def hf_checkpoint_shapes(hf_config: Any) -> dict[str, tuple[int, ...]]:
    """Canonical (checkpoint) names and shapes for a Hugging Face config, from transformers'
    model class built on the meta device (no memory)."""
    from ..transformers import config_shapes

    return config_shapes(hf_config)


def _portable(t: Any) -> tuple[str, list[int], bytes]:
    import torch

    t = t.detach().cpu().contiguous()
    return str(t.dtype).removeprefix("torch."), list(t.shape), t.reshape(-1).view(torch.uint8).numpy().tobytes()


def portable_to_tensor(x: tuple[str, list[int], bytes]) -> Any:
    """Inverse of the ``(dtype, shape, raw bytes)`` form the inspection RPCs return."""
    import torch

    dtype, shape, raw = x
    if not raw:
        return torch.empty(shape, dtype=getattr(torch, dtype))
    buf = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return buf.view(getattr(torch, dtype)).reshape(shape)


def check_subscriber_options(
    channel: Any, store: Any, token: Any, options: Mapping[str, Any], who: str, also: tuple[str, ...] = ()
) -> dict[str, Any]:
    """``options`` (``Subscriber`` keywords, and ``also``) as a copy, once ``Subscriber`` would
    take them with ``channel``, ``store`` and ``token`` (``Subscriber.check_arguments``: nothing is
    opened); else a ``UsageError`` naming the first it refuses, prefixed with ``who``."""
    from ...subscriber import Subscriber

    if not isinstance(options, Mapping):
        raise UsageError(f"{who}: subscriber options must be a mapping of Subscriber keywords, got {options!r:.80}")
    try:
        Subscriber.check_arguments(channel, store, token=token, **{k: v for k, v in options.items() if k not in also})
    except UsageError as e:
        raise UsageError(f"{who}: {e}") from None
    return dict(options)


_DTYPES = re.compile(r"dtype (\w+) on source rank \d+ but (\w+) on destination rank")


def _in_engine_terms(e: BaseException, sub_id: int | None, rank: int) -> BaseException:
    """``e`` as an engine's user reads it: the planner's "destination rank <subscriber id>" is
    this worker's rank; a dtype mismatch says what the trainer writes to publish the engine's
    dtype. Other errors are returned as they are."""
    if not isinstance(e, PlanError) or sub_id is None:
        return e
    text = re.sub(rf"\bdestination rank {sub_id}\b", f"vLLM worker rank {rank} (subscriber {sub_id})", str(e))
    m = _DTYPES.search(str(e))
    if m is not None:
        src, dst = m.groups()
        text += (
            f". The trainer publishes {src} and this engine runs {dst}: register the trainer's "
            f"tensors with register(..., dtype=torch.{dst}) (the publisher casts in its snapshot)"
        )
    out = type(e)(text)
    out.__cause__ = e
    return out


def _rpc(fn: _F) -> _F:
    """An extension method called through the engine's RPC: a wbridge error it raises is tagged
    with its class and this worker's rank, so the caller's side raises the same class again
    (``wbridge.integrations.remote``)."""

    @functools.wraps(fn)
    def wrapper(self: WBridgeWorkerExtension, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(self, *args, **kwargs)
        except WBridgeError as e:
            raise tag(e, f"vLLM worker rank {self._wbridge_rank()}") from e

    return wrapper  # type: ignore[return-value]


def _timeout(value: Any, what: str) -> float:
    return _validate.timeout(value, f"wbridge: {what}", positive=True)


def _min_version(value: Any, what: str) -> int | None:
    return None if value is None else _validate.integer(value, f"wbridge: {what}", minimum=1)


class WBridgeWorkerExtension(LoRAWorkerMixin):
    """Mixed into vLLM's worker (``worker_extension_cls``); methods are called through
    ``LLM.collective_rpc`` on every rank. Every method checks its arguments (``UsageError``
    naming the argument); a wbridge error it raises reaches the caller as the same class
    (``wbridge.integrations.remote``). Its LoRA adapter channels' RPCs (``wbridge_lora_*``)
    come from ``lora.LoRAWorkerMixin``.

    ``wbridge_subscribe(channel, store, token=None, transport="auto")`` traces the layout, allocates
    the checkpoint-format destination tensors and joins the channel. ``wbridge_pull(timeout)``
    pulls the newest version into them and reloads the engine's weights; returns the version.
    The worker's state is one ``WorkerState`` (``state``), in ``_wbridge``.
    """

    _wbridge: WorkerState | None = None

    # -- helpers (names prefixed: the worker class has its own attributes) ------------------------
    def _wbridge_model(self) -> Any:
        runner = getattr(self, "model_runner", None)
        if runner is None:
            raise UsageError("wbridge: this vLLM worker has no model_runner")
        return runner.get_model() if hasattr(runner, "get_model") else runner.model

    def _wbridge_model_config(self) -> Any:
        cfg = getattr(self, "vllm_config", None) or self.model_runner.vllm_config
        return cfg.model_config

    def _wbridge_rank(self) -> int:
        return int(getattr(self, "rank", 0))

    def _wbridge_holder(self) -> WBridgeWorkerExtension:
        """Who holds the subscription: this worker, or (when the engine was started with
        ``WeightTransferConfig(backend="wbridge")`` and the extension only inspects) its
        weight-transfer engine."""
        if self._wbridge is None:
            engine = getattr(self, "weight_transfer_engine", None)
            if isinstance(engine, WBridgeWorkerExtension):
                return engine
        return self

    def _wbridge_state(self, what: str) -> WorkerState:
        state = self._wbridge_holder()._wbridge
        if state is None:
            raise UsageError(f"wbridge: {what} before wbridge_subscribe (or init_weight_transfer_engine)")
        return state

    @_rpc
    def wbridge_trace(
        self, canonical: Mapping[str, Any] | None = None, cache_dir: str | None = DEFAULT_CACHE
    ) -> TraceResult:
        """The rank's checkpoint-format layout, traced from the engine's own ``load_weights``."""
        import vllm

        if canonical is not None and not isinstance(canonical, Mapping):
            raise UsageError(f"wbridge: wbridge_trace canonical must be a mapping name -> shape, got {canonical!r:.80}")
        if cache_dir is not None and not isinstance(cache_dir, str):
            raise UsageError(f"wbridge: cache_dir must be a directory path or None, got {cache_dir!r:.80}")
        model, mc = self._wbridge_model(), self._wbridge_model_config()
        shapes = canonical or hf_checkpoint_shapes(mc.hf_config)
        parallel = getattr(self, "parallel_config", None) or self.model_runner.vllm_config.parallel_config

        def run() -> TraceResult:
            with Reload(model, mc, loads=False) as rl:
                rl.unwrapped()
                return trace_load_weights(model, model.load_weights, shapes)

        tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
        ep = getattr(parallel, "enable_expert_parallel", False)
        return traced(cache_dir, run, mc, "vllm", vllm.__version__, self._wbridge_rank(), shapes, tp=tp, pp=pp, ep=ep)

    @_rpc
    def wbridge_subscribe(
        self,
        channel: str,
        store: str,
        token: str | None = None,
        transport: str = "auto",
        cache_dir: str | None = DEFAULT_CACHE,
        **subscriber_kwargs: Any,
    ) -> int:
        """Traces the layout, allocates destination tensors and joins ``channel``; returns the
        number of destination tensors."""

        from ...subscriber import Subscriber

        options = check_subscriber_options(
            channel, store, token, {"transport": transport, **subscriber_kwargs}, "wbridge_subscribe"
        )
        if cache_dir is not None and not isinstance(cache_dir, str):
            raise UsageError(f"wbridge: cache_dir must be a directory path or None, got {cache_dir!r:.80}")
        if self._wbridge is not None:
            self.wbridge_close()
        rank = self._wbridge_rank()
        # first: the store is opened before the trace
        sub = Subscriber(channel, store, token=token, **{"name": f"vllm-rank{rank}-{os.getpid()}", **options})
        try:
            trace = self.wbridge_trace(cache_dir=cache_dir)
            shapes = self._wbridge_checkpoint_shapes(trace)
            plan = plan_commit(self._wbridge_model(), shapes)  # on the live, processed model
            staging = allocate_staging(self._wbridge_model(), plan, shapes, self._wbridge_model_config().dtype)
            entries = trace.bind(staging)
            sub.register(entries)
            # a wrong token fails here, not at the first update: the committed version's record
            # (once there is one) is sealed with the channel's token
            sub.latest()
        except BaseException:
            sub.close()
            raise
        self._wbridge = WorkerState(sub, staging, plan, rank)
        return len(entries)

    def _wbridge_checkpoint_shapes(self, trace: TraceResult) -> dict[str, tuple[int, ...]]:
        model, mc = self._wbridge_model(), self._wbridge_model_config()
        with Reload(model, mc, loads=False) as rl:
            rl.unwrapped()
            params = dict(model.named_parameters())
            missing = [n for n in trace.entries if n not in params]
            if missing:
                raise LayoutError(f"traced parameters not in the model (stale trace cache?): {missing[:3]}")
            return {n: tuple(params[n].shape) for n in trace.entries}

    @_rpc
    def wbridge_pull(self, timeout: float = 60.0, min_version: int | None = None) -> int:
        """Pulls the newest version (at least ``min_version``) and reloads it into the engine;
        returns the version."""
        timeout = _timeout(timeout, "wbridge_pull timeout")
        min_version = _min_version(min_version, "wbridge_pull min_version")
        holder = self._wbridge_holder()
        fetched = holder._wbridge_fetch(timeout, min_version)
        holder._wbridge_commit(fetched)
        return fetched.version

    @_rpc
    def wbridge_pull_start(self, timeout: float = 60.0, min_version: int | None = None) -> None:
        """Starts pulling the newest version (at least ``min_version``) into staging on a worker
        thread and returns at once: the engine keeps generating on its current weights. Then
        ``wbridge_commit()`` (the only pause) waits for the pull and commits it into the kernels.
        The thread also builds the repacked layers' new kernels (``commit.prepare``)."""
        timeout = _timeout(timeout, "wbridge_pull_start timeout")
        min_version = _min_version(min_version, "wbridge_pull_start min_version")
        if not self._wbridge_holder()._wbridge_start(timeout, min_version, auto=False):
            raise UsageError("wbridge: a background pull is already running; commit it first")

    def _wbridge_start(self, timeout: float, min_version: int | None, auto: bool) -> bool:
        """Starts the background pull unless one is there (False); ``auto``: for the watcher."""
        state = self._wbridge_state("a background pull")
        with state.lock:
            if state.background is not None or (auto and state.verifying):
                return False
            bg = Background(self._wbridge_fetch, timeout, min_version, auto, self._wbridge_ended)
            bg.thread.start()  # before others see it: an unstarted thread is not alive either
            state.background = bg
        return True

    def _wbridge_ended(self, bg: Background) -> None:
        """On the pull's thread, once it ended: the watcher retries a failed pull it started
        (after its backoff) or stops on it; a pull started by hand waits for ``wbridge_commit``."""
        state = self._wbridge
        if state is None:
            return
        watcher = state.watcher
        if bg.error is not None:
            state.failures += 1
        if not bg.auto or watcher is None:
            if watcher is not None:
                watcher.poke()
            return
        if bg.error is None:
            watcher.succeeded()
            return
        with state.lock:
            if state.background is bg:
                state.background = None  # the watcher pulls again, or reports the error
        watcher.failed(bg.error)
        watcher.poke()

    @_rpc
    def wbridge_pull_done(self) -> bool:
        """Whether the background pull has finished (successfully or not)."""
        state = self._wbridge_holder()._wbridge
        bg = None if state is None else state.background
        return bg is None or not bg.thread.is_alive()

    @_rpc
    def wbridge_commit(self, timeout: float = 60.0) -> int:
        """Waits (at most ``timeout``) for the background pull, then commits it into the engine;
        returns the version. A failed pull raises its error and leaves the kernels alone."""
        timeout = _validate.timeout(timeout, "wbridge: wbridge_commit timeout")
        holder = self._wbridge_holder()
        state = holder._wbridge_state("wbridge_commit")
        bg = state.background
        if bg is None:
            raise UsageError("wbridge: wbridge_commit without wbridge_pull_start")
        bg.thread.join(timeout)
        if bg.thread.is_alive():
            raise WaitTimeout(f"wbridge: the background pull did not finish within {timeout:.1f}s")
        try:
            if bg.error is not None:
                raise bg.error
            holder._wbridge_commit(bg.result)
        finally:
            with state.lock:
                if state.background is bg:
                    state.background = None
            if state.watcher is not None:
                state.watcher.poke()
        return bg.result.version

    @_rpc
    def wbridge_watch(self, timeout: float = 60.0) -> None:
        """Starts (once) a thread that watches the channel and starts the background pull
        (``wbridge_pull_start``) as soon as a version newer than the kernels' is committed, so the
        next ``wbridge_commit`` finds it staged; ``timeout`` bounds each pull, and how long
        transient failures are retried (with backoff) before the watcher stops. A deterministic
        error (``remote.DETERMINISTIC``) stops it at once. After a pull it waits for that pull's
        commit (or ``wbridge_discard``). ``wbridge_close`` stops it."""
        timeout = _timeout(timeout, "wbridge_watch timeout")
        holder = self._wbridge_holder()
        state = holder._wbridge_state("wbridge_watch")
        if state.watcher is not None and state.watcher.alive:
            return
        state.skip = 0
        state.watcher = Watcher(
            state.sub.wait_version,
            lambda: holder._wbridge_floor(state),
            lambda v: holder._wbridge_start(timeout, v, auto=True),
            give_up_s=timeout,
            name=f"wbridge-vllm-watch-{state.rank}",
        )
        state.watcher.start()

    @staticmethod
    def _wbridge_floor(state: WorkerState) -> int | None:
        """For the watcher: the version it pulls only above, or None while a pull is in flight
        or staged, or a verification runs."""
        if state.background is not None or state.verifying:
            return None
        return max(state.version or 0, state.skip)

    @_rpc
    def wbridge_staged(self) -> dict[str, Any]:
        """The background pull, as ``{"state", "version", "error", "error_type", "retry",
        "held", "retries"}``: ``state`` is ``"idle"`` (none), ``"pulling"`` (``version``: at
        least this one), ``"ready"`` (staged: ``wbridge_commit`` puts ``version`` into the kernels
        at once) or ``"failed"`` (``error`` says what, ``error_type`` its wbridge class;
        ``retry``: the watcher pulls again once the failed pull is discarded, False when the
        watcher itself stopped on it); ``held``: the kernels' version; ``retries``: failed pulls
        the watcher retried."""
        state = self._wbridge_state("wbridge_staged")
        bg, watcher = state.background, state.watcher
        out: dict[str, Any] = {
            "state": "idle", "version": None, "error": None, "error_type": None, "retry": True,
            "held": state.version, "retries": 0 if watcher is None else watcher.retries,
        }  # fmt: skip
        where = f"vLLM worker rank {state.rank}"
        if bg is None:
            if watcher is not None and watcher.error is not None:
                err = describe(watcher.error, f"{where}, the channel watcher stopped")
                out.update(state="failed", retry=False, error=err["message"], error_type=err["type"])
        elif not bg.finished:
            out.update(state="pulling", version=bg.min_version)
        elif bg.error is not None:
            err = describe(bg.error, f"{where}, the pull failed")
            out.update(state="failed", version=bg.min_version, error=err["message"], error_type=err["type"])
        else:
            out.update(state="ready", version=bg.result.version)
        return out

    @_rpc
    def wbridge_discard(self, min_version: int | None = None) -> None:
        """Drops a finished background pull without committing it (the kernels stay as they are);
        the watcher then pulls again: at least ``min_version`` when given, else the newest. A pull
        still running (one the watcher started since the caller looked) is left to finish."""
        min_version = _min_version(min_version, "wbridge_discard min_version")
        state = self._wbridge_state("wbridge_discard")
        with state.lock:
            bg = state.background
            if bg is not None and bg.finished:
                state.background = None
            if min_version is not None:
                state.skip = min_version - 1
        if state.watcher is not None:
            state.watcher.poke()

    # The two halves of a pull, apart so that the weight-transfer backend (``transfer``) can
    # fetch in ``update_weights`` and commit in ``finish_weight_update``.
    def _wbridge_fetch(self, timeout: float, min_version: int | None = None) -> Fetched:
        """Pulls into the checkpoint-format staging tensors and builds the repacked layers' new
        kernels from them (the live kernels are untouched)."""
        state = self._wbridge_state("a pull")
        state.fetched = None  # staging is about to change: kernels built from it are stale
        sub = state.sub
        t0 = time.perf_counter()
        try:
            v = sub.pull(min_version=min_version, timeout=timeout)
        except WBridgeError as e:
            raise _in_engine_terms(e, sub.id, state.rank) from e
        t1 = time.perf_counter()
        prepared = prepare(self._wbridge_model(), state.plan, state.staging)
        transport = ",".join(sorted({name for name, _ in sub.stats.transports.values()}))
        return Fetched(v, t1 - t0, time.perf_counter() - t1, prepared, sub.stats.last, transport)

    def _wbridge_commit(self, fetched: Fetched) -> None:
        """Puts the staged version into the kernels (``commit.commit``): the only pause."""
        state = self._wbridge_state("a commit")
        t1 = time.perf_counter()
        state.version = None  # a failed commit leaves the kernels on no known version
        model = self._wbridge_model()
        commit(model, self._wbridge_model_config(), state.plan, state.staging, fetched.prepared)
        state.version = fetched.version
        pulled = fetched.stats
        state.stats.append(
            {
                "version": fetched.version,
                "time": time.time(),
                "transport": fetched.transport,
                "nbytes": 0 if pulled is None else pulled.nbytes,
                "delta": False if pulled is None else pulled.delta,
                "delta_reason": "" if pulled is None else pulled.delta_reason,
                "repaired": 0 if pulled is None else pulled.repaired,
                "retries": state.failures,
                "pull_s": fetched.pull_s,
                "prepare_s": fetched.prepare_s,
                "commit_s": time.perf_counter() - t1,
            }
        )
        state.failures = 0

    @_rpc
    def wbridge_verify(self, timeout: float = 60.0) -> dict[str, Any]:
        """Checks what the kernels run on: the checkpoint-format staging against the publishers'
        checksums of the version it holds (``Subscriber.verify``), then each live tensor and
        kernel against the staging, through the same path a commit takes (``commit.check``:
        direct parameters byte for byte, repacked kernels rebuilt from staging by
        ``commit.prepare`` and compared on an identity probe). Returns ``{"version": the kernels'
        version, "staged": staging's, "tensors": {name: "ok" or why not}, "ok": bool}``. A pull in
        flight is waited for (at most ``timeout``) and the watcher starts none meanwhile."""
        timeout = _timeout(timeout, "wbridge_verify timeout")
        state = self._wbridge_state("wbridge_verify")
        deadline = time.monotonic() + timeout
        state.verifying = True
        try:
            bg = state.background
            if bg is not None:
                bg.thread.join(max(0.0, deadline - time.monotonic()))
                if bg.thread.is_alive():
                    raise WaitTimeout(f"wbridge: verify: the background pull did not finish within {timeout:.1f}s")
            if state.sub.version is None:  # nothing whole in staging: no pull yet, or one failed midway
                why = "staging holds no whole version (no pull yet, or the last one failed)"
                tensors = dict.fromkeys(state.staging, why)
                return {"version": state.version, "staged": None, "tensors": tensors, "ok": False}
            staged = state.sub.verify(timeout=max(0.1, deadline - time.monotonic()))
            tensors = check(self._wbridge_model(), state.plan, state.staging)
        finally:
            state.verifying = False
            if state.watcher is not None:
                state.watcher.poke()
        if staged != state.version:
            held = "no known version" if state.version is None else f"version {state.version}"
            why = f"staging holds version {staged}, the kernels {held}: the next update commits it"
            tensors = {k: f"{v} ({why})" for k, v in tensors.items()}
        ok = staged == state.version and all(v == "ok" or v.startswith(UNCHECKED) for v in tensors.values())
        return {"version": state.version, "staged": staged, "tensors": tensors, "ok": ok}

    @_rpc
    def wbridge_commit_plan(self) -> dict[str, list[str]]:
        """How each staged parameter reaches the kernels: ``{"direct": [parameter names],
        "repack": [module names], "reload": [module names]}`` (see ``commit``)."""
        return self._wbridge_state("wbridge_commit_plan").plan.as_dict()

    @_rpc
    def wbridge_version(self) -> int | None:
        """The wbridge version the engine's kernels hold (None before the first update)."""
        state = self._wbridge_holder()._wbridge
        return None if state is None else state.version

    @_rpc
    def wbridge_stats(self) -> list[dict]:
        """One dict per committed update of this rank: ``version``, ``time`` (of the commit,
        seconds since the epoch), ``transport`` (what the pull read over), ``nbytes`` read,
        ``delta`` (whether the pull applied deltas) and ``delta_reason`` (why or why not, where
        the subscriber says), ``repaired`` chunks, ``retries`` (failed pulls before it),
        ``pull_s``, ``prepare_s`` (kernels rebuilt in the background) and ``commit_s`` (the pause)."""
        state = self._wbridge_holder()._wbridge
        return [] if state is None else [dict(s) for s in state.stats]

    @_rpc
    def wbridge_staging(self) -> dict[str, tuple[str, list[int], bytes]]:
        """The checkpoint-format tensors of the last pull, as ``(dtype, shape, raw bytes)`` (RPC-safe;
        ``portable_to_tensor`` rebuilds them)."""
        state = self._wbridge_holder()._wbridge
        return {} if state is None else {k: _portable(v) for k, v in state.staging.items()}

    @_rpc
    def wbridge_digests(self) -> dict[str, str]:
        """SHA-256 of each checkpoint-format tensor of the last pull (JSON-safe: for vLLM's
        ``/collective_rpc`` route, which passes on only strings, lists and dicts)."""
        import hashlib

        state = self._wbridge_holder()._wbridge
        staging = {} if state is None else state.staging
        return {k: hashlib.sha256(_portable(v)[2]).hexdigest() for k, v in staging.items()}

    @_rpc
    def wbridge_parameters(self) -> dict[str, tuple[str, list[int], bytes]]:
        """The engine's live parameters and buffers as its kernels see them, as
        ``(dtype, shape, raw bytes)``."""
        model = self._wbridge_model()
        out = {k: _portable(v) for k, v in model.named_parameters()}
        out.update({f"buffer:{k}": _portable(v) for k, v in model.named_buffers()})
        return out

    def wbridge_close(self) -> None:
        """Stops the watcher and leaves the channel (idempotent); the kernels keep their weights."""
        state, self._wbridge = self._wbridge, None
        if state is None:
            return
        if state.watcher is not None:
            state.watcher.close()
        try:
            state.sub.close()
        except WBridgeError as e:  # the publisher (and its store) may be gone already
            log.warning("wbridge: closing the subscriber: %s", e)
