"""One error tree under ``WBridgeError``: the only root a wbridge user needs to catch.

::

    WBridgeError
    ├── LayoutError, PlanError          (planner.errors, under planner.errors.PlannerError)
    ├── TransportError                  (transports.errors)
    │   ├── AuthError
    │   └── MissingExtraError
    ├── StoreError
    ├── StaleVersionError
    ├── IntegrityError
    ├── UsageError
    └── WaitTimeout                     (also a builtin ``TimeoutError``)

``planner`` and ``transports`` must not import ``wbridge`` (they are usable alone), so they define
their own roots; importing this module places those roots under ``WBridgeError`` (their
``__bases__`` gain it; nothing else about them changes). Each class exists once: ``LayoutError``
here *is* ``planner.errors.LayoutError``, so there is nothing to translate at the boundary.
"""

from __future__ import annotations

import planner.errors as _pe
import transports.errors as _te


class WBridgeError(Exception):
    """Base of every error wbridge raises."""

    __slots__ = ()  # keeps the layout of a plain Exception, so the planner's and transports'
    #                 roots can be placed under it


def _graft(root: type[BaseException]) -> None:
    if not issubclass(root, WBridgeError):
        root.__bases__ = (WBridgeError, *root.__bases__)


_graft(_pe.PlannerError)
_graft(_te.TransportError)

# Re-exported as imports (not assignments), so documentation tools see the classes themselves.
from planner.errors import LayoutError, PlanError, PlannerError  # noqa: E402
from transports.errors import AuthError, MissingExtraError, TransportError  # noqa: E402


class StaleVersionError(WBridgeError):
    """The version being read was overwritten or fenced off; nothing of it was committed."""


class StoreError(WBridgeError):
    """The metadata store is unreachable, timed out, or holds malformed data."""


class UsageError(WBridgeError):
    """An API call out of order or with bad arguments (``publish()`` before ``register()``...)."""


class IntegrityError(WBridgeError):
    """Bytes read do not match the publisher's checksums; nothing of that version was committed."""


class WaitTimeout(WBridgeError, TimeoutError):
    """A blocking call ran past its timeout."""


__all__ = [
    "AuthError",
    "IntegrityError",
    "LayoutError",
    "MissingExtraError",
    "PlanError",
    "PlannerError",
    "StaleVersionError",
    "StoreError",
    "TransportError",
    "UsageError",
    "WBridgeError",
    "WaitTimeout",
]
