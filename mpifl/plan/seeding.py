"""Random streams derived from the run seed, never from the rank.

Rank-count invariance (docs/design.md, "Determinism") needs every random draw to depend only on
what it is for: the server's client sampling on (seed, round), a client's
shuffling, augmentation and dropout on (seed, client, round), the data
partition on (seed, domain).  Each purpose has its own tag so streams never
coincide.
"""

from __future__ import annotations

import numpy as np
import torch

(_SAMPLING, _CLIENT, _PARTITION, _INIT, _PERSONALIZE, _STATISTICS, _SETUP, _DP_NOISE, _DPSGD_NOISE, _PROFILE,
 _CONDITIONS) = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11)


def _sequence(*words: int) -> np.random.SeedSequence:
    return np.random.SeedSequence([int(w) for w in words])


def sample_size(num_clients: int, fraction: float) -> int:
    """K, the clients a round samples: max(1, round(C*N)) of N."""
    return min(num_clients, max(1, int(round(fraction * num_clients))))


def sample_clients(seed: int, round_index: int, num_clients: int, fraction: float) -> np.ndarray:
    """Participating client ids of a round, ascending: max(1, round(C*N)) of N, without replacement."""
    return sample_among(seed, round_index, np.arange(num_clients), sample_size(num_clients, fraction))


def sample_among(seed: int, round_index: int, candidates: np.ndarray, count: int) -> np.ndarray:
    """``count`` of the ascending ``candidates``, without replacement, ascending; all of them when there are no
    more (round ``round_index``'s sampling stream: with every client a candidate, :func:`sample_clients`)."""
    if count >= len(candidates):
        return np.asarray(candidates)
    rng = np.random.default_rng(_sequence(seed, _SAMPLING, round_index))
    return np.sort(np.asarray(candidates)[rng.choice(len(candidates), size=count, replace=False)])


def poisson_clients(seed: int, round_index: int, num_clients: int, rate: float) -> np.ndarray:
    """Participating client ids of a round, ascending: each of N independently with probability ``rate`` (Poisson
    sampling, which the sampled Gaussian mechanism's accounting assumes; a round may have none)."""
    if rate >= 1.0:
        return np.arange(num_clients)
    rng = np.random.default_rng(_sequence(seed, _SAMPLING, round_index, 1))
    return np.flatnonzero(rng.random(num_clients) < rate)


def dp_noise_rng(seed: int, round_index: int) -> np.random.Generator:
    """numpy generator of the Gaussian noise rank 0 adds to a round's sums (client-level DP)."""
    return np.random.default_rng(_sequence(seed, _DP_NOISE, round_index))


def dp_client_generator(seed: int, client: int, round_index: int, device: torch.device) -> torch.Generator:
    """torch generator, on ``device``, of the noise one client adds to its round's update (local DP)."""
    generator = torch.Generator(device=device)
    generator.manual_seed(int(_sequence(seed, _DP_NOISE, round_index, client + 1).generate_state(1, np.uint64)[0] >> 1))
    return generator


def participants(seed: int, round_index: int, num_clients: int, fraction: float, poisson: bool) -> np.ndarray:
    """A round's participants among N training clients (positions, ascending): Poisson sampling at rate
    ``fraction`` where client-level DP's accountant assumes it (``poisson``: ``--dp-clip``), else a fixed-size
    sample (:func:`sample_clients`)."""
    return (poisson_clients if poisson else sample_clients)(seed, round_index, num_clients, fraction)


def profile_rng(seed: int, purpose: int, client: int) -> np.random.Generator:
    """numpy generator of one client's draw of a profile quantity (``purpose``: speed, bandwidth ...)."""
    return np.random.default_rng(_sequence(seed, _PROFILE, purpose, client))


def conditions_rng(seed: int, purpose: int, moment: int) -> np.random.Generator:
    """numpy generator of every client's draw of one condition (``purpose``: online, dropping out ...) at one
    ``moment`` (a round, or an asynchronous run's sampling event): draw N values and take client k's k-th, so a
    client's draw does not depend on who hosts it."""
    return np.random.default_rng(_sequence(seed, _CONDITIONS, purpose, moment))


def client_rng(seed: int, client: int, round_index: int) -> np.random.Generator:
    """numpy generator for one client's round (batch order)."""
    return np.random.default_rng(_sequence(seed, _CLIENT, client, round_index))


def client_torch_seed(seed: int, client: int, round_index: int) -> int:
    """Seed for torch's generators during one client's round (dropout, augmentation)."""
    return int(_sequence(seed, _CLIENT, client, round_index, 1).generate_state(1, np.uint64)[0] >> 1)


def noise_seed(seed: int, client: int, round_index: int) -> int:
    """Seed for the generator of the privacy noise one client adds in one round (DP-SGD), a stream of its own."""
    return int(_sequence(seed, _DPSGD_NOISE, client, round_index).generate_state(1, np.uint64)[0] >> 1)


def personalization_seeds(seed: int, client: int, round_index: int) -> tuple[np.random.Generator, int]:
    """(numpy generator, torch seed) for personalizing one client's model before evaluating round ``round_index``
    (``Algorithm.personalize``): a stream of its own, so evaluating never shifts training's draws."""
    sequence = _sequence(seed, _PERSONALIZE, client, round_index)
    return np.random.default_rng(sequence), int(sequence.generate_state(1, np.uint64)[0] >> 1)


def statistics_rng(seed: int, client: int) -> np.random.Generator:
    """numpy generator for the augmentations of one client's pass computing its own statistics (FedRDN)."""
    return np.random.default_rng(_sequence(seed, _STATISTICS, client))


def setup_rng(seed: int, client: int, purpose: int) -> np.random.Generator:
    """numpy generator for one of a client's draws before round 1 (a method's choice of the images it shares,
    of how it augments its training set), ``purpose`` telling the draws of one method apart."""
    return np.random.default_rng(_sequence(seed, _SETUP, client, purpose))


def partition_rng(seed: int, domain_index: int) -> np.random.Generator:
    """numpy generator for splitting one domain among its clients."""
    return np.random.default_rng(_sequence(seed, _PARTITION, domain_index))


def seed_model_init(seed: int) -> None:
    """Seed torch before building the initial model: identical on every rank."""
    torch.manual_seed(int(_sequence(seed, _INIT).generate_state(1, np.uint64)[0] >> 1))
