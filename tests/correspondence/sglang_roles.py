"""Processes of the real-engine SGLang test (run with the SGLang venv's python; the test puts the
repo and tests/sglang_stubs on PYTHONPATH and sets SGLANG_USE_CPU_ENGINE=1).

    python sglang_roles.py trainer CKPT OUT PORT [delta]    # fp32 masters, AdamW; publishes bf16 on cue
    python sglang_roles.py engine CKPT OUT PORT NAME N      # subscribed engine: N updates, then waits
    python sglang_roles.py rejoin CKPT OUT PORT NAME        # a restarted engine: pulls the newest
    python sglang_roles.py server CKPT OUT PORT HTTP_PORT     # the HTTP server, subscribed
    python sglang_roles.py reference OUT V [V ...]          # one engine: OUT/v<V> (bf16) in turn
    python sglang_roles.py host FD                          # reference on request (role_host)

Files in OUT are the cues: ``want_<v>`` asks the trainer for version v, ``v<v>/`` is its bf16
checkpoint, ``<NAME>.pt`` an engine's results, ``<NAME>_done_<v>`` that it committed v.
"""

from __future__ import annotations

import os
import sys
import time

from cues import cue, wait_file, wanted

CHANNEL = "policy"
TOKEN = "sglang-test-token"
PROMPT = [11, 42, 7, 99, 3, 58, 21, 5]
LONG = [[3 + i, 17, 29, 5 + i] for i in range(4)]
LONG_TOKENS = 160  # each long request's (about 0.4 s a batch here)


def trainer(ckpt: str, out: str, port: int, delta: bool = False) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from wbridge import Async, Delta, Publisher, Staging
    from wbridge.integrations.transformers import entries
    from wbridge.testing.hf import save_bf16

    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_pretrained(ckpt, torch_dtype=torch.float32)
    # a delta publisher encodes a version only where few bf16 words change: small steps then
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5 if delta else 1e-2)
    store = f"tcp://127.0.0.1:{port}"
    staging = Staging(delta=Delta()) if delta else Staging()
    with Publisher(CHANNEL, store, host_store=True, token=TOKEN, mode=Async(4), staging=staging) as pub:
        pub.register(entries(model), dtype=torch.bfloat16)
        cue(out, "store_up")
        for v in wanted(out):
            ids = torch.randint(0, model.config.vocab_size, (4, 16))
            loss = model(input_ids=ids, labels=ids).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            save_bf16(model, os.path.join(out, f"v{v}"))
            v_pub = pub.publish(timeout=60.0)
            cue(out, f"published_{v_pub}")
            print(f"trainer: published {v_pub}", flush=True)


def _engine(ckpt: str, port: int, name: str, commit: str):
    import sglang as sgl

    from wbridge.integrations.sglang import SGLangOptions, engine_args
    from wbridge.testing.sglang import CPU_ENGINE_ARGS

    opts = SGLangOptions(
        channel=CHANNEL,
        store=f"tcp://127.0.0.1:{port}",
        token=TOKEN,
        dtype="bfloat16",
        transport="tcp",
        commit=commit,
        subscriber_options={"name": name, "lease_ttl": 3.0},
    )
    return sgl.Engine(model_path=ckpt, dtype="bfloat16", **CPU_ENGINE_ARGS, **engine_args(opts))


def _greedy(eng) -> list[int]:
    return eng.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 12, "temperature": 0})["output_ids"]


def checksums(eng) -> dict[str, str]:
    """SGLang's own per-parameter checksums of what the engine computes with."""
    from sglang.srt.managers.io_struct import CheckWeightsReqInput

    ok, msg, ranks, _ = eng.loop.run_until_complete(
        eng.tokenizer_manager.check_weights(CheckWeightsReqInput(action="checksum"), None)
    )
    if not ok:
        raise RuntimeError(f"check_weights: {msg}")
    return dict(ranks[0]["checksums"] if isinstance(ranks[0], dict) else ranks[0].checksums)


