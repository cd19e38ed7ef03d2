"""What an algorithm's hooks read and write: the server's state, a client's, and a round's uploads.

State that must survive from one round to the next lives in these tensors (``ServerState.extra``,
``ClientState.private``), never in Python attributes of the method: they are what a checkpoint saves.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from ...plan.clients import ClientSpec


@dataclass
class ServerState:
    """Global state on rank 0: the shared model entries and the method's own tensors."""

    model: dict[str, torch.Tensor]
    extra: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class ClientState:
    """A logical client on its host rank: its data split and its private tensors."""

    spec: ClientSpec
    private: dict[str, torch.Tensor]

    @property
    def id(self) -> int:
        return self.spec.id


@dataclass
class Uploads:
    """What the sampled clients sent this round, in client-id order.

    ``tensors[name][k]`` is client k's value of a gathered entry (:meth:`~.base.Algorithm.gathered_keys`): a numpy
    view into the receive buffer, so aggregation reads the gathered bytes in place.  ``sums[name]`` is the
    float64 result of the method's reduction ``name`` (:meth:`~.base.Algorithm.reductions`), filled before
    :meth:`~.base.Algorithm.aggregate`.
    """

    clients: np.ndarray
    meta: np.ndarray  # (K,) records of CLIENT_META: num_samples, num_steps, loss_sum, correct, seen
    tensors: dict[str, list[np.ndarray]]
    sums: dict[str, np.ndarray] = field(default_factory=dict)
    #: per upload, the server steps since the model version it trained on (asynchronous methods; else zeros)
    staleness: np.ndarray | None = None

    def __post_init__(self):
        if self.staleness is None:
            self.staleness = np.zeros(len(self.clients), dtype=np.int64)

    @property
    def num_samples(self) -> np.ndarray:
        return self.meta["num_samples"]

    @property
    def num_steps(self) -> np.ndarray:
        return self.meta["num_steps"]

    @classmethod
    def planned(cls, clients: Sequence[ClientSpec], sampled: Sequence[int], staleness: Sequence[int] = ()) -> Uploads:
        """What a round's plan says of its uploads before any arrives, the same on every rank: the ``sampled``
        clients whose uploads arrive, their ``num_samples`` and staleness (no other record field, no gathered
        entry: a method reading them must declare :attr:`~.base.Algorithm.reductions_need_results`)."""
        meta = np.array([(clients[c].num_train,) for c in sampled], dtype=[("num_samples", np.float64)])
        return cls(clients=np.array(sampled, dtype=np.int64), meta=meta, tensors={},
                   staleness=np.array(staleness, dtype=np.int64) if len(staleness) else None)
