"""The process set of ``stall.py`` and ``update_e2e.py``: TP x DP trainer ranks holding a synthetic
model's shards as Megatron lays them out, ROLLOUTS rollout ranks holding it as vLLM does, each in
its own process, each with a wbridge end and a place in the baselines' groups (``_common``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from _common import (
    TOKEN,
    Actor,
    Groups,
    init_groups,
    leave_groups,
    load_targets,
    model_config,
    open_publisher,
    peak_rss_mib,
    start_actors,
    trainer_boxes,
)

TP, DP, ROLLOUTS = 2, 2, 2


class BenchRank:
    """What a trainer or rollout rank of the process set holds besides its tensors: the model, the
    store, its wbridge end (closed by ``close_channel``) and its place in the baselines' groups.

    model: a ``model_config`` size
    store_url: the wbridge store
    """

    def __init__(self, model: str, store_url: str) -> None:
        self.cfg = model_config(model)
        self.store_url = store_url
        self.groups: Groups | None = None

    def rss(self) -> float:
        return peak_rss_mib()

    def close_channel(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self.close_channel()
        leave_groups(self.groups)
        self.groups = None


class TrainerRank(BenchRank):
    """A trainer rank: live shards laid out as Megatron does (separate q/k/v and gate/up), and a
    publisher once ``open_publisher`` ran.

    rank: its rank among the TP * DP trainers (TP rank ``rank % TP``)
    model: a ``model_config`` size
    store_url: the wbridge store
    """

    def __init__(self, rank: int, model: str, store_url: str) -> None:
        from wbridge.testing.synthetic import make_tensors

        super().__init__(model, store_url)
        self.rank = rank
        self.tensors = make_tensors(self.cfg, TP, rank % TP, fused=False, version=None)
        self.pub = None

    def open_publisher(self, channel: str, transport: str, **kw: Any) -> None:
        self.pub = open_publisher(channel, self.store_url, self.rank, TP * DP, self.tensors, transport, **kw)

    def close_channel(self) -> None:
        if self.pub is not None:
            self.pub.close()
            self.pub = None

    def dist_init(self, port: int) -> None:
        self.groups = init_groups(self.rank, TP * DP, ROLLOUTS, TP, port)
        self.boxes = trainer_boxes(self.cfg, TP)


class RolloutRank(BenchRank):
    """A rollout rank: tensors laid out as vLLM does (fused qkv_proj and gate_up_proj), filled with
    0xFF until a version arrives, and a subscriber once ``open_subscriber`` ran.

    idx: its index among the ROLLOUTS rollouts (its TP rank)
    model: a ``model_config`` size
    store_url: the wbridge store
    """

    def __init__(self, idx: int, model: str, store_url: str) -> None:
        super().__init__(model, store_url)
        self.idx = idx
        self.tensors = self.new_tensors()
        self.sub = None

    def new_tensors(self) -> dict[str, tuple[Any, Any]]:
        """A fresh set of this rank's tensors (0xFF)."""
        from wbridge.testing.synthetic import make_tensors

        return make_tensors(self.cfg, TP, self.idx, fused=True, version=None, fill_value=0xFF)

    def open_subscriber(self, channel: str, transport: str, tensors: Mapping[str, Any] | None = None) -> None:
        """Subscribes ``tensors`` (default: this rank's own) to ``channel`` over ``transport``."""
        from wbridge import Subscriber

        self.sub = Subscriber(channel, self.store_url, token=TOKEN, transport=transport, name=f"rollout-{self.idx}")
        self.sub.register(self.tensors if tensors is None else tensors)

    def close_channel(self) -> None:
        if self.sub is not None:
            self.sub.close()
            self.sub = None

    def dist_init(self, port: int) -> None:
        self.groups = init_groups(TP * DP + self.idx, TP * DP, ROLLOUTS, TP, port)
        self.targets = load_targets(self.tensors)


def start_ranks(
    trainer: Callable[..., Any], rollout: Callable[..., Any], args: tuple, timeout: float
) -> tuple[list[Actor], list[Actor]]:
    """Spawns the TP * DP trainers ``trainer(rank, *args)`` and the ROLLOUTS rollouts
    ``rollout(idx, *args)`` as actors; returns (trainers, rollouts)."""
    specs = [(f"trainer-{r}", trainer, (r, *args), {}) for r in range(TP * DP)]
    specs += [(f"rollout-{i}", rollout, (i, *args), {}) for i in range(ROLLOUTS)]
    acts = start_actors(specs, timeout=timeout)
    return acts[: TP * DP], acts[TP * DP :]