async def _update_under_load(eng, out: str, want: int) -> dict:
    """Long requests decode while the trainer is asked for version ``want``; returns, once the
    engine holds ``want``, the stats and every batch of requests started meanwhile.

    Batches start staggered (a new one whenever fewer than two decode) so that some are decoding
    when the pull starts and when it commits, however long either takes on this machine
    (``_around`` picks them)."""
    import asyncio

    sp = {"max_new_tokens": LONG_TOKENS, "temperature": 0, "ignore_eos": True}  # all run to the end

    async def batch() -> dict:
        t0 = time.time()
        outs = await eng.async_generate(input_ids=LONG, sampling_params=sp)
        return {"t0": t0, "outs": outs, "t1": time.time()}

    tasks = [asyncio.ensure_future(batch())]
    await asyncio.sleep(0.3)  # the requests are decoding
    open(os.path.join(out, f"want_{want}"), "w").close()
    deadline = time.monotonic() + 120
    while True:
        states = await eng.tokenizer_manager.get_internal_state()
        stats = [s for st in states for s in (st.get("wbridge") or [])]
        if stats and all((s["version"] or 0) >= want for s in stats):
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"version {want} not committed: {stats}")
        if sum(not t.done() for t in tasks) < 2:
            tasks.append(asyncio.ensure_future(batch()))
        await asyncio.sleep(0.05)
    return {"batches": await asyncio.gather(*tasks), "stats": stats}


def _around(batches: list[dict], t: float) -> dict:
    """The batch that ran furthest on both sides of the moment ``t`` (if none spans it, the test
    reports the one that came closest).

    The widest margin, not the first batch that spans ``t``: a batch's end is when its outputs
    reached this loop, some ms after its last token, so one that ended a few ms after the commit
    may have decoded every token before it."""
    return max(batches, key=lambda b: min(t - b["t0"], b["t1"] - t))


def engine(ckpt: str, out: str, port: int, name: str, updates: int) -> None:
    """Serves (``commit="swap"``); for each update asks the trainer for the next version while
    long requests run, then records greedy tokens, checksums and the requests' version spans."""
    import torch

    from wbridge.integrations.sglang import server_stats, verify

    wait_file(os.path.join(out, "store_up"), 120)
    eng = _engine(ckpt, port, name, "swap")
    res: dict = {"steps": [], "start_stats": server_stats(eng)}
    held = res["start_stats"][0]["version"] or 0
    if held == 0:  # a fresh channel: nothing pulled at start
        res["before"], res["before_checksums"] = _greedy(eng), checksums(eng)
    for _ in range(updates):
        want = held + 1
        # the offline engine's event loop serves one caller: requests and stats polls share it
        run = eng.loop.run_until_complete(_update_under_load(eng, out, want))
        stats = run["stats"]
        rec = next(h for h in stats[0]["history"] if h["version"] == want)
        box = _around(run["batches"], rec["committed_at"])
        start = _around(run["batches"], rec["pull_start"])
        spans = [o["meta_info"].get("weight_versions") for o in box["outs"]]
        res["steps"].append(
            {
                "version": want,
                "req_t0": box["t0"],
                "req_t1": box["t1"],
                "start_t0": start["t0"],
                "start_t1": start["t1"],
                "spans": spans,
                "long_tokens": LONG_TOKENS,
                "finish": [o["meta_info"]["finish_reason"]["type"] for o in box["outs"]],
                "pull": rec,
                "tokens": _greedy(eng),
                "token_version": None,
                "checksums": checksums(eng),
            }
        )
        res["steps"][-1]["token_version"] = eng.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 1})[
            "meta_info"
        ]["weight_version"]
        t0 = time.monotonic()
        res["steps"][-1]["verify"] = verify(eng)  # what the engine runs on, against the checksums
        res["steps"][-1]["verify_s"] = time.monotonic() - t0
        held = want
        torch.save(res, os.path.join(out, f"{name}.pt"))
        open(os.path.join(out, f"{name}_done_{want}"), "w").close()
    res["stats"] = server_stats(eng)
    torch.save(res, os.path.join(out, f"{name}.pt"))
    open(os.path.join(out, f"{name}_finished"), "w").close()
    wait_file(os.path.join(out, "stop"), 600)  # stays up until the test is done (or kills it)
    eng.shutdown()


