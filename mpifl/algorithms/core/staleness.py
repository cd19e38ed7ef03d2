"""Staleness weights of asynchronous aggregation (Xie, Koyejo & Gupta, "Asynchronous federated optimization",
OPT workshop 2020, section 3): an update computed on a model tau server steps old weighs s(tau).

* polynomial: s(tau) = (tau + 1)^-a (FedBuff's 1/sqrt(1 + tau) is a = 1/2, Nguyen et al., AISTATS 2022);
* hinge: s(tau) = 1 for tau <= b, else 1 / (a (tau - b) + 1);
* constant: s(tau) = 1.
"""

from __future__ import annotations

import numpy as np


def staleness_weights(kind: str, staleness: np.ndarray, a: float, b: int) -> np.ndarray:
    """s(tau) of each update's staleness tau (float64)."""
    tau = np.asarray(staleness, dtype=np.float64)
    if kind == "polynomial":
        return (tau + 1.0) ** -a
    if kind == "hinge":
        return np.where(tau <= b, 1.0, 1.0 / (a * (tau - b) + 1.0))
    return np.ones_like(tau)
