"""Shared pieces of the update-based methods: SCAFFOLD, FedNova, FedAvgM, FedDyn, FedDC.

These methods act on a client's model update ``y - x`` (``y`` its trained
model, ``x`` the download) over the *trainable* shared parameters: that is
where their control variates, drift variables, normalizers and server
momentum live.  Buffers (BN running statistics) have no gradient and no
update direction of their own; every one of these methods averages them as
FedAvg does (weighted mean), and BN ``num_batches_tracked`` stays on each
client (``Algorithm.shares``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from ...transport.wire import TensorSpec

def trainable_keys(algo) -> list[str]:
    """Shared model entries that are floating-point parameters, in state-dict order."""
    params = {e.key for e in algo.entries if e.is_param and e.dtype.is_floating_point}
    return [k for k in algo.shared_keys if k in params]


def trainable_specs(algo, prefix: str) -> list[TensorSpec]:
    """One tensor per trainable key, named ``prefix + key``, with the entry's shape and dtype."""
    entry = {e.key: e for e in algo.entries}
    return [TensorSpec(prefix + k, entry[k].shape, entry[k].dtype) for k in trainable_keys(algo)]


def training_share(algo, num_clients: int) -> list[float]:
    """1/N for each of a round's ``num_clients`` clients: their coefficients in a sum over all N training
    clients (SCAFFOLD's sum_S delta c_i / N, FedDyn's sum_P theta_k / m)."""
    n = algo.num_training_clients
    if n < num_clients:
        raise RuntimeError(f"{algo.name} needs the number of training clients (Algorithm.bind_clients)")
    return [1.0 / n] * num_clients


def parameters(model: nn.Module, keys: Sequence[str]) -> list[nn.Parameter]:
    """The model's parameters named ``keys``, in that order."""
    named = dict(model.named_parameters())
    return [named[k] for k in keys]


def add_to_grads(params: Sequence[nn.Parameter], terms: Sequence[torch.Tensor]) -> None:
    """``p.grad += term`` for every parameter that has a gradient (one fused call)."""
    pairs = [(p.grad, t) for p, t in zip(params, terms) if p.grad is not None]
    if pairs:
        torch._foreach_add_([g for g, _ in pairs], [t for _, t in pairs])


def solver_norm(steps, momentum: float):
    """||a||_1 of K local steps (FedNova, Wang et al. 2020): how far K steps move per unit of a constant gradient,
    in learning rates.  K for SGD; ``[K - rho (1 - rho^K) / (1 - rho)] / (1 - rho)`` for SGD with momentum rho
    started from a zero buffer (the runtime's fresh optimizer each round).  Works on scalars and arrays."""
    steps = np.asarray(steps, dtype=np.float64)
    if momentum == 0:
        return steps
    rho = float(momentum)
    return (steps - rho * (1 - rho ** steps) / (1 - rho)) / (1 - rho)


def local_steps(num_train: int, batch_size: int, epochs: int) -> int:
    """SGD steps of one client's round as ``mpifl.client.training.train_local`` takes them.

    E epochs of ceil(n / B) mini-batches, less a last batch of one sample,
    which the runtime drops when B > 1 (``ClientData.train_batches``).
    """
    batches = math.ceil(num_train / batch_size)
    if batch_size > 1 and num_train % batch_size == 1:
        batches -= 1
    return epochs * batches