def rejoin(ckpt: str, out: str, port: int, name: str) -> None:
    """A restarted engine (``commit="copy"``): started from the old checkpoint, it pulls the
    newest version."""
    import torch

    from wbridge.integrations.sglang import server_stats, wait_version

    eng = _engine(ckpt, port, name, "copy")
    newest = int(open(os.path.join(out, "newest")).read())
    stats = wait_version(eng, newest, timeout=120)
    res = {"version": stats[0]["version"], "tokens": _greedy(eng), "checksums": checksums(eng)}
    res["stats"] = server_stats(eng)
    torch.save(res, os.path.join(out, f"{name}-rejoin.pt"))
    eng.shutdown()


def reference(out: str, *versions: str) -> None:
    """One fresh engine loaded from the trainer's bf16 checkpoint of the first version, then
    SGLang's own loader (``update_weights_from_disk``, which flushes the cache) for each later
    one: the tokens and checksums of each checkpoint as SGLang loads it, with one engine start."""
    import sglang as sgl
    import torch

    from wbridge.testing.sglang import CPU_ENGINE_ARGS

    res = {}
    first, *later = versions
    eng = sgl.Engine(model_path=os.path.join(out, f"v{first}"), dtype="bfloat16", **CPU_ENGINE_ARGS)
    try:
        res[int(first)] = {"tokens": _greedy(eng), "checksums": checksums(eng)}
        for v in later:
            ok, msg, *_ = eng.update_weights_from_disk(os.path.join(out, f"v{v}"))
            if not ok:
                raise RuntimeError(f"update_weights_from_disk(v{v}): {msg}")
            res[int(v)] = {"tokens": _greedy(eng), "checksums": checksums(eng)}
    finally:
        eng.shutdown()
    torch.save(res, os.path.join(out, "reference.pt"))


def server(ckpt: str, out: str, port: int, http_port: int) -> None:
    """The HTTP server, subscribed the same way (``ServerArgs`` takes the same keywords)."""
    from sglang.srt.entrypoints.http_server import launch_server
    from sglang.srt.server_args import ServerArgs

    from wbridge.integrations.sglang import SGLangOptions, engine_args
    from wbridge.testing.sglang import CPU_ENGINE_ARGS

    wait_file(os.path.join(out, "store_up"), 120)
    opts = SGLangOptions(channel=CHANNEL, store=f"tcp://127.0.0.1:{port}", token=TOKEN, dtype="bfloat16")
    args = ServerArgs(model_path=ckpt, host="127.0.0.1", port=http_port, dtype="bfloat16", **CPU_ENGINE_ARGS,
                      **engine_args(opts))  # fmt: skip
    launch_server(args)


if __name__ == "__main__":
    role, *a = sys.argv[1:]
    if role == "trainer":
        trainer(a[0], a[1], int(a[2]), a[3:] == ["delta"])
    elif role == "engine":
        engine(a[0], a[1], int(a[2]), a[3], int(a[4]))
    elif role == "rejoin":
        rejoin(a[0], a[1], int(a[2]), a[3])
    elif role == "server":
        server(a[0], a[1], int(a[2]), int(a[3]))
    elif role == "reference":
        reference(a[0], *a[1:])
    elif role == "host":  # the session's reference engines, one after the other (tests/correspondence/conftest.py)
        from role_host import serve

        serve({"reference": reference}, int(a[0]))
    else:
        raise SystemExit(f"unknown role {role!r}")
