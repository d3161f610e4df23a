"""wbridge: RDMA-first weight transfer from RL trainers to rollout workers.

Trainer ranks ``Publisher.publish()`` registered memory under a version counter; rollout workers
``Subscriber.pull()`` exactly the bytes they need with planned one-sided reads.
"""

from planner.layout import Flat, Fused, Shard, Stack

from .errors import (
    AuthError,
    IntegrityError,
    LayoutError,
    MissingExtraError,
    PlanError,
    StaleVersionError,
    StoreError,
    TransportError,
    UsageError,
    WaitTimeout,
    WBridgeError,
)
from .options import Async, Delta, Staging, ZeroCopy, Zone
from .publisher import Publisher
from .store import Store, open_store
from .subscriber import Subscriber

__version__ = "0.1.0"

__all__ = [
    "Async",
    "AuthError",
    "Delta",
    "Flat",
    "Fused",
    "IntegrityError",
    "LayoutError",
    "MissingExtraError",
    "PlanError",
    "Publisher",
    "Shard",
    "Stack",
    "StaleVersionError",
    "Staging",
    "Store",
    "StoreError",
    "Subscriber",
    "TransportError",
    "UsageError",
    "WBridgeError",
    "WaitTimeout",
    "ZeroCopy",
    "Zone",
    "open_store",
]
