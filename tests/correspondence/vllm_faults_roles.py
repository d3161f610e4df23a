"""The process of the vLLM error-path test (run with the vLLM venv's python, the repo on PYTHONPATH).

    python vllm_faults_roles.py engine CKPT_DIR OUT_DIR

One bf16 vLLM engine (its worker in a process of its own, as users run it) serves every check;
the trainer is a ``wbridge.Publisher`` in this process (fp32 masters of the checkpoint's model,
hosting the store), which also loses its store and comes back on the same port (a new store
generation). Each check writes what was raised (type, message, seconds) or what was seen into
``OUT_DIR/faults.json``; the test asserts on it. A call that hangs is recorded as ``hung`` (it
runs on a thread of its own, bounded), so the file is written whatever the code does.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any

from vllm_roles import PROMPT, _llm

CHANNEL = "policy"
TOKEN = "faults-token"


def attempt(fn: Any, limit: float) -> dict[str, Any]:
    """Runs ``fn()`` on a thread for at most ``limit`` seconds: ``{"type", "message", "seconds"}``
    of what it raised (``type`` None: it returned ``value``; ``"hung"``: still running)."""
    box: dict[str, Any] = {}

    def run() -> None:
        t0 = time.monotonic()
        try:
            box["value"] = fn()
            box["type"] = None
        except BaseException as e:  # noqa: BLE001 - recorded for the test
            box.update(type=type(e).__name__, message=str(e), mro=[c.__name__ for c in type(e).__mro__])
        box["seconds"] = time.monotonic() - t0

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(limit)
    if t.is_alive():
        return {"type": "hung", "seconds": limit}
    if "value" in box and not _jsonable(box["value"]):
        box["value"] = repr(box["value"])
    return box


def _jsonable(x: Any) -> bool:
    try:
        json.dumps(x)
        return True
    except TypeError:
        return False


def _rpc_error(fn: Any) -> dict[str, Any]:
    """What an engine RPC raised, as the caller's side rebuilds it (``remote.untag``)."""
    try:
        from wbridge.integrations.remote import untag
    except ImportError:  # (the code before it, for the record of how it failed)

        def untag(e: BaseException) -> None:
            return None

    try:
        fn()
    except Exception as e:  # noqa: BLE001 - vLLM re-raises a worker's error as its own exception
        err = untag(e) or e
        return {"type": type(err).__name__, "message": str(err)}
    return {"type": None}


class Trainer:
    """fp32 masters of the checkpoint's model, published on ``CHANNEL`` (hosting the store)."""

    def __init__(self, ckpt: str, port: int) -> None:
        import torch
        from transformers import Qwen2ForCausalLM

        self.model = Qwen2ForCausalLM.from_pretrained(ckpt, torch_dtype=torch.float32)
        self.initial = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        self.gen = torch.Generator().manual_seed(5)
        self.url = f"tcp://127.0.0.1:{port}"
        self.pub = None

    def start(self, dtype: Any) -> None:
        """(Re)registers the model, cast to ``dtype`` (None: published as fp32)."""
        from wbridge import Async, Publisher
        from wbridge.integrations.dtensor import from_module

        if self.pub is None:
            self.pub = Publisher(
                CHANNEL,
                self.url,
                rank=0,
                world_size=1,
                host_store=True,
                token=TOKEN,
                transport="tcp",
                mode=Async(max_staleness=100),
            )
        self.pub.register(from_module(self.model), dtype=dtype)

    def publish(self, perturb: bool = True) -> int:
        import torch

        with torch.no_grad():
            if perturb:
                for p in self.model.parameters():
                    p.add_(torch.randn(p.shape, generator=self.gen) * 0.05)
            else:
                self.model.load_state_dict(self.initial)
        return self.pub.publish(timeout=60.0)

    def lose_store(self) -> None:
        """The store's host dies with everything in it; a new one comes up on the same port."""
        self.pub.close()
        self.pub = None


