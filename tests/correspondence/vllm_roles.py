"""Processes of the real-engine vLLM test (run with the vLLM venv's python). ``make`` and
``make_moe`` (tiny random checkpoints) run in the test's own process (conftest.py).

    python vllm_roles.py trainer CKPT_DIR OUT_DIR PORT      # perturb (optimizer step), save, publish
    python vllm_roles.py engine CKPT_DIR OUT_DIR PORT       # vLLM: generate, subscribe, pull, generate
    python vllm_roles.py reference CKPT_DIR OUT_DIR         # vLLM loaded from the perturbed checkpoint
    python vllm_roles.py host FD                            # reference / moe_reference on request (role_host)

Each writes its results to OUT_DIR as torch files; the test compares them.
"""

from __future__ import annotations

import os
import sys
import time

# run with the repo on PYTHONPATH (the tests' _spawn sets it): the vLLM venv has no wbridge installed

TOKEN = "vllm-test-token"
CHANNEL = "policy"
PROMPT = [11, 42, 7, 99, 3, 58, 21, 5]
MAX_TOKENS = 12


def tiny_config():
    from wbridge.testing.hf import qwen2_config

    return qwen2_config()


def tiny_moe_config():
    from wbridge.testing.hf import qwen3_moe_config

    return qwen3_moe_config()


def make_moe(ckpt: str, seed: int = 0) -> None:
    import torch
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(tiny_moe_config()).float()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    model.save_pretrained(ckpt, safe_serialization=True)


def moe_engine(ckpt: str, perturbed: str, out: str, port: int) -> None:
    """MoE: the publisher is a transformers Qwen3-MoE (experts fused [E, 2I, H], traced) holding
    the perturbed weights; the engine started from ``ckpt`` pulls them through vLLM's own
    weight-transfer API with ``backend="wbridge"`` (registered in every vLLM process by the
    ``vllm.general_plugins`` entry point the test puts on the path). The worker extension is
    there only to read the staging tensors back."""
    import torch
    from transformers import Qwen3MoeForCausalLM

    from wbridge import Publisher
    from wbridge.integrations.transformers import entries

    store = f"tcp://127.0.0.1:{port}"

    def init(token: str) -> None:
        llm.init_weight_transfer_engine(
            {
                "init_info": {
                    "channel": CHANNEL,
                    "store": store,
                    "token": token,
                    "transport": "tcp",
                    "cache_dir": os.path.join(out, "cache"),
                    "subscriber_options": {"name": "moe-rollout", "lease_ttl": 5.0},
                }
            }
        )

    llm = _llm(ckpt, extension=True, transfer="wbridge")
    before = _generate(llm)
    trainer = Qwen3MoeForCausalLM.from_pretrained(perturbed, torch_dtype=torch.float32)
    errors = {}
    with Publisher(CHANNEL, store, rank=0, world_size=1, host_store=True, token=TOKEN) as pub:
        pub.register(entries(trainer))
        v = pub.publish(timeout=60.0)
        # Broken paths first, through vLLM's API: each must fail with wbridge's own message.
        errors["start_before_init"] = _error(llm.start_weight_update)
        errors["wrong_token"] = _error(lambda: init("wrong-token"))  # fails at init, not at the first update
        after_failed = _generate(llm)  # a failed init leaves the kernels alone
        init(TOKEN)
        print("wbridge-test: init done", flush=True)  # the test reads the log up to here
        llm.start_weight_update()
        # background: update_weights returns at once and the engine keeps generating on the old
        # weights while the pull runs; finish_weight_update waits for it and reloads
        llm.update_weights({"update_info": {"version": v, "timeout": 60.0, "background": True}})
        during = _generate(llm)
        llm.finish_weight_update(weight_version=str(v))
        after = _generate(llm)
        staging = llm.collective_rpc("wbridge_staging")[0]
        held = llm.collective_rpc("wbridge_version")[0]
        stats = llm.collective_rpc("wbridge_stats")[0]
        names = [s["name"] for s in pub.subscribers()]  # init_info's subscriber_options reached it
        llm.shutdown_weight_transfer_engine()
    torch.save(
        {
            "before": before,
            "after": after,
            "after_failed": after_failed,
            "version": v,
            "weight_version": llm.get_weight_version(),
            "stats": stats,
            "held": held,
            "names": names,
            "during": during,
            "errors": errors,
            "staging": staging,
            "trainer": {k: v.detach().clone() for k, v in trainer.state_dict().items()},
        },
        os.path.join(out, "moe_engine.pt"),
    )


