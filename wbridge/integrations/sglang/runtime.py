"""The wbridge side of one SGLang scheduler process: staging, the background puller, the commit.

Started by ``WBridgeModelLoader`` right after the engine loaded its checkpoint, inside the
scheduler process (each tensor-parallel rank has its own):

1. The layout of the model's parameters in checkpoint names (fused ``qkv_proj``, ``gate_up_proj``,
   stacked experts, TP-sliced) is traced from SGLang's own ``load_weights``
   (``wbridge.integrations.trace``) and cached.
2. Staging: one flat buffer on the parameters' device holding a tensor of each traced
   parameter's shape, registered with a ``Subscriber``. Pulls land there, never in the live
   parameters, so the engine keeps generating on complete old weights while a pull is in flight.
3. A puller thread follows the channel: it waits for each newly committed version and pulls it
   into staging.
4. Between two scheduler steps (a hook after ``Scheduler.ingest_requests``, SGLang's plugin hook
   registry) a staged version is committed, then ``Scheduler.record_weight_version_change`` so
   every output's ``meta_info["weight_version"]`` / ``["weight_versions"]`` names the versions that
   produced its tokens. The commit is the only pause; it never waits for a pull (a pull in flight
   is committed at a later step). ``commit="copy"``: one fused copy (``torch._foreach_copy_``)
   from staging into the live parameters. ``commit="swap"`` (where nothing captured the
   parameters' addresses: no CUDA graphs, no repacked kernels): the parameters are pointed at
   the staging tensors (a pause independent of the model's size); the puller thread then copies
   staging into the parameters' own memory and, at a later step, points them back, which frees
   staging for the next pull.
5. Stats go into the scheduler's internal state (``get_server_info()["internal_states"]``, HTTP
   ``/server_info``) under ``"wbridge"``.
6. ``verify`` (the scheduler's ``wbridge_verify``, called through ``Engine.collective_rpc`` or the
   HTTP ``/set_internal_state`` route, ``client.verify``) checks staging against the publishers'
   checksums and the live parameters against staging; its result goes into the stats.

The puller thread is a ``wbridge.integrations.follow.Watcher``: a deterministic error (a dtype
the trainer does not publish, a wrong token) stops it, logged once and reported in the stats
(``error``, ``error_type``, ``stopped``); transient ones are retried with backoff (``retries``).

On this CPU (no AMX) SGLang computes with the parameters as loaded, so the copy reaches the
kernels. Layers whose weights SGLang repacks after loading (``use_intel_amx_backend`` on CPU) are
refused at start with a ``LayoutError`` naming them.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Any

from ...errors import LayoutError, UsageError, WaitTimeout, WBridgeError
from ..follow import Watcher
from ..remote import describe, tag
from ..trace import TraceResult, trace_load_weights, traced
from .options import SGLangOptions

log = logging.getLogger("wbridge.sglang")

#: Where the hooks go (SGLang's ``HookRegistry`` dotted targets).
STEP_HOOK = "sglang.srt.managers.scheduler.Scheduler.ingest_requests"
STATE_HOOK = "sglang.srt.managers.scheduler.Scheduler.get_internal_state"
SET_STATE_HOOK = "sglang.srt.managers.scheduler.Scheduler.set_internal_state"
#: The key of ``/set_internal_state``'s ``server_args`` that asks for a verification (its value:
#: the timeout in seconds), and the scheduler method ``Engine.collective_rpc`` calls for it.
VERIFY = "wbridge_verify"

_RUNTIMES: list[Runtime] = []
_hooks_lock = threading.Lock()
_hooks_installed = False


def trace_layout(model: Any, model_config: Any, rank: int, tp_size: int, cache_dir: str | None) -> TraceResult:
    """The rank's checkpoint-format layout, traced from SGLang's ``load_weights``."""
    import sglang

    from ..vllm import hf_checkpoint_shapes

    shapes = hf_checkpoint_shapes(model_config.hf_config)

    def run() -> TraceResult:
        return trace_load_weights(model, model.load_weights, shapes)

    return traced(cache_dir, run, model_config, "sglang", sglang.__version__, rank, shapes, tp=tp_size)


def check_unpacked(model: Any) -> None:
    """Refuses a model whose kernels read repacked copies of its weights (a copy into the
    parameters would not reach them)."""
    packed = [n for n, m in model.named_modules() if getattr(m, "use_intel_amx_backend", False)]
    if packed:
        raise LayoutError(
            f"wbridge SGLang: layers {packed[:3]} (of {len(packed)}) run on repacked AMX weights; "
            "updating them in place is not supported (start SGLang without the AMX backend)"
        )


def allocate_staging(params: dict[str, Any], names: list[str], dtype: Any) -> dict[str, Any]:
    """One flat buffer on the parameters' device with a view of each parameter's shape, in ``dtype``."""
    import torch

    devices = {params[n].device for n in names}
    if len(devices) != 1:
        raise LayoutError(f"wbridge SGLang: the model's parameters sit on several devices {sorted(map(str, devices))}")
    flat = torch.zeros(sum(math.prod(params[n].shape) for n in names), dtype=dtype, device=devices.pop())
    out, off = {}, 0
    for n in names:
        k = math.prod(params[n].shape)
        out[n] = flat[off : off + k].view(tuple(params[n].shape))
        off += k
    return out


class Runtime:
    """One scheduler process's subscription (see the module docstring).

    model: the loaded SGLang model (its parameters are the commit's destination).
    model_config: SGLang's ModelConfig (its ``hf_config`` gives the checkpoint names).
    options: the channel and update options.
    rank: the tensor-parallel rank (names the subscriber, keys the trace cache).
    tp_size: the tensor-parallel size.
    """

    def __init__(self, model: Any, model_config: Any, options: SGLangOptions, rank: int, tp_size: int) -> None:
        import torch

        from ...subscriber import Subscriber

        check_unpacked(model)
        self.options, self.rank = options, rank
        t0 = time.perf_counter()
        trace = trace_layout(model, model_config, rank, tp_size, options.cache_dir)
        params = dict(model.named_parameters())
        names = [n for n in trace.entries if n in params]
        missing = sorted(set(trace.entries) - set(names))
        if missing:
            raise LayoutError(f"wbridge SGLang: traced parameters not in the model (stale trace cache?): {missing[:3]}")
        dtype = getattr(torch, options.dtype) if options.dtype else params[names[0]].dtype
        self.staging = allocate_staging(params, names, dtype)
        self._params = [params[n] for n in names]
        self._live = [params[n].data for n in names]
        self._staged = [self.staging[n] for n in names]
        self.nbytes = sum(t.numel() * t.element_size() for t in self._staged)
        kw = {"name": f"sglang-rank{rank}", **options.subscriber_options}
        if options.zone is not None:
            kw["zone"] = options.zone
        self.sub = Subscriber(options.channel, options.store, token=options.token, transport=options.transport, **kw)
        try:
            self.sub.register(trace.bind(self.staging))
            self.sub.latest()  # a wrong token fails at start, not at the first update
        except BaseException:
            self.sub.close()
            raise
        self.subscribe_s = time.perf_counter() - t0
        self.version: int | None = None  # what the live parameters hold
        self.staged: int | None = None  # a complete version in staging, not committed yet
        self.pulling: int | None = None  # the version a pull in flight waits for or reads
        self.error: dict[str, Any] | None = None  # the last failed pull (``remote.describe``)
        self.verified: dict[str, Any] | None = None  # the last ``verify`` (its result or error)
        self.history: list[dict[str, Any]] = []
        self._flush_pending = False
        # "free": staging may be pulled into; "staged": it holds ``staged``; "swapped": the
        # parameters point at staging; "copied": the parameters' own memory holds the same again
        self._phase = "free"
        self._lock = threading.Lock()  # held by a pull writing staging and by a commit reading it
        self._phase_changed = threading.Condition(self._lock)
        self._closed = threading.Event()
        self._failures = 0  # failed pulls since the last commit
        self._watcher = Watcher(
            self.sub.wait_version,
            self._floor,
            self._pull,
            give_up_s=options.pull_timeout,
            slice_s=1.0,
            name=f"wbridge-sglang-{rank}",
        )
        self._watcher.start()

    # -- the puller thread -------------------------------------------------------------------
    def _floor(self) -> int:
        """For the watcher: the version it pulls only above (an uncommitted version may be
        overwritten by a newer one). First, ``swap``: staging copied back after a commit."""
        with self._lock:
            self._copy_back()
        return max(self.staged or 0, self.version or 0)

    def _pull(self, want: int) -> bool:
        with self._lock:
            # an uncommitted version may be overwritten by a newer one; staging the parameters
            # point at (swap) may not
            while self._phase not in ("free", "staged") and not self._closed.is_set():
                self._copy_back()
                self._phase_changed.wait(0.5)
            if self._closed.is_set():
                return True
            self.pulling, self.staged, self._phase = want, None, "free"  # staging is about to change
            t0 = time.time()
            try:
                v = self.sub.pull(min_version=want, timeout=self.options.pull_timeout)
            except WBridgeError as e:
                self.pulling = None
                if not self._closed.is_set():
                    self._failed(e)
                return True
            self._watcher.succeeded()
            last = self.sub.stats.last
            self.history.append(
                {
                    "version": v,
                    "pull_start": t0,
                    "pull_end": time.time(),
                    "pull_s": last.seconds if last else time.time() - t0,
                    "bytes": last.nbytes if last else 0,
                    "delta": bool(last and last.delta),
                    "delta_reason": last.delta_reason if last else "",
                    "transport": ",".join(sorted({name for name, _ in self.sub.stats.transports.values()})),
                    "retries": self._failures,
                    "pause_s": None,
                    "committed_at": None,
                    "time": None,
                }
            )
            del self.history[:-64]
            self.staged, self.pulling, self._phase = v, None, "staged"
        return True

    def _copy_back(self) -> None:
        """``swap``: after a commit pointed the parameters at staging, copies staging into their
        own memory (the scheduler points them back at a later step). Holds the lock."""
        import torch

        if self._phase == "swapped":
            with torch.no_grad():
                torch._foreach_copy_(self._live, self._staged)
            self._phase = "copied"

    def _failed(self, e: BaseException) -> None:
        """A pull failed: the watcher retries it after its backoff, or stops on it (then logged once)."""
        self._failures += 1
        self.error = describe(e, f"SGLang rank {self.rank}")
        self._watcher.failed(e)

    # -- the scheduler thread ----------------------------------------------------------------
    def between_steps(self, scheduler: Any) -> None:
        """Commits a staged version (no forward pass runs now); never waits for a pull."""
        if self._flush_pending and scheduler.is_fully_idle() and scheduler.flush_cache(empty_cache=False):
            self._flush_pending = False
        if self._phase in ("free", "swapped") or not self._lock.acquire(blocking=False):
            return
        try:
            if self._phase == "copied":  # swap: back to the parameters' own memory; staging is free
                self._point(self._live)
                self._phase = "free"
                self._phase_changed.notify_all()
            elif self._phase == "staged":
                self._commit(scheduler)
        finally:
            self._lock.release()

    def _commit(self, scheduler: Any) -> None:
        import torch

        v, t0 = self.staged, time.perf_counter()
        if self.options.commit == "swap":
            self._point(self._staged)
            self._phase = "swapped"
        else:
            with torch.no_grad():
                torch._foreach_copy_(self._live, self._staged)
            self._phase = "free"
        self.version, self.staged, self._failures = v, None, 0
        scheduler.record_weight_version_change(new_version=str(v))
        pause = time.perf_counter() - t0
        rec = next((h for h in reversed(self.history) if h["version"] == v), None)
        if rec is not None:
            rec["pause_s"], rec["committed_at"] = pause, time.time()
            rec["time"] = rec["committed_at"]
        self._flush_pending = self.options.flush_cache
        self._phase_changed.notify_all()

    def _point(self, tensors: list[Any]) -> None:
        for p, t in zip(self._params, tensors):
            p.data = t

    def stats(self) -> dict[str, Any]:
        """JSON-safe: the held version; of the last update its bytes, delta and why
        (``delta_reason``), transport, commit time (``time``), pull and pause; the follower's
        state (``error`` and ``error_type`` of the last failed pull, ``stopped``: it follows no
        more, ``retries``); the last verification (``verify``); and the history of pulls."""
        last = next((h for h in reversed(self.history) if h["version"] == self.version), None)
        stopped = self._watcher.error
        err = describe(stopped, f"SGLang rank {self.rank}") if stopped is not None else self.error
        return {
            "rank": self.rank,
            "version": self.version,
            "staged": self.staged,
            "pulling": self.pulling,
            "bytes": last["bytes"] if last else 0,
            "delta": last["delta"] if last else False,
            "delta_reason": last["delta_reason"] if last else "",
            "transport": last["transport"] if last else "",
            "time": last["time"] if last else None,
            "pull_s": last["pull_s"] if last else None,
            "pause_s": last["pause_s"] if last else None,
            "staging_bytes": self.nbytes,
            "subscribe_s": self.subscribe_s,
            "error": None if err is None else err["message"],
            "error_type": None if err is None else err["type"],
            "stopped": stopped is not None,
            "retries": self._watcher.retries,
            "verify": self.verified,
            "history": [dict(h) for h in self.history],
        }

    def verify(self, timeout: float) -> dict[str, Any]:
        """Checks what the engine runs on (on the scheduler thread, between steps): staging
        against the publishers' checksums of the version it holds (``Subscriber.verify``), then
        every live parameter against staging, byte for byte (cast to the parameter's dtype, as the
        commit casts). Waits at most ``timeout`` for a pull in flight (the scheduler waits too).
        Returns and keeps (``stats()["verify"]``) ``{"version", "staged", "tensors", "ok"}``."""
        import torch

        if not self._lock.acquire(timeout=timeout):
            raise WaitTimeout(f"wbridge SGLang rank {self.rank}: verify: a pull ran past {timeout:.1f}s")
        try:
            staged = None if self.sub.version is None else self.sub.verify(timeout=timeout)
            tensors: dict[str, str] = {}
            with torch.no_grad():
                for name, live, stage in zip(self.staging, self._params, self._staged):
                    same = torch.equal(
                        live.data.contiguous().view(-1).view(torch.uint8),
                        stage.to(live.dtype).contiguous().view(-1).view(torch.uint8),
                    )
                    tensors[name] = "ok" if same else "differs from staging"
        finally:
            self._lock.release()
        if staged is None or staged != self.version:
            held = "no known version" if self.version is None else f"version {self.version}"
            why = f"staging holds version {staged}, the parameters {held}"
            tensors = {k: f"{v} ({why})" for k, v in tensors.items()}
        ok = staged is not None and staged == self.version and all(v == "ok" for v in tensors.values())
        self.verified = {"version": self.version, "staged": staged, "tensors": tensors, "ok": ok, "at": time.time()}
        return self.verified

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self._watcher.close(timeout=0.0)
        try:
            self.sub.close()
        except WBridgeError as e:  # the publishers (and their store) may be gone already
            log.warning("wbridge SGLang rank %d: closing the subscriber: %s", self.rank, e)
        self._watcher.close(timeout=5.0)


# -- SGLang hooks ------------------------------------------------------------------------------
def _after_ingest(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    for rt in _RUNTIMES:
        rt.between_steps(scheduler)


def _after_state(result: Any, *args: Any, **kwargs: Any) -> None:
    state = getattr(result, "internal_state", None)
    if isinstance(state, dict) and _RUNTIMES:
        state["wbridge"] = [rt.stats() for rt in _RUNTIMES]


def _verify_all(timeout: Any) -> None:
    """Every runtime of this process verifies (``Runtime.verify``); a wbridge error is tagged for
    the caller's side (``remote.untag``)."""
    from ... import _validate

    try:
        timeout = _validate.timeout(timeout, "wbridge SGLang verify timeout", positive=True)
        if not _RUNTIMES:
            raise UsageError("this SGLang engine has no wbridge subscription (not started with engine_args?)")
        for rt in _RUNTIMES:
            rt.verify(timeout)
    except WBridgeError as e:
        raise tag(e, "SGLang scheduler") from e


def _scheduler_verify(scheduler: Any, timeout: float = 60.0) -> None:
    """``Scheduler.wbridge_verify``: what ``Engine.collective_rpc("wbridge_verify")`` calls."""
    _verify_all(timeout)


def _around_set_state(original: Any, scheduler: Any, recv_req: Any, *args: Any, **kwargs: Any) -> Any:
    """``/set_internal_state`` with ``{"server_args": {"wbridge_verify": timeout}}`` verifies
    (the HTTP server has no RPC route); other keys go to SGLang."""
    requested = getattr(recv_req, "server_args", None)
    if not isinstance(requested, dict) or VERIFY not in requested:
        return original(scheduler, recv_req, *args, **kwargs)
    from sglang.srt.managers.io_struct import SetInternalStateReqOutput

    try:
        _verify_all(requested[VERIFY])
    except WBridgeError as e:
        log.warning("wbridge SGLang: verify: %s", e)
        for rt in _RUNTIMES:
            rt.verified = {"error": describe(e, "SGLang scheduler"), "at": time.time()}
        return SetInternalStateReqOutput(updated=False)
    return SetInternalStateReqOutput(updated=all(rt.verified["ok"] for rt in _RUNTIMES))


def start(model: Any, model_config: Any, options: SGLangOptions, rank: int, tp_size: int) -> Runtime:
    """Starts the runtime of this scheduler process and hooks it into SGLang's scheduler
    (``HookRegistry``: after ``ingest_requests`` and ``get_internal_state``; once per process)."""
    global _hooks_installed
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.plugins.hook_registry import HookRegistry, HookSource, HookType

    rt = Runtime(model, model_config, options, rank, tp_size)
    with _hooks_lock:
        if not _hooks_installed:
            source = HookSource("wbridge", "wbridge")
            HookRegistry.register(STEP_HOOK, _after_ingest, HookType.AFTER, source=source)
            HookRegistry.register(STATE_HOOK, _after_state, HookType.AFTER, source=source)
            HookRegistry.register(SET_STATE_HOOK, _around_set_state, HookType.AROUND, source=source)
            HookRegistry.apply_hooks()
            # a method of wbridge's own for Engine.collective_rpc (which calls scheduler methods by name)
            setattr(Scheduler, VERIFY, _scheduler_verify)
            _hooks_installed = True
        _RUNTIMES.append(rt)
    return rt