def engine(ckpt: str, out: str) -> None:
    import torch
    from vllm import SamplingParams

    from transports._util import free_port
    from wbridge.integrations.vllm import AsyncVLLMUpdater, VLLMUpdater

    res: dict[str, Any] = {}
    cache = os.path.join(out, "cache")
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, detokenize=False)
    prompts = [{"prompt_token_ids": PROMPT}]
    llm = _llm(ckpt, extension=True, dtype="bfloat16")
    port = free_port()
    url = f"tcp://127.0.0.1:{port}"
    trainer = Trainer(ckpt, port)

    def updater(**kw: Any) -> VLLMUpdater:
        opts = dict(token=TOKEN, timeout=60.0, transport="tcp", cache_dir=cache) | kw
        return VLLMUpdater(llm, CHANNEL, opts.pop("store", url), **opts)

    def save() -> None:
        with open(os.path.join(out, "faults.json"), "w") as f:
            json.dump(res, f, indent=1, default=repr)

    def verify_held_back() -> None:
        up = ctx["up"] = updater()
        res["start_version"] = up.version
        (res["digests_1"],) = llm.collective_rpc("wbridge_digests")
        res["verify_1"] = up.verify()
        res["plan"] = llm.collective_rpc("wbridge_commit_plan")[0]  # (which layers run repacked kernels here)
        # an engine held back one version: v2 staged by the watcher, not committed
        v = trainer.publish()
        deadline = time.monotonic() + 60
        while up.staged() != v and time.monotonic() < deadline:
            time.sleep(0.05)
        res["held_back"] = up.verify()
        res["updated_to"] = up.update()
        res["verify_2"] = up.verify()

    def bad_extension_calls() -> None:
        up = ctx["up"]
        for bad in (2.5, "3", 0):
            res[f"discard {bad!r}"] = _rpc_error(
                lambda b=bad: llm.collective_rpc("wbridge_discard", kwargs={"min_version": b})
            )
        res["pull_start timeout=nan"] = _rpc_error(
            lambda: llm.collective_rpc("wbridge_pull_start", kwargs={"timeout": float("nan")})
        )
        res["update(min_version=2.5)"] = attempt(lambda: up.update(min_version=2.5), 20)
        v = res["published_after_bad_calls"] = trainer.publish()
        res["after_bad_calls"] = attempt(lambda: up.update(wait=True, min_version=v), 60)

    def dtype_mismatch() -> None:
        up = ctx["up"]
        trainer.start(None)  # fp32 now: a new epoch the engine cannot plan
        v = trainer.publish()
        t0 = time.monotonic()
        res["dtype"] = attempt(lambda: up.update(wait=True, min_version=v), 80)  # (its timeout: 60 s)
        res["dtype"]["since_publish"] = time.monotonic() - t0
        res["dtype_generate"] = attempt(lambda: up.generate(prompts, sp), 20)
        res["dtype_staged"] = llm.collective_rpc("wbridge_staged")
        attempt(up.close, 60)

    def store_loss() -> None:
        trainer.start(torch.bfloat16)
        trainer.publish()
        up = updater()
        res["before_loss"] = up.version
        trainer.lose_store()
        trainer.start(torch.bfloat16)  # a new store on the same port: versions count from 1 again
        assert trainer.publish() == 1
        assert trainer.publish(perturb=False) == 2  # the checkpoint's weights again
        t0, reached = time.monotonic(), None
        while time.monotonic() - t0 < 90:
            try:
                up.update()
            except Exception as e:  # noqa: BLE001 - recorded; the loop goes on to its deadline
                res.setdefault("loss_errors", []).append(f"{type(e).__name__}: {e}")
            (held,) = llm.collective_rpc("wbridge_version")
            (digests,) = llm.collective_rpc("wbridge_digests")
            if held == 2 and digests == res["digests_1"]:
                reached = time.monotonic() - t0
                break
            time.sleep(0.2)
        res["loss"] = {"reached_s": reached, "held": held, "verify": up.verify() if reached else None}
        res["loss_generate"] = attempt(lambda: up.generate(prompts, sp)[0][0], 30)
        res["stats"] = up.stats()
        up.close()

    def bad_arguments() -> None:
        # refused at construction, before anything starts (last: on code that hangs on them,
        # the hung threads would disturb the checks after)
        nan = float("nan")
        res["bad_args"] = {
            "timeout=nan": attempt(lambda: updater(timeout=nan), 20),
            "timeout='5'": attempt(lambda: updater(timeout="5"), 20),
            "poll=-1": attempt(lambda: updater(poll=-1), 20),
            "poll=nan": attempt(lambda: updater(poll=nan), 20),
            "async timeout=nan": attempt(lambda: AsyncVLLMUpdater(llm, CHANNEL, url, timeout=nan), 20),
            "lease_ttl=nan": attempt(lambda: updater(lease_ttl=nan), 20),
            "bogus option": attempt(lambda: updater(bogus=1), 20),
        }

    ctx: dict[str, Any] = {}
    try:
        # an unreachable store fails by the updater's timeout
        dead = f"tcp://127.0.0.1:{free_port()}"
        res["unreachable"] = attempt(lambda: updater(store=dead, timeout=5.0), 45)
        save()
        # a trainer publishing bf16 (the engine's dtype) from fp32 masters
        trainer.start(torch.bfloat16)
        assert trainer.publish(perturb=False) == 1
        res["wrong_token"] = attempt(lambda: updater(token="not-the-token"), 60)
        save()
        for step in (verify_held_back, bad_extension_calls, dtype_mismatch, store_loss, bad_arguments):
            try:
                step()
            except Exception as e:  # noqa: BLE001 - recorded: the next check still runs
                res.setdefault("crashed", {})[step.__name__] = f"{type(e).__name__}: {e}"
            save()
    finally:
        save()
        if trainer.pub is not None:
            try:
                trainer.pub.close()
            except Exception as e:  # noqa: BLE001 - recorded: the results are written already
                res.setdefault("crashed", {})["close"] = f"{type(e).__name__}: {e}"
                save()


if __name__ == "__main__":
    role = sys.argv[1]
    if role == "engine":
        engine(sys.argv[2], sys.argv[3])
    else:
        raise SystemExit(f"unknown role {role}")