def pause_engine(ckpt: str, out: str, port: int) -> None:
    """Pause only to commit: the engine (from ``ckpt``) starts a background update through vLLM's
    weight-transfer API *before* the trainer has published, so the pull is certainly in flight
    while requests run; they complete, on the old weights. Then the in-process trainer takes an
    optimizer step, saves the result (for the reference engine) and publishes; the commit follows."""
    import torch
    from transformers import Qwen2ForCausalLM

    from wbridge import Publisher
    from wbridge.integrations.dtensor import from_module

    store = f"tcp://127.0.0.1:{port}"
    llm = _llm(ckpt, extension=True, transfer="wbridge")
    before = _generate(llm)
    model = Qwen2ForCausalLM.from_pretrained(ckpt, torch_dtype=torch.float32)
    with Publisher(CHANNEL, store, rank=0, world_size=1, host_store=True, token=TOKEN) as pub:
        pub.register(from_module(model))
        llm.init_weight_transfer_engine(
            {
                "init_info": {
                    "channel": CHANNEL,
                    "store": store,
                    "token": TOKEN,
                    "transport": "tcp",
                    "cache_dir": os.path.join(out, "cache"),
                }
            }
        )
        plan = llm.collective_rpc("wbridge_commit_plan")[0]
        llm.start_weight_update()
        llm.update_weights({"update_info": {"min_version": 1, "timeout": 120.0, "background": True}})
        during, in_flight = [], []
        for _ in range(3):  # requests complete while the pull waits for the version
            during.append(_generate(llm))
            in_flight.append(not llm.collective_rpc("wbridge_pull_done")[0])
        opt = torch.optim.SGD(model.parameters(), lr=5.0)
        ids = torch.tensor([PROMPT])
        model(input_ids=ids, labels=torch.flip(ids, [1])).loss.backward()
        opt.step()
        model.save_pretrained(os.path.join(out, "perturbed"), safe_serialization=True)
        v = pub.publish(timeout=60.0)
        llm.finish_weight_update(weight_version=str(v))
        after = _generate(llm)
        stats = llm.collective_rpc("wbridge_stats")[0]
        params = llm.collective_rpc("wbridge_parameters")[0]
        llm.shutdown_weight_transfer_engine()
    torch.save(
        {
            "before": before,
            "during": during,
            "in_flight": in_flight,
            "after": after,
            "version": v,
            "plan": plan,
            "stats": stats,
            "params": params,
        },
        os.path.join(out, "pause_engine.pt"),
    )


