"""CCST (Chen, Jiang, Wang, Dou & Zhang, "Federated Domain Generalization for Image Recognition via
Cross-Client Style Transfer", WACV 2023): FedAvg on training sets augmented with the other clients' styles.

Following the authors' code (``JeremyCJM/CCST``), which produced the paper's numbers:

* **Styles** (:class:`~mpifl.models.adain.StyleModel`'s encoder, VGG-19 to relu4_1, on the client's stored
  training images in [0, 1], no augmentation), shared once through the one-time exchange
  (``ccst.styles``, every rank receives every training client's):

  - ``--ccst-style overall`` (default; the README's main runs): the domain's style, (2, 512), the channel
    mean and std of the features over every position of every training image,
    ``mu = E[f]``, ``sigma = sqrt(E[f^2] - mu^2 + 1e-5)`` (the code's ``mean_std_computation_effcientMem``);
  - ``--ccst-style single``: single-image styles, (J, 2, 512), the same statistics over one image's
    positions, of J training images in a seeded random order (``setup_rng(seed, id, 0)``).  The code
    draws a style image from the whole training list of the style domain; the exchange needs one shape for
    every client, so J = ``--ccst-styles`` (default 0: the smallest training client's training images, all
    of that client's).

* **Augmented training set**, built once after the exchange (:meth:`Algorithm.training_data`), as the code's
  ``data_list_generator`` lists it: for every training image, K different training clients drawn uniformly
  (``setup_rng(seed, id, 1)``); the client itself contributes the image as it is, every other one the image
  in its style (``--ccst-style single``: one of its J styles drawn uniformly per image; the code draws one
  per stylization batch).  The set has K n images, which a local epoch passes once.  K = ``--ccst-k``
  (default 0: every training client, the code's K = 3 on PACS and Office-Home and K = 4 on Camelyon17, one
  source client fewer than domains), at most the number of training clients.  A stylized image is the
  decoder's output of AdaIN (``--ccst-alpha``, default 1 as the code: alpha AdaIN(f) + (1 - alpha) f)
  clipped to [0, 1] and rounded to 8 bits, as the code's ``save_image`` writes it; the code stylizes at
  512 px and trains at 222 px, here both happen at the dataset's stored size.  The stylized copies stay
  resident on the client's device: K n images of the stored size, uint8.

* **Everything else is FedAvg** (the code averages the whole model with equal weights: ``--uniform-weights``);
  the global model is evaluated.  With ``--guide-lambda`` it is Fig. 2's CCST + guide of gPerXAN.

* **Validation differs** (model selection, not reproduced): the code splits each source client's *augmented*
  training list 90/10 (``--val_size 0.1`` in ``fed_run.py``, ``get_train_dataloader`` of ``data/data_helper.py``),
  so it validates on augmented images whose other versions (the same image in other styles) it trains on;
  here a client validates on its own val split, unstylized.

The AdaIN weights are never downloaded: ``--style-model DIR`` names a folder holding ``vgg_normalised.pth``
and ``decoder.pth`` (:func:`~mpifl.models.adain.load_style_model`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..data import DatasetManifest
from ..errors import MpiflError
from ..models.adain import DECODER_FILE, ENCODER_FILE, EPS, FEATURES, StyleModel, load_style_model
from ..plan.config import Option
from ..plan.seeding import setup_rng
from ..transport.wire import TensorSpec
from .fedavg import FedAvg

STYLES = "ccst.styles"
KINDS = ("overall", "single")
BATCH = 32  # images through the style network at a time
BANK, CHOICES = 0, 1  # setup_rng purposes: the single-image styles shared, the augmentation's draws


def feature_moments(model: StyleModel, chunks) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(per-image sums of f, per-image sums of f^2, positions per image) over the encoder's features of the
    uint8 images ``chunks`` yields, float64: (N, 512), (N, 512), int."""
    sums, squares, positions = [], [], 0
    for pixels in chunks:
        for start in range(0, len(pixels), BATCH):
            with torch.no_grad():
                features = model.encoder(pixels[start:start + BATCH].float() / 255).flatten(2).double()
            sums.append(features.sum(2).cpu())
            squares.append(features.square().sum(2).cpu())
            positions = features.shape[2]
    return torch.cat(sums), torch.cat(squares), positions


def mean_std(sums: torch.Tensor, squares: torch.Tensor, count: int) -> torch.Tensor:
    """(..., 2, 512): mean and sqrt(biased variance + 1e-5) from sums of f and f^2 over ``count`` values."""
    mean = sums / count
    return torch.stack([mean, (squares / count - mean.square() + EPS).sqrt()], -2).float()


def overall_style(sums: torch.Tensor, squares: torch.Tensor, positions: int) -> torch.Tensor:
    """(2, 512): the domain's style, over every position of every image."""
    return mean_std(sums.sum(0), squares.sum(0), positions * len(sums))


def augmentation_plan(rng: np.random.Generator, images: int, clients: int, k: int, own: int,
                      bank: int) -> tuple[np.ndarray, np.ndarray]:
    """(client, style) of each of an image's K versions, (images, K) each: K different clients uniformly per
    image (``own``: the image itself, style -1), and for another client one of its ``bank`` styles."""
    chosen = np.argsort(rng.random((images, clients)), axis=1)[:, :k]
    styles = rng.integers(bank, size=(images, k))
    return chosen, np.where(chosen == own, -1, styles)


def to_pixels(images: torch.Tensor) -> torch.Tensor:
    """[0, 1] images to uint8 as ``torchvision.utils.save_image`` rounds them."""
    return (images * 255 + 0.5).clamp(0, 255).to(torch.uint8)


