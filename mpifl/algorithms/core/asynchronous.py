"""What the asynchronous methods (FedBuff, FedAsync) share: the clients training at once, and the staleness weights
(Xie, Koyejo & Gupta, "Asynchronous federated optimization", OPT workshop 2020, section 3): an update computed on
a model tau server steps old weighs s(tau).

* polynomial: s(tau) = (tau + 1)^-a (FedBuff's 1/sqrt(1 + tau) is a = 1/2, Nguyen et al., AISTATS 2022);
* hinge: s(tau) = 1 for tau <= b, else 1 / (a (tau - b) + 1);
* constant: s(tau) = 1.
"""

from __future__ import annotations

import numpy as np

from ...plan.config import RunConfig
from ...plan.seeding import sample_size


def staleness_weights(kind: str, staleness: np.ndarray, a: float, b: int) -> np.ndarray:
    """s(tau) of each update's staleness tau (float64)."""
    tau = np.asarray(staleness, dtype=np.float64)
    if kind == "polynomial":
        return (tau + 1.0) ** -a
    if kind == "hinge":
        return np.where(tau <= b, 1.0, 1.0 / (a * (tau - b) + 1.0))
    return np.ones_like(tau)


def run_staleness_weights(cfg: RunConfig, staleness: np.ndarray) -> np.ndarray:
    """s(tau) under the run's ``--staleness``, ``--staleness-a`` and ``--staleness-b``."""
    return staleness_weights(cfg.opt("staleness"), staleness, cfg.opt("staleness_a"), cfg.opt("staleness_b"))


def clients_at_once(algo) -> int:
    """``--concurrency``, or, when 0, ``--fraction``'s max(1, round(C N)) of the N training clients."""
    return algo.cfg.opt("concurrency") or sample_size(algo.num_training_clients, algo.cfg.fraction)
