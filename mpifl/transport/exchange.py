"""One-time exchanges before round 1: every training client's tensor on every rank.

Anything that shares something derived from the data once contributes to the same list of exchanges
(``Session.exchanges``): the input normalization (FedRDN's channel statistics,
:class:`~mpifl.plan.normalize.InputNormalization`) and the algorithm (FedMix's mean images, see
``Algorithm.setup_exchange``).  Each is one Gatherv to rank 0, which orders the rows by client id (so what a
client draws from them does not depend on the placement), and one Bcast.
"""

from __future__ import annotations

from typing import Callable, Protocol, Sequence

import numpy as np
import torch

from .comm import Comm
from .wire import TensorSpec


class OneTimeExchange(Protocol):
    """A contributor to the one-time exchanges, the same object on every rank."""

    def setup_exchange(self) -> TensorSpec | None:
        """The tensor each training client contributes once before round 1 (None: no exchange)."""

    def setup_contribution(self, client, data) -> torch.Tensor:
        """A client's tensor, on its host rank (``client``: its ``ClientState``, ``data``: its ``ClientData``)."""

    def setup_received(self, everyone: torch.Tensor) -> None:
        """(N_train, *shape): every training client's tensor in client-id order, on every rank."""


def exchange_all(comm: Comm, exchanges: Sequence[OneTimeExchange], trainers: list[list[int]],
                 contributions: Callable[[OneTimeExchange], list[torch.Tensor]], device=None) -> None:
    """Run every exchange in order; ``contributions(exchange)``: this rank's training clients' tensors,
    ascending id (none on rank 0); what arrives is moved to ``device`` (a client rank's)."""
    for exchange in exchanges:
        spec = exchange.setup_exchange()
        if spec is not None:
            everyone = exchange_once(comm, contributions(exchange), trainers, spec, spec.name)
            exchange.setup_received(everyone if device is None else everyone.to(device))


def exchange_once(comm: Comm, local: list[torch.Tensor], trainers: list[list[int]], spec: TensorSpec,
                  what: str) -> torch.Tensor:
    """(N_train, *spec.shape) tensor of every training client's contribution, in client-id order.

    ``local``: this rank's training clients' tensors, ascending id (empty on
    rank 0); ``trainers[h]``: the training clients rank h+1 hosts, ascending.
    """
    dtype = torch.empty(0, dtype=spec.dtype).numpy().dtype
    for tensor in local:
        if tuple(tensor.shape) != tuple(spec.shape):
            raise ValueError(f"{spec.name}: a client contributed shape {tuple(tensor.shape)}, expected {spec.shape}")
    rows = [t.detach().cpu().to(spec.dtype).numpy().reshape(-1) for t in local]
    mine = (np.concatenate(rows) if rows else np.zeros(0, dtype=dtype)).view(np.uint8)
    counts = [0] + [len(ids) * spec.nbytes for ids in trainers]
    segments = comm.gatherv(np.ascontiguousarray(mine), counts, what=f"the clients' {what}")
    everyone = np.empty((sum(len(ids) for ids in trainers), *spec.shape), dtype=dtype)
    if comm.rank == 0:
        gathered = np.concatenate([s.view(dtype) for s in segments]).reshape(everyone.shape)
        everyone[...] = gathered[np.argsort(np.concatenate([np.array(ids, dtype=np.int64) for ids in trainers]))]
    comm.bcast(everyone.reshape(-1).view(np.uint8), what=what)
    return torch.from_numpy(everyone)
