"""Errors raised by transports. wbridge re-raises them as its own ``WBridgeError`` subclasses."""


class TransportError(RuntimeError):
    """A read, registration or connection failed; the message names the peer."""


class AuthError(TransportError):
    """A peer failed authentication (wrong or missing token)."""


class MissingExtraError(TransportError, ImportError):
    """A transport's optional dependency is not installed; the message names the extra."""
