"""Input normalization (``--input-norm``) and FedRDN, an augmentation plug-in for any algorithm (``--aug``).

``--input-norm`` sets the dataset normalization ``x = (p / 255 - mean) / std`` used with ``--aug none``:

* ``pooled``   - the manifest's mean/std, pooled over the train images of every domain in the
  dataset build (mpifl's default; a domain is normalized differently in a 2- and a 5-domain build);
* ``domain``   - each domain's own train mean/std (its shard's), whatever other domains exist;
  a held-out domain uses its own train split's;
* ``fixed``    - the constants of the dataset's reference code
  (:data:`mpifl.data.registry.FIXED_NORMALIZATION`: 0.5/0.5 on Digits-Five as FedBN's code, 0/1
  on Office-Caltech-10 and DomainNet, where FedBN's code only scales to [0, 1]; 0 and 1/255 on the prostate MRI, whose
  reference loaders (FedFA's, HarmoFL's) feed unscaled 0..255);
* ``imagenet`` - ImageNet's mean/std (:data:`IMAGENET`), for backbones pre-trained on it;
* ``auto``     - (the default) ``imagenet`` with ``--pretrained`` (torchvision's weights were trained
  on it; gPerXAN's code normalizes so), else ``pooled``: :func:`resolve_input_norm`, stored in
  ``config.json`` as the mode it resolved to.

Any other ``--aug`` replaces it with client statistics.

FedRDN (Yan, Fu, Li, Xie, Ma, Yang & Zhu, 2023, arXiv, "A Simple Data Augmentation for Feature
Distribution Skewed Federated Learning", section 3.2):

* each client computes its channel statistics before training (eqs. 5-6):
  ``mu_k`` = mean over its training images of the per-image channel means,
  ``sigma_k`` = mean over its images of the per-image channel standard
  deviations (population std over H x W), in [0, 1] pixel units (eq. 5
  prints a sum; the authors' public code takes the mean).  The authors' code
  computes them in one pass of its training loader, so on augmented images:
  ``--aug-stats augmented`` (default) passes the training images once
  through ``--train-transforms`` (a generator of its own, seeded by run seed
  and client), ``raw`` uses the stored images as the paper reads;
* the statistics of every training client are exchanged once, at setup:
  the only tensors FedRDN adds to the wire (``--show-manifest`` lists them);
* training normalizes ``x_hat = (x - mu_j) / sigma_j`` with statistics drawn
  uniformly from all clients' (eq. 7); at test time a client uses its own
  (eq. 8).

The paper draws one client's (mu, sigma) pair per image and epoch; the
authors' public code draws the mean and the std independently, once per
mini-batch.  ``--aug-draw batch`` (default) follows
the code, ``--aug-draw sample`` the paper's per-image pairs.  A held-out
domain, which never trains, uses its own statistics at test time as eq. 8
prescribes for every client, computed on its training split.

``--aug`` values:

* ``none``   - the dataset normalization of ``--input-norm`` everywhere;
* ``norm``   - conventional normalization with the client's own statistics in
  training and test (eq. 8 in both phases).  Not Table 1's 'norm.' rows: the authors' code
  (``fedavg_with_preprocess.py``, ``preprocess_way='base'``) normalizes those with ImageNet's
  mean/std, ``--aug none --input-norm imagenet`` (the FedRDN presets' rows);
* ``fedrdn`` - the method above;
* ``fedrdn-v`` - the ablation of section 4.4 (Table 4): the average of all
  clients' statistics in training and test.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Protocol

import numpy as np
import torch

from ..data.registry import FIXED_NORMALIZATION
from ..errors import MpiflError
from ..transport.wire import TensorSpec
from .seeding import statistics_rng

if TYPE_CHECKING:
    from ..data import DatasetManifest
    from ..data.shard import Shard
    from .clients import ClientSpec

INPUT_NORMS = ("auto", "pooled", "domain", "fixed", "imagenet")
#: ImageNet's channel mean and std (torchvision's pre-trained weights expect them).
IMAGENET = ([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
AUGMENTATIONS = ("none", "norm", "fedrdn", "fedrdn-v")
DRAWS = ("batch", "sample")
STATS_SOURCES = ("augmented", "raw")
EXCHANGED = ("fedrdn", "fedrdn-v")  # the modes that share statistics


def resolve_input_norm(mode: str, pretrained: str | None) -> str:
    """``--input-norm`` with ``auto`` resolved: ``imagenet`` for a pre-trained backbone, else ``pooled``."""
    if mode != "auto":
        return mode
    return "imagenet" if pretrained else "pooled"


def check_input_norm(mode: str, manifest: DatasetManifest) -> None:
    """One-line errors for an ``--input-norm`` the dataset cannot use."""
    if mode == "fixed" and manifest.name not in FIXED_NORMALIZATION:
        raise MpiflError(f"--input-norm fixed: no fixed constants are known for dataset {manifest.name} (only "
                         f"{', '.join(FIXED_NORMALIZATION)}); use pooled, domain or imagenet")
    if mode == "fixed" and len(FIXED_NORMALIZATION[manifest.name][0]) != manifest.channels:
        raise MpiflError(f"--input-norm fixed: the constants of {manifest.name} are for "
                         f"{len(FIXED_NORMALIZATION[manifest.name][0])} channels, this build of it has "
                         f"{manifest.channels}; use pooled or domain, or prepare the dataset with its converter's "
                         "channels")
    if mode == "imagenet" and manifest.channels != len(IMAGENET[0]):
        raise MpiflError(f"--input-norm imagenet needs RGB images; {manifest.name} has {manifest.channels} "
                         "channel(s): use pooled, domain or fixed")


def input_stats(mode: str, manifest: DatasetManifest, shard: Shard) -> tuple[list[float], list[float]]:
    """(mean, std) per channel of ``shard``'s domain under ``--input-norm mode`` (see the module docstring)."""
    if mode == "pooled":
        return manifest.normalize["mean"], manifest.normalize["std"]
    if mode == "domain":
        if not (shard.std > 0).all():
            raise MpiflError(f"domain {shard.domain}: a channel of its train images is constant (std 0), "
                             "--input-norm domain cannot divide by it; use pooled or fixed")
        return shard.mean.tolist(), shard.std.tolist()
    if mode == "fixed":
        return FIXED_NORMALIZATION[manifest.name]
    if mode == "imagenet":
        return IMAGENET
    raise ValueError(f"--input-norm {mode!r} reached the data unresolved (resolve_input_norm)")