class CCST(FedAvg):
    name = "ccst"
    summary = ("CCST: FedAvg on training sets augmented by AdaIN with the other clients' feature styles, "
               "shared once")
    options = FedAvg.options + (
        Option("style_model", str, "", "CCST: folder with the AdaIN encoder and decoder, vgg_normalised.pth and "
               "decoder.pth (never downloaded; required)"),
        Option("ccst_style", str, "overall", "CCST: the styles shared: overall (each domain's, default) or single "
               "(single images')", choices=KINDS),
        Option("ccst_k", int, 0, "CCST: augmentation level K, the versions of each training image (0: one per "
               "training client, authors' runs)", minimum=0),
        Option("ccst_styles", int, 0, "CCST: single-image styles each client shares (0: the smallest training "
               "client's image count)", minimum=0),
        Option("ccst_alpha", float, 1.0, "CCST: AdaIN's stylization weight alpha in [0, 1]", minimum=0, maximum=1),
    )

    def __init__(self, cfg, entries):
        super().__init__(cfg, entries)
        folder = cfg.opt("style_model")
        problems = [
            (folder, "ccst stylizes with the AdaIN network, whose weights cannot be downloaded here: give "
             f"--style-model DIR, a folder holding {ENCODER_FILE} and {DECODER_FILE}"),
            (not folder or all((Path(folder) / f).is_file() for f in (ENCODER_FILE, DECODER_FILE)),
             f"--style-model {folder}: {ENCODER_FILE} and {DECODER_FILE} must both be in that folder")]
        for ok, message in problems:
            if not ok:
                raise MpiflError(message)
        self.k = cfg.opt("ccst_k")
        self.bank = 1
        self._model = load_style_model(folder, "cpu")  # at set-up: files that are not the AdaIN weights are refused
        self._styles: torch.Tensor | None = None  # (N_train, J, 2, 512)

    def bind_clients(self, clients):
        super().bind_clients(clients)
        trainers = [c for c in clients if c.trains]
        if len(trainers) < 2:
            raise MpiflError("ccst transfers the styles of *other* clients; it needs at least 2 training clients")
        self.k = self.k or len(trainers)
        if self.k > len(trainers):
            raise MpiflError(f"--ccst-k {self.k} exceeds the {len(trainers)} training clients, whose styles are "
                             f"the versions of an image; use at most {len(trainers)} (0: all)")
        if self.cfg.opt("ccst_style") == "single":
            smallest = min(trainers, key=lambda c: c.num_train)
            self.bank = self.cfg.opt("ccst_styles") or smallest.num_train
            if self.bank > smallest.num_train:
                raise MpiflError(f"--ccst-styles {self.bank} exceeds client {smallest.id}'s {smallest.num_train} "
                                 "training images; lower it (0: the smallest client's count)")

    def _style_model(self, device) -> StyleModel:
        return self._model.to(device)

    # ------------------------------------------------------- one-time exchange
    def setup_exchange(self):
        channels = DatasetManifest.load(self.cfg.data_root, self.cfg.data).channels
        if channels != 3:
            raise MpiflError(f"ccst's style network takes RGB images; {self.cfg.data}'s have {channels} channel(s)")
        shape = (2, FEATURES) if self.cfg.opt("ccst_style") == "overall" else (self.bank, 2, FEATURES)
        return TensorSpec(STYLES, shape, torch.float32,
                          derived="styles (VGG relu4_1 channel mean and std) of the client's training images",
                          exposes="data statistics")

    def setup_contribution(self, client, data):
        """The client's overall style, or J single-image styles of its training images in a seeded order."""
        sums, squares, positions = feature_moments(self._style_model(data.labels["train"].device), data.own_chunks())
        if self.cfg.opt("ccst_style") == "overall":
            return overall_style(sums, squares, positions)
        chosen = torch.from_numpy(setup_rng(self.cfg.seed, client.id, BANK).permutation(len(sums))[:self.bank])
        return mean_std(sums[chosen], squares[chosen], positions)

    def setup_received(self, everyone):
        self._styles = everyone.reshape(len(everyone), -1, 2, FEATURES)

    def training_data(self, clients, data):
        """Each training client's K n images (module docstring); the style network is released afterwards."""
        out = {cid: self.augmented(clients[cid], data[cid]) for cid in data}
        self._model = None
        return out

    def augmented(self, client, data):
        if data.streamed:
            raise MpiflError(f"ccst keeps K = {self.k} versions of each training image resident, but client "
                             f"{client.id}'s images stream from disk; raise --stream-above (GiB) above its data's size")
        own = self.training_ids.index(client.id)
        pixels = torch.cat(list(data.own_chunks()))
        labels = data.labels["train"][:len(pixels)]
        chosen, styles = augmentation_plan(setup_rng(self.cfg.seed, client.id, CHOICES), len(pixels),
                                           len(self.training_ids), self.k, own, self._styles.shape[1])
        out = pixels.repeat_interleave(self.k, 0)  # row i K + j: image i's j-th version
        chosen, styles = chosen.reshape(-1), styles.reshape(-1)
        moved = np.flatnonzero(chosen != own)
        model, bank = self._style_model(pixels.device), self._styles.to(pixels.device)
        for start in range(0, len(moved), BATCH):
            rows = moved[start:start + BATCH]
            style = bank[torch.from_numpy(chosen[rows]), torch.from_numpy(styles[rows])]
            index = torch.from_numpy(rows).to(pixels.device)
            out[index] = to_pixels(model.stylize(out[index].float() / 255, style[:, 0], style[:, 1],
                                                 self.cfg.opt("ccst_alpha")))
        return data.with_train(out, labels.repeat_interleave(self.k, 0))
