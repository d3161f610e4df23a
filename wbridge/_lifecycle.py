"""Explicit lifetimes shared by Publisher and Subscriber."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger("wbridge")


class Closeable:
    """Context manager and finalizer around an idempotent ``close()``."""

    def close(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - never raise from a finalizer
            pass


def quietly(fn: Callable[..., Any], *args: Any) -> None:
    """Runs one teardown step; a failure is logged and teardown goes on."""
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001
        log.debug("teardown step %s failed: %s", getattr(fn, "__qualname__", fn), e)