def channel_stats(chunks: Iterable[torch.Tensor], channels: int) -> torch.Tensor:
    """(2, C) float64: mean of per-image channel means and of per-image channel stds (eqs. 5-6).

    ``chunks`` are N x C x H x W blocks of one client's images, pixel values in [0, 255].
    """
    sums = torch.zeros(2, channels, dtype=torch.float64)
    count = 0
    for chunk in chunks:
        x = (chunk.to(torch.float64) / 255).flatten(2)
        sums[0] += x.mean(dim=2).sum(dim=0).cpu()
        sums[1] += x.std(dim=2, unbiased=False).sum(dim=0).cpu()
        count += len(chunk)
    return sums / max(count, 1)


def stats_spec(channels: int) -> TensorSpec:
    """One client's statistics, as exchanged once before training."""
    return TensorSpec("fedrdn.stats", (2, channels), torch.float64,
                      derived="per-channel mean and std of the client's training images", exposes="data statistics")


class Normalizer:
    """Maps uint8 pixels to the model's input: ``x = p * scale + shift`` per channel.

    ``pool`` holds candidate (mean, std) rows for training draws; with a
    single row the normalization is fixed.  ``own`` is used at test time.
    """

    def __init__(self, pool: np.ndarray, own: np.ndarray, draw: str = "batch", device=None):
        self.draw = draw
        self._pool = torch.as_tensor(pool, dtype=torch.float32, device=device)  # (K, 2, C)
        own = torch.as_tensor(own, dtype=torch.float32, device=device)
        self._eval = _affine(own[0], own[1])

    def train(self, batch_size: int, rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        k = len(self._pool)
        if k == 1:
            return _affine(self._pool[0, 0], self._pool[0, 1])
        if self.draw == "batch":  # mean and std of independent clients, one draw per mini-batch
            i, j = rng.integers(k, size=2)
            return _affine(self._pool[i, 0], self._pool[j, 1])
        rows = torch.as_tensor(rng.integers(k, size=batch_size), device=self._pool.device)
        return _affine(self._pool[rows, 0], self._pool[rows, 1])  # one client's pair per image

    def eval(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self._eval


def _affine(mean: torch.Tensor, std: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, shift) of ``(p / 255 - mean) / std``, shaped to broadcast over N x C x H x W."""
    shape = (-1, mean.shape[-1], 1, 1)
    return (1.0 / (255.0 * std)).reshape(shape), (-mean / std).reshape(shape)


def fixed(mean, std, device=None) -> Normalizer:
    stats = np.array([mean, std], dtype=np.float64)
    return Normalizer(stats[None], stats, device=device)


def make_normalizer(aug: str, own: np.ndarray, everyone: np.ndarray | None, draw: str, device) -> Normalizer:
    """The normalizer of one client for ``--aug`` (``own``: (2, C); ``everyone``: (K, 2, C) or None)."""
    if aug == "norm":
        return Normalizer(own[None], own, device=device)
    if aug == "fedrdn":
        return Normalizer(everyone, own, draw=draw, device=device)
    if aug == "fedrdn-v":
        average = everyone.mean(axis=0)
        return Normalizer(average[None], average, device=device)
    raise ValueError(f"no client statistics are used with --aug {aug}")


class NormalizedData(Protocol):
    """What input normalization needs of a client's data (:class:`mpifl.client.client_data.ClientData`): its
    own training images in chunks, and the place its normalizer goes."""

    normalizer: Normalizer

    def own_chunks(self, rng: np.random.Generator | None = None) -> Iterable[torch.Tensor]: ...


class InputNormalization:
    """``--aug`` on one rank: the normalizer of each client it hosts, and FedRDN's statistics as a one-time
    exchange (the interface of :class:`~mpifl.transport.exchange.OneTimeExchange`, as a method's own).

    A client host :meth:`attach` es its clients' data: their own statistics are computed then (from the
    training images, a held-out domain's too, through ``--train-transforms`` under ``--aug-stats
    augmented``), and their normalizers are installed then, or, when
    the statistics are exchanged, as soon as every training client's have arrived.  The server attaches
    nothing and only takes part in the exchange.
    """

    def __init__(self, aug: str, draw: str, channels: int, stats: str = "augmented", seed: int = 0):
        self.aug, self.draw, self.channels, self.stats, self.seed = aug, draw, channels, stats, seed
        self._own: dict[int, np.ndarray] = {}  # (2, C) per attached client
        self._data: dict[int, NormalizedData] = {}
        self._device = None

    def attach(self, specs: list[ClientSpec], data: dict[int, NormalizedData], device) -> None:
        if self.aug == "none":
            return  # the dataset's normalization, installed with the data
        self._data, self._device = data, device
        self._own = {s.id: channel_stats(data[s.id].own_chunks(
            statistics_rng(self.seed, s.id) if self.stats == "augmented" else None), self.channels).numpy()
            for s in specs}
        if self.setup_exchange() is None:
            self._install(None)

    def setup_exchange(self) -> TensorSpec | None:
        return stats_spec(self.channels) if self.aug in EXCHANGED else None

    def setup_contribution(self, client, data) -> torch.Tensor:
        return torch.as_tensor(self._own[client.id])

    def setup_received(self, everyone: torch.Tensor) -> None:
        self._install(everyone.cpu().numpy())

    def _install(self, everyone: np.ndarray | None) -> None:
        for cid, own in self._own.items():
            self._data[cid].normalizer = make_normalizer(self.aug, own, everyone, self.draw, self._device)
