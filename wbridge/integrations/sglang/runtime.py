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

from ...errors import LayoutError, WaitTimeout, WBridgeError
from ..trace import TraceResult, trace_load_weights, traced
from .options import SGLangOptions

log = logging.getLogger("wbridge.sglang")

#: Where the hooks go (SGLang's ``HookRegistry`` dotted targets).
STEP_HOOK = "sglang.srt.managers.scheduler.Scheduler.ingest_requests"
STATE_HOOK = "sglang.srt.managers.scheduler.Scheduler.get_internal_state"

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
        self.error: str | None = None  # the last failed pull
        self.history: list[dict[str, Any]] = []
        self._flush_pending = False
        # "free": staging may be pulled into; "staged": it holds ``staged``; "swapped": the
        # parameters point at staging; "copied": the parameters' own memory holds the same again
        self._phase = "free"
        self._lock = threading.Lock()  # held by a pull writing staging and by a commit reading it
        self._phase_changed = threading.Condition(self._lock)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._follow, name=f"wbridge-sglang-{rank}", daemon=True)
        self._thread.start()

    # -- the puller thread -------------------------------------------------------------------
    def _follow(self) -> None:
        while not self._closed.is_set():
            with self._lock:
                self._copy_back()
            try:
                newest = self.sub.wait_version(after=max(self.staged or 0, self.version or 0), timeout=1.0)
            except WaitTimeout:
                continue
            except WBridgeError as e:
                if self._closed.is_set():
                    return
                self._failed(e)
                continue
            self._pull(newest)

    def _pull(self, want: int) -> None:
        with self._lock:
            # an uncommitted version may be overwritten by a newer one; staging the parameters
            # point at (swap) may not
            while self._phase not in ("free", "staged") and not self._closed.is_set():
                self._copy_back()
                self._phase_changed.wait(0.5)
            if self._closed.is_set():
                return
            self.pulling, self.staged, self._phase = want, None, "free"  # staging is about to change
            t0 = time.time()
            try:
                v = self.sub.pull(min_version=want, timeout=self.options.pull_timeout)
            except WBridgeError as e:
                self.pulling = None
                if not self._closed.is_set():
                    self._failed(e)
                return
            last = self.sub.stats.last
            self.history.append(
                {
                    "version": v,
                    "pull_start": t0,
                    "pull_end": time.time(),
                    "pull_s": last.seconds if last else time.time() - t0,
                    "bytes": last.nbytes if last else 0,
                    "delta": bool(last and last.delta),
                    "pause_s": None,
                    "committed_at": None,
                }
            )
            del self.history[:-64]
            self.staged, self.pulling, self._phase = v, None, "staged"

    def _copy_back(self) -> None:
        """``swap``: after a commit pointed the parameters at staging, copies staging into their
        own memory (the scheduler points them back at a later step). Holds the lock."""
        import torch

        if self._phase == "swapped":
            with torch.no_grad():
                torch._foreach_copy_(self._live, self._staged)
            self._phase = "copied"

    def _failed(self, e: BaseException) -> None:
        self.error = f"{type(e).__name__}: {e}"
        log.warning("wbridge SGLang rank %d: pull failed: %s", self.rank, self.error)
        self._closed.wait(0.5)

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
        self.version, self.staged = v, None
        scheduler.record_weight_version_change(new_version=str(v))
        pause = time.perf_counter() - t0
        rec = next((h for h in reversed(self.history) if h["version"] == v), None)
        if rec is not None:
            rec["pause_s"], rec["committed_at"] = pause, time.time()
        self._flush_pending = self.options.flush_cache
        self._phase_changed.notify_all()

    def _point(self, tensors: list[Any]) -> None:
        for p, t in zip(self._params, tensors):
            p.data = t

    def stats(self) -> dict[str, Any]:
        """JSON-safe: the held version, bytes, delta and pause of the last update, and history."""
        last = next((h for h in reversed(self.history) if h["version"] == self.version), None)
        return {
            "rank": self.rank,
            "version": self.version,
            "staged": self.staged,
            "pulling": self.pulling,
            "bytes": last["bytes"] if last else 0,
            "delta": last["delta"] if last else False,
            "pull_s": last["pull_s"] if last else None,
            "pause_s": last["pause_s"] if last else None,
            "staging_bytes": self.nbytes,
            "subscribe_s": self.subscribe_s,
            "error": self.error,
            "history": [dict(h) for h in self.history],
        }

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        try:
            self.sub.close()
        except WBridgeError as e:  # the publishers (and their store) may be gone already
            log.warning("wbridge SGLang rank %d: closing the subscriber: %s", self.rank, e)
        self._thread.join(5.0)


# -- SGLang hooks ------------------------------------------------------------------------------
def _after_ingest(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    for rt in _RUNTIMES:
        rt.between_steps(scheduler)


def _after_state(result: Any, *args: Any, **kwargs: Any) -> None:
    state = getattr(result, "internal_state", None)
    if isinstance(state, dict) and _RUNTIMES:
        state["wbridge"] = [rt.stats() for rt in _RUNTIMES]


def start(model: Any, model_config: Any, options: SGLangOptions, rank: int, tp_size: int) -> Runtime:
    """Starts the runtime of this scheduler process and hooks it into SGLang's scheduler
    (``HookRegistry``: after ``ingest_requests`` and ``get_internal_state``; once per process)."""
    global _hooks_installed
    from sglang.srt.plugins.hook_registry import HookRegistry, HookSource, HookType

    rt = Runtime(model, model_config, options, rank, tp_size)
    with _hooks_lock:
        if not _hooks_installed:
            source = HookSource("wbridge", "wbridge")
            HookRegistry.register(STEP_HOOK, _after_ingest, HookType.AFTER, source=source)
            HookRegistry.register(STATE_HOOK, _after_state, HookType.AFTER, source=source)
            HookRegistry.apply_hooks()
            _hooks_installed = True
        _RUNTIMES.append(rt)
    return rt
