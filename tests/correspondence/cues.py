"""The files the processes of a real-engine test cue each other with, in its OUT folder: a trainer
makes version v when ``want_<v>`` appears and writes ``published_<v>`` once it is out, until
``stop`` appears. Imports only the standard library: the role scripts import it (as ``cues``, from
their own folder) in the engines' venvs too."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator


def cue(out: str, name: str) -> None:
    """Writes the empty file ``name`` in ``out``."""
    open(os.path.join(out, name), "w").close()


def wait_file(path: str, timeout: float, poll: float = 0.05) -> None:
    """Returns once ``path`` exists; ``TimeoutError`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {path} within {timeout}s")
        time.sleep(poll)


def wanted(out: str, poll: float = 0.05) -> Iterator[int]:
    """A trainer's loop: yields v = 1, 2, ... as ``want_<v>`` appears in ``out``, until ``stop``
    does; the caller makes and publishes version v, then writes ``published_<v>``."""
    v = 0
    while not os.path.exists(os.path.join(out, "stop")):
        if not os.path.exists(os.path.join(out, f"want_{v + 1}")):
            time.sleep(poll)
            continue
        v += 1
        yield v
