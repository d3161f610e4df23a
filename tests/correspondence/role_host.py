"""A long-lived process of another venv (vLLM's, SGLang's) that runs role functions on request, one
at a time: what several tests need from such a venv (a checkpoint made, a fresh reference engine's
tokens) costs its interpreter start and imports once per session instead of once per use.

Test side: ``RoleHost(python, script, env, log)`` starts ``python script host FD`` (FD: the pipe it
answers on); ``host.call(role, *args, timeout=)`` asks for ``role(*args)`` and waits for it; a
failure raises ``AssertionError`` with the role's traceback and the log's tail. Role side: the
script's ``host`` role calls ``serve(roles, fd)``, which reads one JSON request per line on stdin.
Imports only the standard library (the role side runs in the other venv).

``RoleForks(python, env, preload, log)`` is the other use of such a process: it imports ``preload``
(torch, wbridge, the engine) once and never runs a role itself; ``forks.start(script, *args,
log=, env=)`` forks a child of it that runs ``script`` as ``python script *args`` would, in a
session of its own, and returns a ``Forked`` handle that answers as ``subprocess.Popen`` does
(``pid``, ``poll``, ``wait``, ``returncode``). A role process so started skips its interpreter
start and those imports (6-8 CPU-seconds for vLLM's, 4-5 for SGLang's, most of a test's own
work). With ``spawns=True`` the server also forks the processes its roles' engines start with
``multiprocessing``'s ``spawn`` (``spawns.py``); without it the engines start theirs afresh.
"""

from __future__ import annotations

import atexit
import gc
import importlib
import json
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from typing import Any


def serve(roles: Mapping[str, Callable[..., Any]], fd: int, after: Callable[[], None] | None = None) -> None:
    """Role side: runs ``roles[name](*args)`` for each ``[name, args]`` line on stdin, in order, and
    answers each on ``fd`` with ``{"ok": true}`` or ``{"ok": false, "error": traceback}``; ``after()``
    then resets what a role leaves behind in the process (an engine's global state) before the
    next one. Returns at end of input."""
    with os.fdopen(fd, "w", buffering=1) as answers:
        for line in sys.stdin:
            name, args = json.loads(line)
            try:
                roles[name](*args)
                answer: dict[str, Any] = {"ok": True}
            except BaseException:  # noqa: BLE001 - reported to the test, which fails with it
                answer = {"ok": False, "error": traceback.format_exc()}
            gc.collect()  # the role's engine, before the next one starts
            if after is not None:
                after()
            sys.stdout.flush()
            answers.write(json.dumps(answer) + "\n")


class _Server:
    """Test side of a process of another venv serving requests: ``python script MODE FD *more``
    with ``env``, requests on its stdin, answers on the pipe ``FD``, its output in ``log`` (a path),
    in a session of its own (``close`` kills the group: engines' children too). ``what`` names it
    in messages."""

    what = "server"
    # ``close`` lets the process end on its own first (its exit handlers run) where this is True
    graceful = True

    def __init__(self, python: str, script: str, mode: str, env: Mapping[str, str], log: str, *more: str) -> None:
        self.log = log
        read, write = os.pipe()
        with open(log, "w") as f:
            self.proc = subprocess.Popen(
                [python, script, mode, str(write), *more],
                stdin=subprocess.PIPE,
                stdout=f,
                stderr=subprocess.STDOUT,
                env=dict(env),
                pass_fds=(write,),
                start_new_session=True,
                text=True,
            )
        os.close(write)
        self._answers = os.fdopen(read, "r")

    def _state(self) -> str:
        return "closed" if self.proc.poll() is not None else f"pid {self.proc.pid}"

    def _ask(self, request: Any, timeout: float) -> Any:
        """Sends ``request`` (one JSON line) and returns the answer (one JSON line), None where none
        came within ``timeout`` seconds."""
        assert self.proc.poll() is None, f"{self.what} exited with {self.proc.returncode}: {self._tail()}"
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return self._answer(timeout)

    def _answer(self, timeout: float) -> Any:
        ready, _, _ = select.select([self._answers], [], [], timeout)
        line = self._answers.readline() if ready else ""
        return json.loads(line) if line else None

    def _tail(self) -> str:
        return open(self.log, errors="replace").read()[-4000:]

    def close(self) -> None:
        """Ends the process (end of input, then its whole process group; without the first where
        it is not ``graceful``); idempotent."""
        if self.graceful and self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait(timeout=30)
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        self._answers.close()


