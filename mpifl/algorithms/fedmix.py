"""FedMix (Yoon, Shin, Hwang & Yang, "FedMix: Approximation of Mixup under Mean Augmented Federated
Learning", ICLR 2021).

Mean Augmented FL (section 3): clients share *averaged* data once, and each
client trains on a first-order approximation of Mixup between its own
samples and the other clients' data, computed from those averages only.

* **Setup exchange** (once, before round 1; :meth:`Algorithm.setup_exchange`):
  every training client contributes ``fedmix.means`` (M x (P + K)): M mean
  images, each the mean of ``--fedmix-batch`` (b) of its training images
  (model inputs, i.e. normalized as the client normalizes its evaluation
  inputs; with ``--aug fedrdn`` its own statistics) flattened to P = C H W,
  followed by their mean one-hot label (K soft label entries).  The images
  of a client are taken in a seeded random order (``client_rng(seed, id,
  0)``) and cut into consecutive groups of b; a client with fewer than M b
  training images goes around that order again, so some images then count
  twice.  The paper averages the whole local set in groups; the row shape
  here must be the same for every client, hence the fixed M
  (``--fedmix-means``, default 64).  Every rank receives every client's rows.
* **Local objective** (the FedMix loss, section 3 of the paper): for a sample (x, y),
  a mean image and label (x_bar, y_bar) drawn uniformly from all clients'
  rows (one per sample, with torch's generator; the Flower baseline draws
  one per mini-batch; the client's own rows are included, as in that
  baseline's ``random.choice`` over all mean data), and
  ``lambda`` = ``--fedmix-lambda``::

      (1 - lambda) CE(f((1 - lambda) x), y) + lambda CE(f((1 - lambda) x), y_bar)
          + lambda <d/dx [(1 - lambda) CE(f(x), y)] at x = (1 - lambda) x,  x_bar>

  the first-order Taylor expansion of the global-Mixup loss
  ``CE(f((1 - lambda) x + lambda x_j), (1 - lambda) y + lambda y_j)`` around
  ``(1 - lambda) x``, averaged over the other client's samples j (their mean
  x_bar, y_bar), keeping the y-part's derivative term (the y_j part's
  derivative is second order in lambda and dropped).  The input gradient
  is taken with ``create_graph`` so the term trains the network (double
  back-propagation).  Its scale (``--fedmix-taylor``): ``sample`` (default)
  differentiates the sum of the per-sample losses, each sample's own
  derivative (up to the coupling batch normalization adds) as the paper's
  per-sample loss writes it; ``batch`` differentiates the batch-mean loss,
  which scales the term by 1/B (the Flower baseline).  No public code of the
  authors was found, so which one produced the paper's numbers is unknown;
  the default is the paper's equation.  Each term is averaged over the
  mini-batch.
* **Everything else is FedAvg**: whole model averaged (BN step counters
  excepted) with sample-count weights (``--uniform-weights``); the global
  model is evaluated.
* With ``--guide-lambda`` (:mod:`mpifl.algorithms.core.guide`) the guiding term
  lambda_g CE(h_g(g((1 - lambda) x)), y) is added: it reads the features of
  the input the network is run on, with the hard labels.

Hyperparameters: b = 5 and lambda = 0.1, FedRDN's appendix A.2 ("We
adopted the reported configuration from the original paper.  The batch size
is set to 5 and lambda is set to 0.1").  With lambda = 0 the loss is
FedAvg's cross-entropy.  Implementation consulted: the Flower baseline
(``adap/flower``, ``baselines/fedmix``); the row shape needs the image size,
which :meth:`FedMix.setup_exchange` reads from the dataset's manifest
(``--data-root``/``--data``), as every rank has it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..data import DatasetManifest
from ..errors import MpiflError
from ..plan.config import Option
from ..plan.seeding import client_rng
from ..transport.wire import TensorSpec
from .fedavg import FedAvg

MEANS = "fedmix.means"
TAYLOR_SCALES = ("sample", "batch")


def mean_rows(batches, size: int, groups: int, per_group: int, num_classes: int,
              order: torch.Tensor) -> torch.Tensor:
    """(groups, P + K): means of consecutive groups of ``per_group`` images of ``order`` (a permutation of
    the ``size`` images that ``batches`` yields in order), cycling through ``order`` when it is too short."""
    positions = torch.empty(size, dtype=torch.long)
    positions[order] = torch.arange(size)
    acc = None
    start = 0
    needed = groups * per_group
    for x, y in batches:
        n = len(y)
        if acc is None:
            acc = torch.zeros(groups, x[0].numel() + num_classes, dtype=torch.float64, device=x.device)
        rows = torch.cat([x.reshape(n, -1).double(), F.one_hot(y, num_classes).double()], 1)
        pos = positions[start:start + n].to(x.device)
        for lap in range(math.ceil(needed / size)):
            slot = pos + lap * size
            keep = slot < needed
            acc.index_add_(0, slot[keep] // per_group, rows[keep])
        start += n
    if acc is None or start != size:
        raise MpiflError(f"FedMix: expected {size} training images, read {start}")
    return (acc / per_group).float()


class FedMix(FedAvg):
    name = "fedmix"
    summary = "FedMix: FedAvg with the Taylor-approximated Mixup against other clients' shared mean images"
    classification_only = "mixes images with other clients' mean images and their mean one-hot labels"
    options = FedAvg.options + (
        Option("fedmix_lambda", float, 0.1, "FedMix: mixing weight lambda", minimum=0, maximum=1, below=True),
        Option("fedmix_batch", int, 5, "FedMix: number of local images averaged into one shared mean image",
               minimum=1),
        Option("fedmix_means", int, 64, "FedMix: number of mean images each client shares", minimum=1),
        Option("fedmix_taylor", str, "sample", "FedMix: input gradient of the Taylor term from the sum of "
               "per-sample losses (sample, paper) or the batch mean (batch, 1/B)", choices=TAYLOR_SCALES),
    )

    def __init__(self, cfg, entries):
        super().__init__(cfg, entries)
        self._spec: TensorSpec | None = None
        self._images = self._labels = None

    # ------------------------------------------------------- one-time exchange
    def setup_exchange(self):
        if self._spec is None:
            manifest = DatasetManifest.load(self.cfg.data_root, self.cfg.data)
            self.num_classes = manifest.num_classes
            self.image_shape = (manifest.channels, *manifest.image_size)
            width = math.prod(self.image_shape) + self.num_classes
            self._spec = TensorSpec(MEANS, (self.cfg.opt("fedmix_means"), width), torch.float32,
                                    derived="mean images of the client's training images and their mean labels",
                                    exposes="images or spectra")
        return self._spec

    def setup_contribution(self, client, data):
        size = data.size("train")
        order = torch.from_numpy(client_rng(self.cfg.seed, client.id, 0).permutation(size))
        return mean_rows(data.eval_batches("train", self.cfg.eval_batch_size), size, self.cfg.opt("fedmix_means"),
                         self.cfg.opt("fedmix_batch"), self.num_classes, order)

    def setup_received(self, everyone):
        rows = everyone.reshape(-1, everyone.shape[-1])
        pixels = math.prod(self.image_shape)
        self._images = rows[:, :pixels].reshape(-1, *self.image_shape).contiguous()
        self._labels = rows[:, pixels:].contiguous()

    # ------------------------------------------------------------------ client
    def fedmix_loss(self, model, x, y, x_bar, y_bar, client=None):
        """(the FedMix loss plus :meth:`extra_loss` of the features of ``(1 - lambda) x`` (the guiding
        regularizer's), logits of f((1 - lambda) x)) for given mean images and labels per sample."""
        lam = self.cfg.opt("fedmix_lambda")
        scaled = ((1 - lam) * x).detach().requires_grad_(True)
        features = model.encode(scaled)
        logits = model.classifier(features)
        if lam == 0:  # FedAvg's loss, to the bit (a mean of per-sample terms sums in another order)
            return self.plus_extra(F.cross_entropy(logits, y), client, model, features, logits, y), logits
        ce = F.cross_entropy(logits, y, reduction="none")
        soft = -(y_bar * F.log_softmax(logits, 1)).sum(1)
        total = ce.sum() if self.cfg.opt("fedmix_taylor") == "sample" else ce.mean()
        (grad,) = torch.autograd.grad((1 - lam) * total, scaled, create_graph=True)
        taylor = (grad * x_bar).flatten(1).sum(1)
        loss = ((1 - lam) * ce + lam * soft + lam * taylor).mean()
        return self.plus_extra(loss, client, model, features, logits, y), logits

    def batch_loss(self, client, model, x, y):
        pick = torch.randint(len(self._images), (len(y),)).to(x.device)
        return self.fedmix_loss(model, x, y, self._images[pick], self._labels[pick], client)
