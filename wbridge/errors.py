"""One error hierarchy under ``WBridgeError``.

``planner`` and ``transports`` cannot import ``wbridge``, so they raise their own classes;
``translated()`` re-raises those as the matching class here at the package boundary. Each class
here also subclasses its planner/transports counterpart, so either spelling catches it.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import planner.errors as _pe
import transports.errors as _te


class WBridgeError(Exception):
    """Base of every error wbridge raises."""


class LayoutError(WBridgeError, _pe.LayoutError):
    """A tensor cannot be described (non-contiguous, malformed declaration); names the tensor."""


class PlanError(WBridgeError, _pe.PlanError):
    """Publisher and subscriber layouts do not fit together; names the tensors and ranks."""


class TransportError(WBridgeError, _te.TransportError):
    """Moving bytes failed; names the peer."""


class AuthError(TransportError, _te.AuthError):
    """A peer or a store record failed authentication (wrong token, forged record)."""


class MissingExtraError(TransportError, _te.MissingExtraError):
    """A transport's optional dependency is missing; names the pip extra."""


class StaleVersionError(WBridgeError):
    """The version being read was overwritten or fenced off; nothing of it was committed."""


class StoreError(WBridgeError):
    """The metadata store is unreachable, timed out, or holds malformed data."""


class UsageError(WBridgeError):
    """An API call out of order or with bad arguments (``publish()`` before ``register()``...)."""


class IntegrityError(WBridgeError):
    """Bytes read do not match the publisher's checksums; nothing of that version was committed."""


class TimeoutError_(WBridgeError, TimeoutError):
    """A blocking call ran past its timeout (exported as ``wbridge.WaitTimeout``)."""


WaitTimeout = TimeoutError_

_MAP: list[tuple[type[BaseException], type[WBridgeError]]] = [
    (_te.MissingExtraError, MissingExtraError),
    (_te.AuthError, AuthError),
    (_te.TransportError, TransportError),
    (_pe.LayoutError, LayoutError),
    (_pe.PlanError, PlanError),
]


def translate(exc: BaseException) -> BaseException:
    if isinstance(exc, WBridgeError):
        return exc
    for src, dst in _MAP:
        if isinstance(exc, src):
            new = dst(str(exc))
            new.__cause__ = exc
            return new
    return exc


@contextlib.contextmanager
def translated() -> Iterator[None]:
    """Re-raises planner and transports errors as wbridge errors."""
    try:
        yield
    except (_pe.LayoutError, _pe.PlanError, _te.TransportError) as e:
        if isinstance(e, WBridgeError):
            raise
        raise translate(e) from e