def _error(fn) -> str | None:
    """``"Type: message"`` of what ``fn()`` raised, or None."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 (vLLM re-raises a worker's error as a bare Exception)
        return f"{type(e).__name__}: {e}"
    return None


def make(ckpt: str) -> None:
    import torch
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(tiny_config()).float()
    with torch.no_grad():
        for p in model.parameters():  # larger weights: greedy tokens depend on them visibly
            p.normal_(0, 0.3)
    model.save_pretrained(ckpt, safe_serialization=True)


def trainer(ckpt: str, out: str, port: int) -> None:
    import torch
    from transformers import Qwen2ForCausalLM

    from wbridge import Publisher
    from wbridge.integrations.dtensor import from_module

    model = Qwen2ForCausalLM.from_pretrained(ckpt, torch_dtype=torch.float32)
    opt = torch.optim.SGD(model.parameters(), lr=5.0)
    ids = torch.tensor([PROMPT])
    loss = model(input_ids=ids, labels=torch.flip(ids, [1])).loss
    loss.backward()
    opt.step()  # the perturbation: one optimizer step
    model.save_pretrained(os.path.join(out, "perturbed"), safe_serialization=True)
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, os.path.join(out, "trainer.pt"))
    with Publisher(CHANNEL, f"tcp://127.0.0.1:{port}", rank=0, world_size=1, host_store=True, token=TOKEN) as pub:
        pub.register(from_module(model))
        v = pub.publish(timeout=60.0)
        with open(os.path.join(out, "published"), "w") as f:
            f.write(str(v))
        # Serve reads until the engine says it is done (bounded).
        deadline = time.monotonic() + 700
        while not os.path.exists(os.path.join(out, "engine_done")) and time.monotonic() < deadline:
            time.sleep(0.2)


def http_trainer(ckpt: str, out: str, port: int, url: str) -> None:
    """The trainer-driven flow: vLLM's own HTTP client (``HTTPVLLMWeightSyncClient``) drives the
    server's start -> update -> finish through wbridge's trainer engine, which publishes first."""
    import json
    import urllib.request

    import torch
    from transformers import Qwen2ForCausalLM
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from wbridge import Publisher
    from wbridge.integrations.dtensor import from_module
    from wbridge.integrations.vllm import WBridgeTrainerInitInfo, register

    def get(path: str, body: dict | None = None):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.loads(r.read() or b"null")

    register()  # this process is no vLLM process: no plugin hook ran here
    model = Qwen2ForCausalLM.from_pretrained(ckpt, torch_dtype=torch.float32)
    opt = torch.optim.SGD(model.parameters(), lr=5.0)
    ids = torch.tensor([PROMPT])
    with Publisher(CHANNEL, f"tcp://127.0.0.1:{port}", rank=0, world_size=1, host_store=True, token=TOKEN) as pub:
        pub.register(from_module(model))
        info = WBridgeTrainerInitInfo(
            publisher=pub, rank=0, transport="tcp", cache_dir=os.path.join(out, "cache"), timeout=120.0
        )
        engine = WeightTransferTrainerFactory.trainer_init(info, client=HTTPVLLMWeightSyncClient(url))
        rounds = []
        for _ in range(2):
            model.zero_grad()
            model(input_ids=ids, labels=torch.flip(ids, [1])).loss.backward()
            opt.step()  # the trainer's update: a real optimizer step on its live (registered) weights
            engine.send_weights()
            rounds.append(
                {
                    "version": engine.version,
                    "label": get("/weight_info")["weight_version"],
                    "held": get("/collective_rpc", {"method": "wbridge_version"})["results"][0],
                    "digests": get("/collective_rpc", {"method": "wbridge_digests"})["results"][0],
                    "trainer": {k: v.detach().clone() for k, v in model.state_dict().items()},
                }
            )
        engine.shutdown()
    torch.save({"rounds": rounds}, os.path.join(out, "http_trainer.pt"))


def engine_args(ckpt: str, dtype: str = "float32") -> dict:
    """The keywords every test engine (``LLM``, ``AsyncEngineArgs``) starts with: the tiny
    checkpoint at ``ckpt`` on this CPU, greedy and deterministic, no tokenizer."""
    return dict(
        model=ckpt,
        skip_tokenizer_init=True,
        dtype=dtype,
        enforce_eager=True,
        gpu_memory_utilization=0.3,
        max_model_len=128,
        max_num_seqs=4,
        seed=0,
    )


def _llm(ckpt: str, extension: bool, in_process: bool = False, transfer: str | None = None, dtype: str = "float32"):
    from vllm import LLM
    from vllm.config import WeightTransferConfig

    kw = dict(engine_args(ckpt, dtype), enable_prefix_caching=False)
    if in_process:
        # Engine core and worker in this process: half the start-up time of the default three
        # processes, same kernels. Only the reference engines use it; the engine that pulls runs
        # the way users run it (its worker extension is called across processes).
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        kw["distributed_executor_backend"] = "uni"
    if extension:
        kw["worker_extension_cls"] = "wbridge.integrations.vllm.WBridgeWorkerExtension"
    if transfer is not None:
        kw["weight_transfer_config"] = WeightTransferConfig(backend=transfer)
    return LLM(**kw)


def _generate(llm) -> list[int]:
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, detokenize=False)
    out = llm.generate([{"prompt_token_ids": PROMPT}], sp, use_tqdm=False)
    return list(out[0].outputs[0].token_ids)


def engine(ckpt: str, out: str, port: int) -> None:
    import torch

    llm = _llm(ckpt, extension=True)
    before = _generate(llm)
    params_before = llm.collective_rpc("wbridge_parameters")[0]
    deadline = time.monotonic() + 120
    while not os.path.exists(os.path.join(out, "published")):
        if time.monotonic() > deadline:
            raise TimeoutError("trainer never published")
        time.sleep(0.2)
    t0 = time.perf_counter()
    n = llm.collective_rpc(
        "wbridge_subscribe",
        args=(CHANNEL, f"tcp://127.0.0.1:{port}"),
        kwargs={"token": TOKEN, "transport": "tcp", "cache_dir": os.path.join(out, "cache")},
    )[0]
    t1 = time.perf_counter()
    v = llm.collective_rpc("wbridge_pull", kwargs={"timeout": 60.0})[0]
    t2 = time.perf_counter()
    after = _generate(llm)
    torch.save(
        {
            "before": before,
            "after": after,
            "version": v,
            "entries": n,
            "subscribe_s": t1 - t0,
            "pull_s": t2 - t1,
            "stats": llm.collective_rpc("wbridge_stats")[0],
            "staging": llm.collective_rpc("wbridge_staging")[0],
            "params_before": params_before,
            "params": llm.collective_rpc("wbridge_parameters")[0],
        },
        os.path.join(out, "engine.pt"),
    )
    llm.collective_rpc("wbridge_close")
    open(os.path.join(out, "engine_done"), "w").close()


def reference(ckpt: str, out: str) -> None:
    import torch

    deadline = time.monotonic() + 300
    while not os.path.exists(os.path.join(out, "published")):  # the trainer saved ckpt before
        if time.monotonic() > deadline:
            raise TimeoutError("trainer never published")
        time.sleep(0.2)
    llm = _llm(ckpt, extension=True, in_process=True)
    torch.save(
        {"tokens": _generate(llm), "params": llm.collective_rpc("wbridge_parameters")[0]},
        os.path.join(out, "reference.pt"),
    )


def moe_reference(ckpt: str, out: str) -> None:
    """A fresh engine's tokens; started without the worker extension, it also shows what an
    updater says to such an engine (at once, before any RPC)."""
    import torch

    from wbridge.integrations.vllm import VLLMUpdater

    llm = _llm(ckpt, extension=False, in_process=True)
    t0 = time.monotonic()
    no_extension = _error(lambda: VLLMUpdater(llm, CHANNEL, "tcp://127.0.0.1:9", timeout=5.0))
    no_extension_s = time.monotonic() - t0
    torch.save(
        {"tokens": _generate(llm), "no_extension": no_extension, "no_extension_s": no_extension_s},
        os.path.join(out, "moe_reference.pt"),
    )


if __name__ == "__main__":
    role = sys.argv[1]
    if role == "trainer":
        trainer(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    elif role == "engine":
        engine(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    elif role == "http_trainer":
        http_trainer(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])
    elif role == "reference":
        reference(sys.argv[2], sys.argv[3])
    elif role == "moe_engine":
        moe_engine(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))
    elif role == "pause_engine":
        pause_engine(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    elif role == "moe_reference":
        moe_reference(sys.argv[2], sys.argv[3])
    elif role == "host":  # the session's reference engines, one after the other (tests/correspondence/conftest.py)
        from role_host import serve
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        # the in-process engines' parallel groups outlive them: a MoE after a dense model found no EP group
        serve({"reference": reference, "moe_reference": moe_reference}, int(sys.argv[2]), cleanup_dist_env_and_memory)
    else:
        raise SystemExit(f"unknown role {role}")
