"""Errors raised by transports, under one root, ``TransportError``.

Transports import nothing of wbridge; ``wbridge.errors`` places ``TransportError`` under
``wbridge.WBridgeError`` when wbridge is imported (see there), so a wbridge user catches these as
``WBridgeError`` while the transports stay usable on their own.
"""


class TransportError(RuntimeError):
    """A read, registration or connection failed; the message names the peer."""


class AuthError(TransportError):
    """A peer failed authentication (wrong or missing token)."""


class MissingExtraError(TransportError, ImportError):
    """A transport's optional dependency is not installed; the message names the extra."""


class ProtocolError(TransportError):
    """The peer sent something that is not a well-formed message of the transport's protocol."""
