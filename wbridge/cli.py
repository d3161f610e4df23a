"""The ``wbridge`` command: ``demo``, ``bench``, ``store serve``, ``info``.

``wbridge bench transport`` is ``transports.bench`` (one host, or two: ``--serve``/``--connect``);
``wbridge bench update --serve/--connect`` is ``wbridge.testing.update_bench``; the other benchmarks
(and ``bench update`` without those) run the scripts of a checkout's ``benchmarks/``."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

BENCHMARKS = {
    "update": "update_e2e.py",
    "stall": "stall.py",
    "plan": "plan_scale.py",
    "throughput": "transport_throughput.py",
    "soak": "soak.py",
}


# ``bench update`` with one of these is the two-host benchmark (``wbridge.testing.update_bench``),
# which an installed package runs; without, the one-host benchmarks/update_e2e.py of a checkout
TWO_HOSTS = ("--serve", "--connect", "--help", "-h")


def _repo_benchmarks() -> str:
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


def cmd_demo(args: argparse.Namespace) -> int:
    from .testing.demo import DemoConfig, run
    from .testing.synthetic import ModelConfig

    model = ModelConfig.demo() if not args.tiny else ModelConfig.tiny()
    cfg = DemoConfig(
        versions=args.versions,
        model=model,
        transport=args.transport,
        mode=args.mode,
        fault=args.inject_fault,
        timeout=args.timeout,
    )
    return run(cfg, as_json=args.json)


def cmd_bench(args: argparse.Namespace, rest: list[str]) -> int:
    if args.what == "transport":
        from transports.bench import main as bench_main

        return int(bench_main(rest) or 0)
    if args.what == "update" and any(a.split("=")[0] in TWO_HOSTS for a in rest):
        from .testing.update_bench import main as update_main

        return int(update_main(rest) or 0)
    path = os.path.join(_repo_benchmarks(), BENCHMARKS[args.what])
    if not os.path.exists(path):
        print(
            f"wbridge bench {args.what} needs a source checkout (benchmarks/ is not part of the installed package);"
            f" in a clone run: python benchmarks/{BENCHMARKS[args.what]}",
            file=sys.stderr,
        )
        return 2
    # run as benchmarks/README.md does (``PYTHONPATH=. python benchmarks/X.py``): the checkout's root on
    # PYTHONPATH for its packages (soak imports benchmarks._faults and tests.*), the script's own
    # folder first on sys.path for its _common helpers
    root = os.path.dirname(_repo_benchmarks())
    pythonpath = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    return subprocess.call([sys.executable, path, *rest], env=dict(os.environ, PYTHONPATH=pythonpath))


def cmd_store(args: argparse.Namespace) -> int:
    from .store import open_store

    store = open_store(f"tcp://{args.host}:{args.port}", host_store=True)
    print(f"wbridge store serving {store.url} (Ctrl-C to stop)", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        store.close()
    return 0


def cmd_info(args: argparse.Namespace) -> int:

    from transports.select import capabilities

    caps = capabilities()
    print(f"host identity : {caps['host']}")
    print(f"transports    : {', '.join(caps['transports'])}")
    print(f"rdma devices  : {', '.join(caps['rdma']) or 'none'}")
    try:
        import torch

        print(f"cuda          : {torch.cuda.is_available()}")
    except ImportError:
        print("cuda          : torch not installed")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="wbridge", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)

    demo = sub.add_parser("demo", help="local publish/pull demo on the embedded defaults")
    demo.add_argument("--versions", type=int, default=3)
    demo.add_argument("--transport", default="auto")
    demo.add_argument("--mode", default="one_step_off", choices=["sync", "one_step_off"])
    demo.add_argument("--tiny", action="store_true", help="a 1.5 MiB model instead of ~512 MiB")
    demo.add_argument(
        "--inject-fault",
        choices=["flip-bit"],
        default=None,
        help="corrupt one read on rollout 0 to show the bit-exact check failing",
    )
    demo.add_argument("--timeout", type=float, default=120.0)
    demo.add_argument("--json", action="store_true")

    bench = sub.add_parser(
        "bench", help="benchmarks (extra arguments, --help included, go to the benchmark)", add_help=False
    )
    bench.add_argument("what", choices=["transport", *BENCHMARKS])

    store = sub.add_parser("store", help="host a standalone TCP metadata store")
    store.add_argument("action", choices=["serve"])
    store.add_argument("--host", default="127.0.0.1")
    store.add_argument("--port", type=int, default=29700)

    sub.add_parser("info", help="what this machine offers: transports, RDMA, CUDA")

    args, rest = parser.parse_known_args(argv)
    if rest and args.cmd != "bench":
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.cmd == "demo":
        return cmd_demo(args)
    if args.cmd == "bench":
        return cmd_bench(args, rest)
    if args.cmd == "store":
        return cmd_store(args)
    return cmd_info(args)


if __name__ == "__main__":
    sys.exit(main())
