"""A long-lived process of another venv (vLLM's, SGLang's) that runs role functions on request, one
at a time: what several tests need from such a venv (a checkpoint made, a fresh reference engine's
tokens) costs its interpreter start and imports once per session instead of once per use.

Test side: ``RoleHost(python, script, env, log)`` starts ``python script host FD`` (FD: the pipe it
answers on); ``host.call(role, *args, timeout=)`` asks for ``role(*args)`` and waits for it; a
failure raises ``AssertionError`` with the role's traceback and the log's tail. Role side: the
script's ``host`` role calls ``serve(roles, fd)``, which reads one JSON request per line on stdin.
Imports only the standard library (the role side runs in the other venv).
"""

from __future__ import annotations

import gc
import json
import os
import select
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Mapping
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


class RoleHost:
    """Test side of a role host: ``script`` run by ``python`` with ``env``, its output in ``log``
    (a path), in a session of its own (``close`` kills the group: engines' children too)."""

    def __init__(self, python: str, script: str, env: Mapping[str, str], log: str) -> None:
        self.log = log
        read, write = os.pipe()
        with open(log, "w") as f:
            self.proc = subprocess.Popen(
                [python, script, "host", str(write)],
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
        self.calls = 0

    def __repr__(self) -> str:
        state = "closed" if self.proc.poll() is not None else f"pid {self.proc.pid}"
        return f"RoleHost({os.path.basename(self.proc.args[1])}, {state}, {self.calls} calls)"

    def call(self, role: str, *args: Any, timeout: float) -> None:
        """Runs ``role(*args)`` in the host; raises ``AssertionError`` if it failed, the host died
        or ``timeout`` seconds passed (the host is then killed: its state is unknown)."""
        self.calls += 1
        assert self.proc.poll() is None, f"role host exited with {self.proc.returncode}: {self._tail()}"
        self.proc.stdin.write(json.dumps([role, [str(a) for a in args]]) + "\n")
        self.proc.stdin.flush()
        deadline = time.monotonic() + timeout
        while True:
            ready, _, _ = select.select([self._answers], [], [], max(0.0, min(1.0, deadline - time.monotonic())))
            if ready:
                line = self._answers.readline()
                if line:
                    answer = json.loads(line)
                    assert answer["ok"], f"{role}{tuple(args)} failed in the role host:\n{answer['error']}"
                    return
            if not ready and time.monotonic() < deadline:
                continue
            self.close()
            raise AssertionError(f"{role}{tuple(args)}: no answer within {timeout}s (host closed): {self._tail()}")

    def _tail(self) -> str:
        return open(self.log, errors="replace").read()[-4000:]

    def close(self) -> None:
        """Ends the host (end of input, then its whole process group); idempotent."""
        if self.proc.poll() is None:
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
        self._answers.close()