class RoleHost(_Server):
    """Test side of a role host: ``script`` run by ``python`` with ``env``, its output in ``log``
    (a path), in a session of its own (``close`` kills the group: engines' children too)."""

    what = "role host"

    def __init__(self, python: str, script: str, env: Mapping[str, str], log: str) -> None:
        super().__init__(python, script, "host", env, log)
        self.calls = 0

    def __repr__(self) -> str:
        return f"RoleHost({os.path.basename(self.proc.args[1])}, {self._state()}, {self.calls} calls)"

    def call(self, role: str, *args: Any, timeout: float) -> None:
        """Runs ``role(*args)`` in the host; raises ``AssertionError`` if it failed, the host died
        or ``timeout`` seconds passed (the host is then killed: its state is unknown)."""
        self.calls += 1
        answer = self._ask([role, [str(a) for a in args]], timeout)
        if answer is not None:
            assert answer["ok"], f"{role}{tuple(args)} failed in the role host:\n{answer['error']}"
            return
        self.close()
        raise AssertionError(f"{role}{tuple(args)}: no answer within {timeout}s (host closed): {self._tail()}")


def serve_forks(preload: list[str], fd: int, spawns: str | None = None) -> None:
    """Fork-server side: imports ``preload``, then for each request line on stdin answers on ``fd``:
    ``{"start": ...}`` forks a child that runs a script (``_run_forked``) and answers its pid;
    ``{"reap": pid}`` collects that child once the test is done with it (until then it stays a
    zombie, so that its pid, the id of its process group, is not reused for another process).
    With ``spawns`` (a socket path), it also forks the engines' own processes that its children
    start (``spawns.serve``), and its children start them so (``spawns.use``). One thread: it forks
    from a process in which no other thread holds a lock. Returns at end of input."""
    import spawns as _spawns  # (beside this script, which the server runs)

    for name in preload:
        importlib.import_module(name)
    listener = None
    if spawns is not None:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(spawns)
        listener.listen(64)
    spawned: set[int] = set()
    with os.fdopen(fd, "w", buffering=1) as answers:
        answers.write(json.dumps({"ready": True}) + "\n")
        for req in _requests([] if listener is None else [listener]):
            if isinstance(req, socket.socket):  # a launcher of an engine's process
                pid = _spawns.serve(req, close=[fd, listener.fileno()])
                if pid is not None:
                    spawned.add(pid)
            elif "reap" in req:
                try:
                    os.waitpid(int(req["reap"]), 0)
                except ChildProcessError:
                    pass
                answers.write(json.dumps({"reaped": req["reap"]}) + "\n")
            else:
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    os.close(fd)
                    if listener is not None:
                        listener.close()
                    _run_forked(dict(req["start"], spawns=spawns))  # (never returns)
                answers.write(json.dumps({"pid": pid}) + "\n")
            for pid in list(spawned):  # (their launchers report their status; they are reaped here)
                try:
                    if os.waitpid(pid, os.WNOHANG)[0]:
                        spawned.discard(pid)
                except ChildProcessError:
                    spawned.discard(pid)


def _requests(listeners: list[socket.socket]) -> Iterator[dict | socket.socket]:
    """The JSON requests on stdin, one per line, and the connections accepted on ``listeners``, as
    they come; ends at end of input."""
    buf = b""
    while True:
        ready, _, _ = select.select([0, *listeners], [], [], 1.0)
        for s in listeners:
            if s in ready:
                yield s.accept()[0]
        if 0 in ready:
            data = os.read(0, 1 << 16)
            if not data:
                return
            buf += data
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                yield json.loads(line)


