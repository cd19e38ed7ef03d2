"""The privacy accountant: Renyi DP of the sampled Gaussian mechanism (Mironov, Talwar & Zhang, "Renyi Differential
Privacy of the Sampled Gaussian Mechanism", 2019), Opacus' ``RDPAccountant`` with its default orders.

A mechanism's history is a list of (noise multiplier z, sampling rate q, steps), the accountant's whole state: it
is what a checkpoint keeps (:func:`history_tensor`), so a resumed run goes on from the same epsilon.  Every number
here comes from Opacus; nothing is computed by hand.
"""

from __future__ import annotations

import functools
import importlib
import warnings

import numpy as np
import torch

from ..errors import MpiflError


def opacus(flag: str):
    """The ``opacus`` package, or one line naming the extra that brings it (``flag``: the option that needs it)."""
    try:
        return importlib.import_module("opacus")
    except ImportError:
        raise MpiflError(f"{flag} needs Opacus (its privacy accountant): pip install -e \".[privacy]\" "
                         "(or pip install 'mpifl[privacy]')") from None


def epsilon(history: list[tuple[float, float, int]], delta: float, flag: str) -> float:
    """epsilon at ``delta`` of the compositions in ``history`` [(z, q, steps)] (0 for an empty history): what
    Opacus' ``RDPAccountant.get_epsilon`` computes, its orders' RDP of one step cached per (z, q) (Opacus multiplies
    one step's RDP by the steps, so the sum is the same), which keeps rank 0's round free of the series."""
    analysis = importlib.import_module(opacus(flag).__name__ + ".accountants.analysis.rdp")
    steps = [(float(z), float(q), int(n)) for z, q, n in history if n]
    if not steps:
        return 0.0
    rdp = sum(np.asarray(_step_rdp(z, q, flag)) * n for z, q, n in steps)
    return float(analysis.get_privacy_spent(orders=_orders(flag), rdp=rdp, delta=delta)[0])


def _orders(flag: str) -> list[float]:
    return opacus(flag).accountants.RDPAccountant.DEFAULT_ALPHAS


@functools.lru_cache(maxsize=1024)  # one (z, q) per client of a DP-SGD run, whose sizes and noise differ
def _step_rdp(z: float, q: float, flag: str) -> tuple[float, ...]:
    analysis = importlib.import_module(opacus(flag).__name__ + ".accountants.analysis.rdp")
    return tuple(analysis.compute_rdp(q=q, noise_multiplier=z, steps=1, orders=_orders(flag)))


@functools.lru_cache(maxsize=256)  # the clients of a DP-SGD run share (rate, steps) when their sizes do
def noise_for(target: float, delta: float, rate: float, steps: int, flag: str) -> float:
    """The least noise multiplier (Opacus' bisection, within 1 % of ``target``) whose ``steps`` compositions at
    sampling rate ``rate`` reach epsilon <= ``target`` at ``delta``; one line when none does (Opacus tries up to
    1e6).  ``flag``: the mechanism's switch, ``--dp-clip`` or ``--dpsgd-clip``, whose family names the target and
    delta options."""
    utils = importlib.import_module(opacus(flag).__name__ + ".accountants.utils")
    family = flag.rsplit("-", 1)[0]  # --dp, --dpsgd
    try:
        with warnings.catch_warnings():  # the search's large noises put the best order at the largest: no matter
            warnings.filterwarnings("ignore", message="Optimal order is the largest alpha")
            return float(utils.get_noise_multiplier(target_epsilon=target, target_delta=delta, sample_rate=rate,
                                                    steps=steps, accountant="rdp", epsilon_tolerance=0.01 * target))
    except ValueError:
        raise MpiflError(f"{family}-epsilon {target:g}: no noise multiplier reaches it over {steps} steps at sampling "
                         f"rate {rate:.4g} and delta {delta:.3g}; raise {family}-epsilon or {family}-delta") from None


def add_step(history: list[tuple[float, float, int]], z: float, q: float) -> list[tuple[float, float, int]]:
    """``history`` with one more composition at (z, q), merged into the last entry when it has the same (z, q)."""
    if history and history[-1][:2] == (z, q):
        return history[:-1] + [(z, q, history[-1][2] + 1)]
    return history + [(z, q, 1)]


def history_tensor(history: list[tuple[float, float, int]]) -> torch.Tensor:
    """``history`` as a float64 (n, 3) tensor, for a checkpoint (steps are exact in float64 below 2^53)."""
    return torch.tensor(history, dtype=torch.float64).reshape(-1, 3)


def history_of(tensor: torch.Tensor) -> list[tuple[float, float, int]]:
    return [(float(z), float(q), int(steps)) for z, q, steps in tensor.tolist()]
