"""Logical clients: which domain each one holds and which rows of its shard.

Protocols (one rule, several knobs):

* **cross-silo** (default): one client per domain, holding the whole domain;
* **cross-device**: ``--clients-per-domain K`` splits every domain among K
  clients; ``--num-clients N`` instead deals N clients over the domains in
  turn (domain d gets ``N // D`` clients, one more for the first ``N % D``),
  which is also FedWon's heterogeneity sweep (domains repeated over N
  clients);
* a domain's train, val and test rows are split among its clients into
  disjoint near-equal parts by a seeded permutation, or, with
  ``--dirichlet ALPHA``, by class proportions ``p_k ~ Dir(ALPHA)`` drawn per
  class and domain (Hsu et al., 2019) and used for all three splits, so a
  client's val/test share its training label mix;
* ``--samples-per-client S``: every client keeps a seeded subset of S
  training rows (equal-size training sets, as FedBN's fixed partitions);
* ``--holdout DOMAIN``: the held-out domain is one evaluation-only client
  that never trains and is never sampled; all its rows (train, val and test)
  are target test data, the usual domain-generalization protocol.

A domain's accuracy pools its clients' counts, so for the global model it is
the accuracy on the whole domain.  Client ids are domain-major, in manifest
domain order.  Every rank computes the same clients from the manifest (and,
for Dirichlet, the labels rank 0 reads and broadcasts).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..data import DatasetManifest
from ..errors import MpiflError
from .seeding import partition_rng

SPLITS = ("train", "val", "test")


@dataclass(frozen=True)
class ClientSpec:
    """One logical client: its id, domain and row indices per split."""

    id: int
    domain: str
    rows: dict  # split -> ascending np.ndarray of row indices into the domain shard
    trains: bool = True  # False: a held-out domain, evaluated on all its rows

    @property
    def num_train(self) -> int:
        return len(self.rows["train"]) if self.trains else 0


def clients_per_domain(domains: list[str], per_domain: int, num_clients: int = 0) -> dict[str, int]:
    """How many clients each (training) domain gets: K each, or N dealt in turn."""
    if not num_clients:
        return {d: per_domain for d in domains}
    if num_clients < len(domains):
        raise MpiflError(f"--num-clients {num_clients} is fewer than the {len(domains)} training domains; "
                         "raise it or hold domains out")
    return {d: num_clients // len(domains) + (i < num_clients % len(domains)) for i, d in enumerate(domains)}


def make_clients(manifest: DatasetManifest, per_domain: int, seed: int, holdout: str | None = None, *,
                 num_clients: int = 0, dirichlet: float = 0.0, samples_per_client: int = 0,
                 percent: float = 1.0, labels: dict | None = None) -> list[ClientSpec]:
    """All logical clients of a run, in id order.

    ``samples_per_client`` (a count) or ``percent`` (a fraction, FedBN's
    ``--percent``) keeps a seeded subset of each client's training rows.

    ``labels[domain][split]`` (int64 arrays) are needed only for ``dirichlet``.
    """
    if holdout is not None and holdout not in manifest.domains:
        raise MpiflError(f"--holdout {holdout} is not a domain of {manifest.name}; "
                         f"choose one of: {', '.join(manifest.domains)} (or all)")
    check_splits(manifest, holdout)
    counts = clients_per_domain([d for d in manifest.domains if d != holdout], per_domain, num_clients)
    clients = []
    for d, domain in enumerate(manifest.domains):
        sizes = manifest.split_sizes(domain)
        if domain == holdout:
            clients.append(ClientSpec(id=len(clients), domain=domain, trains=False,
                                      rows={split: np.arange(sizes[split]) for split in SPLITS}))
            continue
        rng = partition_rng(seed, d)
        if dirichlet:
            parts = _dirichlet_parts(labels[domain], counts[domain], dirichlet, manifest.num_classes, rng)
        else:
            parts = {split: _even_parts(sizes[split], counts[domain], rng) for split in SPLITS}
        for k in range(counts[domain]):
            rows = {split: parts[split][k] for split in SPLITS}
            if samples_per_client:
                rows["train"] = _subset(rows["train"], samples_per_client, rng, domain)
            elif percent < 1:
                rows["train"] = _subset(rows["train"], max(1, round(percent * len(rows["train"]))), rng, domain)
            clients.append(ClientSpec(id=len(clients), domain=domain, rows=rows))
    return clients


def check_splits(manifest: DatasetManifest, holdout: str | None) -> None:
    """Every training domain has train, val (model selection) and test images; a held-out domain has images."""
    for domain in manifest.domains:
        sizes = manifest.split_sizes(domain)
        if domain == holdout:
            if not sum(sizes.values()):
                raise MpiflError(f"domain {domain} of {manifest.name} has no images to evaluate when held out; "
                                 "hold out another domain")
            continue
        if not sizes["train"]:
            raise MpiflError(f"domain {domain} of {manifest.name} has no training images; hold it out "
                             f"(--holdout {domain}: it is then only evaluated) or prepare the dataset again with "
                             "training images for it")
        for split in ("val", "test"):
            if not sizes[split]:
                raise MpiflError(f"domain {domain} of {manifest.name} has no {split} images (every training domain "
                                 f"needs val images to choose the best round and test images to report); prepare "
                                 f"the dataset again with a {split} split for it, or hold it out (--holdout {domain})")


def _even_parts(n: int, parts: int, rng: np.random.Generator) -> list[np.ndarray]:
    if parts == 1:
        return [np.arange(n)]
    return [np.sort(p) for p in np.array_split(rng.permutation(n), parts)]


def _dirichlet_parts(labels: dict, parts: int, alpha: float, num_classes: int,
                     rng: np.random.Generator) -> dict[str, list[np.ndarray]]:
    """Per class k, proportions p_k ~ Dir(alpha * 1) over the clients, applied to each split's rows of k."""
    proportions = rng.dirichlet(np.full(parts, alpha), size=num_classes)  # (classes, clients)
    out = {}
    for split in SPLITS:
        pieces: list[list[np.ndarray]] = [[] for _ in range(parts)]
        for k in range(num_classes):
            rows = rng.permutation(np.flatnonzero(labels[split] == k))
            cuts = np.round(np.cumsum(proportions[k])[:-1] * len(rows)).astype(int)
            for client, piece in enumerate(np.split(rows, cuts)):
                pieces[client].append(piece)
        out[split] = [np.sort(np.concatenate(p)) for p in pieces]
    return out


def _subset(rows: np.ndarray, size: int, rng: np.random.Generator, domain: str) -> np.ndarray:
    if len(rows) < size:
        raise MpiflError(f"a client of domain {domain} has {len(rows)} training images, fewer than "
                         f"--samples-per-client {size}; lower it")
    return np.sort(rng.choice(rows, size=size, replace=False))