def _run_forked(req: dict) -> None:
    """In a forked child: what ``python SCRIPT *ARGS`` with ``env`` and output in ``log`` would do
    (the script's directory first on ``sys.path``, then ``PYTHONPATH``), in a session of its own;
    its exit status goes to ``rc`` too, then the process ends."""
    code = 1
    try:
        os.setsid()
        out = os.open(req["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(out)
        os.close(null)
        os.environ.clear()
        os.environ.update(req["env"])
        script = req["argv"][0]
        path = [os.path.dirname(os.path.abspath(script)), *req["env"].get("PYTHONPATH", "").split(os.pathsep)]
        sys.path[:0] = [p for p in path if p]
        importlib.invalidate_caches()
        tempfile.tempdir = None  # (TMPDIR may differ)
        sys.argv = list(req["argv"])
        if req.get("spawns"):
            import spawns

            spawns.use(req["spawns"])
        try:
            runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as e:
            if e.code is None or isinstance(e.code, int):
                code = e.code or 0
            else:
                print(e.code, file=sys.stderr)
        except BaseException:  # noqa: BLE001 - what python would print
            traceback.print_exc()
        atexit._run_exitfuncs()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
            with open(req["rc"] + ".tmp", "w") as f:
                f.write(str(code))
            os.replace(req["rc"] + ".tmp", req["rc"])
        finally:
            os._exit(code)


class Forked:
    """A process ``RoleForks.start`` forked, answering as ``subprocess.Popen`` does."""

    def __init__(self, forks: RoleForks, pid: int, rc: str, args: list[str]) -> None:
        self.forks, self.pid, self.rc, self.args = forks, pid, rc, args
        self.returncode: int | None = None

    def __repr__(self) -> str:
        return (
            f"Forked({os.path.basename(self.args[0])} {self.args[1:2]}, pid {self.pid}, returncode {self.returncode})"
        )

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                with open(f"/proc/{self.pid}/stat") as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]
            except OSError:
                state = "X"
            if state in ("Z", "X"):  # ended (a zombie until reaped): its status, or killed
                self.returncode = int(open(self.rc).read()) if os.path.exists(self.rc) else -signal.SIGKILL
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.05)
        return self.returncode

    def kill_group(self) -> None:
        """Kills its session (what it left behind too), then has the fork server reap it."""
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.wait(30)
        self.forks.reap(self.pid)


class RoleForks(_Server):
    """Test side of a fork server: ``python role_host.py forks FD SPAWNS *preload`` with ``env``,
    its own output in ``log`` (a path), in a session of its own (its children: in sessions of
    their own, which their tests kill; the engines' processes it forks (``spawns``: a socket path
    made here, or ``-``): in its session, ended with it or when their launchers die)."""

    what = "fork server"
    # It holds nothing to clean up (what it forked runs in sessions of its own, which their tests
    # end), and an interpreter with torch and an engine imported took 2 s to exit: at the end of a
    # suite worker, whose exit the run's summary waits for, it is killed at once.
    graceful = False

    def __init__(self, python: str, env: Mapping[str, str], preload: list[str], log: str, spawns: bool = False) -> None:
        path = os.path.join(tempfile.mkdtemp(prefix="wbridge-spawns-"), "spawns.sock") if spawns else "-"
        super().__init__(python, os.path.abspath(__file__), "forks", env, log, path, *preload)
        self._ready = False
        self.started = 0

    def __repr__(self) -> str:
        return f"RoleForks({self._state()}, {self.started} started)"

    def _asked(self, request: dict, timeout: float) -> dict:
        answer = self._ask(request, timeout)
        assert answer is not None, f"fork server: no answer within {timeout}s: {self._tail()}"
        return answer

    def start(self, script: str, *args: object, log: Any, env: Mapping[str, str]) -> Forked:
        """``script *args`` forked from the server, with ``env`` (the whole environment), its output
        appended to ``log`` (an open file, or a path)."""
        if not self._ready:
            ready = self._answer(300)
            assert ready is not None and ready.get("ready"), self._tail()
            self._ready = True
        path = log if isinstance(log, str) else log.name
        rc = f"{path}.{self.started}.rc"
        argv = [script, *map(str, args)]
        pid = self._asked({"start": {"argv": argv, "env": dict(env), "log": path, "rc": rc}}, 60)["pid"]
        self.started += 1
        return Forked(self, pid, rc, argv)

    def reap(self, pid: int) -> None:
        if self.proc.poll() is None:
            self._asked({"reap": pid}, 60)


if __name__ == "__main__" and sys.argv[1:2] == ["forks"]:
    serve_forks(sys.argv[4:], int(sys.argv[2]), None if sys.argv[3] == "-" else sys.argv[3])
