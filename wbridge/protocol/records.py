"""Signed records. The store is untrusted: everything wbridge writes there is a JSON payload bound
to its key and signed with HMAC-SHA256 under the channel token; readers reject anything else."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
from typing import Any

from ..errors import AuthError, StoreError

_VERSION = 1


def _mac(token: bytes | None, key: str, body: bytes) -> str:
    return hmac.new(token or b"", key.encode() + b"\x00" + body, hashlib.sha256).hexdigest()


def seal(token: bytes | None, key: str, payload: Any) -> bytes:
    """The bytes to store at ``key``: payload and a MAC over key and payload."""
    body = json.dumps(payload, separators=(",", ":"), sort_keys=True).encode()
    return json.dumps(
        {"w": _VERSION, "body": body.decode(), "mac": _mac(token, key, body)}, separators=(",", ":")
    ).encode()


def open_sealed(token: bytes | None, key: str, raw: bytes) -> Any:
    """The payload sealed at ``key``; ``AuthError`` if unsigned or forged, ``StoreError`` if malformed."""
    try:
        outer = json.loads(raw)
        body = outer["body"].encode()
        mac = outer["mac"]
        if outer.get("w") != _VERSION or not isinstance(mac, str):
            raise ValueError("unknown record version")
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
        raise StoreError(f"malformed record at store key {key!r}: {type(e).__name__}: {e}") from None
    if not hmac.compare_digest(mac, _mac(token, key, body)):
        raise AuthError(f"record at store key {key!r} has a bad signature (wrong token or forged record)")
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as e:
        raise StoreError(f"malformed record body at store key {key!r}: {e}") from None


def b64(raw: bytes) -> str:
    """Bytes (a transport endpoint or region descriptor) as they travel inside a JSON record."""
    return base64.b64encode(bytes(raw)).decode()


def unb64(text: str) -> bytes:
    """The bytes a record's ``b64`` field holds; a malformed one is a ``StoreError``."""
    try:
        return base64.b64decode(text, validate=True)
    except (ValueError, TypeError) as e:
        raise StoreError(f"malformed descriptor in a store record: {e}") from None
