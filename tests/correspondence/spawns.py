"""The engines' own processes forked from a fork server (``role_host.RoleForks``) instead of started
afresh: on CPU, SGLang starts its scheduler and detokenizer and vLLM its engine core and worker
with ``multiprocessing``'s ``spawn``, and each such process imported torch and the engine again
(5-8 CPU-seconds each, most of an engine start).

A role process forked from a fork server that serves spawns calls ``use(socket_path)``: its
``multiprocessing`` then starts each spawned process through ``spawn_launch.sh``, which runs this
module as a launcher (``python -S -E spawns.py ARGS``, ``ARGS`` what ``spawn`` passes its
interpreter). The launcher sends those arguments, its environment, working directory and every open
descriptor (the pipes ``spawn`` handed it) to the fork server (``serve``), which forks a child that
takes them over and runs what the interpreter would have run (``spawn_main``); the launcher stays
as the process the engine started, forwards the signals it gets, and exits with the child's status.
The child ends itself when its launcher dies (an engine killing its process tree kills launchers).
Only the standard library here: both sides run in the engine's venv.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import socket
import sys
import threading
import traceback

SOCKET_ENV = "ROLE_SPAWN_SOCKET"
PYTHON_ENV = "ROLE_SPAWN_PYTHON"
LAUNCHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "spawn_launch.sh")
MAX_FDS = 64


def use(path: str) -> None:
    """In a role process, and in each process forked for it: every ``multiprocessing`` spawn from
    now on is forked by the fork server listening at ``path``."""
    import multiprocessing

    os.environ[SOCKET_ENV] = path
    os.environ[PYTHON_ENV] = sys.executable
    multiprocessing.set_executable(LAUNCHER)


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, MAX_FDS)
    while not msg.endswith(b"\n"):
        more = conn.recv(1 << 20)
        if not more:
            raise EOFError("launcher went away")
        msg += more
    return json.loads(msg), fds


def serve(conn: socket.socket, close: list[int]) -> int | None:
    """Fork-server side, for one accepted launcher: forks the child that runs its spawn (without
    the server's descriptors ``close``) and answers its pid (the child's status follows from the
    child itself); None where the launcher sent nothing usable. Called from the server's only
    thread."""
    try:
        req, fds = _receive(conn)
    except (OSError, EOFError, ValueError):
        conn.close()
        return None
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        for fd in close:
            os.close(fd)
        _run(conn, req, fds)  # (never returns)
    for fd in fds:
        os.close(fd)
    try:
        conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
    finally:
        conn.close()
    return pid


def _run(conn: socket.socket, req: dict, fds: list[int]) -> None:
    """In the forked child: the launcher's descriptors at their numbers, its environment and
    directory, then ``python -c CODE`` as ``spawn`` asked; its status goes back to the launcher."""
    code = 1
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        own = conn.detach()  # (its number may be one the launcher's descriptors must take)
        back = fcntl.fcntl(own, fcntl.F_DUPFD_CLOEXEC, 2000)
        os.close(own)
        moved = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 1000) for fd in fds]
        for fd in fds:
            os.close(fd)
        for want, fd in zip(req["fds"], moved):
            os.dup2(fd, want, inheritable=True)
            os.close(fd)
        conn = socket.socket(fileno=back)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        use(os.environ[SOCKET_ENV])  # (what it spawns in turn, vLLM's worker from its engine core, too)
        threading.Thread(target=_watch, args=(conn,), daemon=True, name="launcher-watch").start()
        sys.argv = list(req["argv"])
        try:
            exec(compile(req["code"], "<string>", "exec"), {"__name__": "__main__"})
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else int(e.code is not None)
        except BaseException:  # noqa: BLE001 - what python would print
            traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
            conn.sendall(json.dumps({"code": code}).encode() + b"\n")
        finally:
            os._exit(code)


def _watch(conn: socket.socket) -> None:
    """Ends this process when its launcher is gone (killed with the engine's process tree)."""
    try:
        conn.recv(1)
    finally:
        os.kill(os.getpid(), signal.SIGKILL)


def launch(argv: list[str]) -> int:
    """Launcher side: ``argv`` as ``spawn`` passes it to an interpreter (``... -c CODE ARGS``)."""
    i = argv.index("-c")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(os.environ[SOCKET_ENV])
    fds = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd != sock.fileno():
            try:
                os.fstat(fd)
            except OSError:
                continue  # (the listing's own)
            fds.append(fd)
    req = {"code": argv[i + 1], "argv": ["-c", *argv[i + 2 :]], "env": dict(os.environ), "cwd": os.getcwd(), "fds": fds}
    socket.send_fds(sock, [json.dumps(req).encode() + b"\n"], fds)
    for fd in fds:
        if fd > 2:
            os.close(fd)  # (the spawned child holds them now: its pipes' ends close when it ends)
    answers = sock.makefile("rb")
    pid = json.loads(answers.readline())["pid"]
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, lambda n, _frame: os.kill(pid, n))
    line = answers.readline()
    return json.loads(line)["code"] if line else 1


if __name__ == "__main__":
    os._exit(launch(sys.argv[1:]))
