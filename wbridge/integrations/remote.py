"""wbridge errors across an engine's RPC: the same ``WBridgeError`` subclass on the caller's side.

vLLM's ``collective_rpc`` and SGLang's hand the caller only the text of an error raised in a
worker (``str(e)``, inside their own wrapper text: vLLM adds "', please check the stack trace
above..."). A worker therefore raises its wbridge errors ``tag``-ged: the message is
``[wbridge:<class name>] <where>: <message> [/wbridge]``; the caller's side (``untag``) finds that
tag anywhere in the text it got and rebuilds the same class, with the worker's message and where
it was raised (``vLLM worker rank 0``), the RPC's exception as its cause.

An error that ends a background pull travels as data instead (``describe`` / ``rebuild``): the
workers report it in their state and the updater raises it. So do the ranks' verification results
(``merge_verified`` makes one of them).

Deterministic errors (``DETERMINISTIC``: a plan or layout that cannot work, a wrong token, a
misuse) come back the same on every try: followers stop on them and report them at once; the
others (the store or a transport failing, a version overwritten while read) are transient and
retried with backoff.
"""

from __future__ import annotations

import re
from typing import Any

from ..errors import AuthError, LayoutError, PlanError, UsageError, WBridgeError

#: Errors that a retry meets again: they stop a follower (the vLLM watcher, the SGLang puller).
DETERMINISTIC: tuple[type[WBridgeError], ...] = (PlanError, LayoutError, AuthError, UsageError)

_TAG = re.compile(r"\[wbridge:(\w+)\] (.*?) \[/wbridge\]", re.DOTALL)


def deterministic(e: BaseException) -> bool:
    """Whether trying again meets ``e`` again (see ``DETERMINISTIC``)."""
    return isinstance(e, DETERMINISTIC)


def _classes() -> dict[str, type[WBridgeError]]:
    out: dict[str, type[WBridgeError]] = {}
    todo: list[type[WBridgeError]] = [WBridgeError]
    while todo:
        cls = todo.pop()
        out.setdefault(cls.__name__, cls)
        todo.extend(cls.__subclasses__())
    return out


def _make(name: str, message: str) -> WBridgeError:
    """An error of the wbridge class called ``name`` (``WBridgeError`` for an unknown name)."""
    cls = _classes().get(name, WBridgeError)
    try:
        return cls(message)
    except TypeError:  # a subclass with a constructor of its own
        return WBridgeError(f"{name}: {message}")


def tag(e: WBridgeError, where: str) -> WBridgeError:
    """``e`` as a worker raises it to an RPC: the same class, its message tagged with the class
    name and ``where`` (e.g. ``"vLLM worker rank 0"``). A tagged error is returned as it is."""
    text = str(e)
    if _TAG.search(text):
        return e
    return _make(type(e).__name__, f"[wbridge:{type(e).__name__}] {where}: {text} [/wbridge]")


def untag(e: BaseException) -> WBridgeError | None:
    """The wbridge error an RPC's exception carries (rebuilt from its tag, without it), or None."""
    text = str(e)
    m = _TAG.search(text)
    if m is None:
        return None
    return _make(m.group(1), m.group(2))


def describe(e: BaseException, where: str) -> dict[str, Any]:
    """An error as RPC-safe data: ``{"type", "message", "deterministic"}`` (``message`` starts
    with ``where``)."""
    name = type(e).__name__ if isinstance(e, WBridgeError) else f"{type(e).__name__}"
    return {"type": name, "message": f"{where}: {e}", "deterministic": deterministic(e)}


def rebuild(d: dict[str, Any], context: str = "") -> WBridgeError:
    """The error ``describe`` made, raised on the caller's side: the same wbridge class (a
    non-wbridge error, e.g. a ``RuntimeError`` that ended a worker thread, as ``WBridgeError``
    naming its type), ``context`` before its message."""
    name, message = d["type"], d["message"]
    prefix = f"{context}: " if context else ""
    if name in _classes():
        return _make(name, prefix + message)
    return WBridgeError(f"{prefix}{name}: {message}")


def merge_verified(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """An engine's ranks' verification results as one ``{"version", "tensors", "ok"}``: a tensor
    is "ok" when it is on every rank, else the first rank's reason (naming the rank where there
    are several)."""
    versions = {r.get("version") for r in ranks}
    tensors: dict[str, str] = {}
    for rank, r in enumerate(ranks):
        for name, why in r.get("tensors", {}).items():
            if why != "ok" and tensors.get(name, "ok") == "ok":
                tensors[name] = why if len(ranks) == 1 else f"rank {rank}: {why}"
            tensors.setdefault(name, why)
    ok = bool(ranks) and len(versions) == 1 and all(r.get("ok") for r in ranks)
    return {"version": versions.pop() if len(versions) == 1 else None, "tensors": tensors, "ok": ok}


__all__ = ["DETERMINISTIC", "describe", "deterministic", "merge_verified", "rebuild", "tag", "untag"]
