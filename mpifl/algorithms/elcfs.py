"""ELCFS (Liu, Chen, Qin, Dou & Heng, "FedDG: Federated Domain Generalization on Medical Image Segmentation
via Episodic Learning in Continuous Frequency Space", CVPR 2021): FedAvg whose clients train episodically
on their own images and on those images carrying other clients' amplitude spectra.

* **Setup exchange** (once, before round 1; :meth:`Algorithm.setup_exchange`): every training client
  contributes ``elcfs.amplitudes`` (N x C x H x (W // 2 + 1)), the amplitude spectra ``|F(p)|`` (2-D DFT
  per channel) of N of its training images, in pixel values 0-255 as the authors' code computes them on
  the stored images (no ``--train-transforms``).  The amplitude of a real image is symmetric,
  ``|F(p)|(-u, -v) = |F(p)|(u, v)``, so the half spectrum of ``torch.fft.rfft2`` holds all of it and only
  that half travels.  The authors' loader keeps a random eighth of each client's spectra; the exchange
  needs one shape for every client, so N = ``--elcfs-bank`` (default 0: an eighth of the smallest
  training client's training images, at least 1), taken in a seeded random order of the client's images
  (``client_rng(seed, id, 0)``).  Every rank receives every client's spectra.
* **Continuous frequency-space interpolation** (sec. 3.2): for a local image p with spectrum
  ``A e^{i P}`` and an amplitude ``A_n`` of another client n::

      A' = ((1 - lambda) A + lambda A_n) M + A (1 - M),     p' = clip(Re F^-1(A' e^{i P}), 0, 255)

  M is the low-frequency band: the (2b + 1) x (2b + 1) square of frequencies around the centre of the
  shifted spectrum, b = floor(min(H, W) r), r = ``--elcfs-band`` (default 0, the authors' training code:
  b = 0, the zero frequency alone; their demonstration's 0.003 also gives b = 0 below 334 pixels).  The
  phase P is kept.  Per image, as the code, the other client is drawn uniformly among the *other*
  training clients (here clients, so a client of the same domain counts as another), then one of its
  amplitudes uniformly (torch's generator, seeded per client and round); the code draws two such
  images and trains on the first, so one is drawn here.  lambda (``--elcfs-lambda``): ``one``
  (default), the authors' training code (``low_freq_mutate_np``), which replaces the band by the other
  client's amplitude; ``uniform``, lambda drawn uniformly in [0, 1] per image, a continuous stand-in for
  the paper's interpolation (sec. 3.2).  What was checked is the authors' code only: its commented-out
  interpolation line draws ``ratio = random.randint(1, 10) / 10`` (Python's ``random``, not
  ``np.random.uniform``) and keeps ``ratio`` of the own amplitude, i.e. lambda = 1 - ratio in
  {0, 0.1, ..., 0.9}; its demonstration script steps lambda through 0.2, 0.4, ..., 1.0.  How the paper's
  text draws lambda was not checked (its text was not at hand).
* **Which images**: the model receives normalized inputs x = a p + c (per channel,
  :mod:`mpifl.plan.normalize`); the code transforms raw pixels and clips them to [0, 255], so each
  mini-batch is mapped back to pixels with the client's own normalization, transformed, clipped and
  normalized again.  ``--aug fedrdn`` draws another normalization per mini-batch, which cannot be undone
  from the batch, and is refused.
* **Episodic meta-learning** (sec. 3.3): with the run's task loss L (:mod:`mpifl.plan.task`: cross-entropy
  on a classification task; on a segmentation task the run's ``--seg-loss``, shared by every method of a
  comparison: by default the softmax Dice over all classes, background included), inner lr beta =
  ``--elcfs-inner-lr`` (1e-3, the code's ``meta_step_size``) and the code's clamp of every inner gradient
  to [-g_max, g_max], g_max = ``--elcfs-clip`` (100, its ``clip_value``)::

      theta' = theta - beta clamp(grad L(x; theta), -g_max, g_max)
      objective = L(x; theta) + L(x'; theta')

  ``--elcfs-order first`` (default): the inner gradient is a constant, as the code takes it without
  ``create_graph``, so d theta' / d theta = I; ``second``: differentiated through (``create_graph``), the
  full derivative of the paper's objective.  Only the parameters that train take the inner step.  Both
  forward passes run in training mode, so batch-norm running statistics are updated by both.
* **Boundary-oriented episodic loss** (sec. 3.4), on a segmentation task only (a classification label has
  no mask, hence no boundary): the meta-test objective adds gamma L_boundary
  (:mod:`mpifl.algorithms.core.boundary`: NT-Xent of contour against background-band embeddings of the
  meta-train and meta-test features), gamma = ``--elcfs-boundary-weight`` (0.1, the code's), temperature
  ``--elcfs-temperature`` (0.05, the code's).
* **The authors' loss** (``--seg-loss sigmoid-dice``): their code (``utils/losses.py`` ``dice_loss``,
  ``networks/unet2d.py``) trains both terms with a soft Dice of sigmoid outputs over the foreground channels
  only (no background channel, smoothing 1e-5, the batch summed per channel, the channels averaged, no CE) and
  predicts a pixel above 0.75 (:mod:`mpifl.plan.segmentation`).  ``--seg-loss`` is one run option, not
  ELCFS's, because every method of a comparison trains with the one loss; no preset runs ELCFS on a
  segmentation table (its gPerXAN rows are classification), so none sets it: pass it to run ELCFS as its
  authors ran it, and give every compared method the same flag.
* **Everything else is FedAvg** (the code's weighted average of the whole model); the global model is
  evaluated.  The paper's optimizer (Adam, lr 1e-3) is ``--optimizer``/``--lr``'s business.
"""

from __future__ import annotations

import math

import torch
from torch.func import functional_call

from ..data import DatasetManifest
from ..errors import MpiflError
from ..plan.config import Option
from ..plan.seeding import client_rng
from ..transport.wire import TensorSpec
from .core.boundary import boundary_loss
from .fedavg import FedAvg

AMPLITUDES = "elcfs.amplitudes"
LAMBDAS = ("one", "uniform")
ORDERS = ("first", "second")
CODE_BANK_FRACTION = 8  # the authors' loader keeps len(spectra) / 8 of each client's spectra
PIXEL_MAX = 255.0


def band_mask(height: int, width: int, ratio: float, device=None) -> torch.Tensor:
    """(H, W // 2 + 1) bool, rfft2 layout: frequencies (u, v) with |u|, |v| <= b = floor(min(H, W) ratio),
    u, v taken in (-H/2, H/2] and (-W/2, W/2] (the square of side 2b + 1 around the shifted centre)."""
    b = math.floor(min(height, width) * ratio)
    rows = torch.arange(height, device=device)
    rows = torch.minimum(rows, height - rows)
    cols = torch.arange(width // 2 + 1, device=device)
    return (rows[:, None] <= b) & (cols[None, :] <= b)


def amplitude_spectra(pixels: torch.Tensor) -> torch.Tensor:
    """(N, C, H, W // 2 + 1): |rfft2| per channel of (N, C, H, W) images."""
    return torch.fft.rfft2(pixels.double()).abs().float()


def spectra_of(chunks, chosen: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """``shape`` = (len(chosen), ...): the amplitude spectra of the images at positions ``chosen`` of the
    images ``chunks`` yields in order, row i that of image ``chosen[i]``."""
    out = torch.zeros(shape, dtype=torch.float32)
    start, found = 0, 0
    for pixels in chunks:
        inside = ((chosen >= start) & (chosen < start + len(pixels))).nonzero().flatten()
        if len(inside):
            local = (chosen[inside] - start).to(pixels.device)
            out[inside] = amplitude_spectra(pixels[local]).cpu()
            found += len(inside)
        start += len(pixels)
    if found != len(chosen):
        raise MpiflError(f"ELCFS: {len(chosen) - found} chosen training images were not read (read {start})")
    return out


def interpolate_amplitude(pixels: torch.Tensor, target: torch.Tensor, lam: torch.Tensor,
                          mask: torch.Tensor) -> torch.Tensor:
    """Images (N, C, H, W) whose band ``mask`` of the amplitude is (1 - lam) own + lam ``target``
    ((N, C, H, W // 2 + 1) amplitudes), own phase, clipped to [0, 255]; ``lam``: (N,)."""
    spectrum = torch.fft.rfft2(pixels.double())
    own = spectrum.abs()
    lam = lam.double().reshape(-1, 1, 1, 1)
    mixed = torch.where(mask, (1 - lam) * own + lam * target.double(), own)
    image = torch.fft.irfft2(torch.polar(mixed, spectrum.angle()), s=pixels.shape[-2:])
    return image.clamp(0, PIXEL_MAX).to(pixels.dtype)


def other_client(own: int, count: int, draws: int) -> torch.Tensor:
    """(draws,) rows in [0, count) other than ``own``, uniform (torch's generator)."""
    pick = torch.randint(count - 1, (draws,))
    return pick + (pick >= own).long()


class ELCFS(FedAvg):
    name = "elcfs"
    summary = ("ELCFS (FedDG): FedAvg; amplitude spectra shared once, episodic meta-learning on images carrying "
               "other clients' low-frequency amplitudes")
    options = FedAvg.options + (
        Option("elcfs_bank", int, 0, "ELCFS: amplitude spectra each client shares (0: an eighth of the smallest "
               "training client's images, as the authors' code keeps an eighth)", minimum=0),
        Option("elcfs_band", float, 0.0, "ELCFS: low-frequency band ratio r, b = floor(min(H, W) r) (0: the "
               "zero frequency alone, authors' code)", minimum=0, maximum=0.5),
        Option("elcfs_lambda", str, "one", "ELCFS: interpolation weight: one (the band becomes the other "
               "client's, authors' code) or uniform (U[0, 1] per image, a continuous interpolation; the authors' "
               "commented-out line draws lambda in {0, 0.1, ..., 0.9}; the paper's draw unchecked)", choices=LAMBDAS),
        Option("elcfs_inner_lr", float, 1e-3, "ELCFS: inner (meta-train) step size beta", minimum=0),
        Option("elcfs_clip", float, 100.0, "ELCFS: clamp of every inner gradient to [-clip, clip]",
               minimum=0, above=True),
        Option("elcfs_order", str, "first", "ELCFS: meta-gradient: first (inner gradient a constant, authors' "
               "code) or second (through the inner step)", choices=ORDERS),
        Option("elcfs_boundary_weight", float, 0.1, "ELCFS: weight gamma of the boundary-oriented loss on a "
               "segmentation task (authors' code: 0.1; 0: off)", minimum=0),
        Option("elcfs_temperature", float, 0.05, "ELCFS: temperature of the boundary-oriented NT-Xent loss",
               minimum=0, above=True),
    )

    def __init__(self, cfg, entries):
        super().__init__(cfg, entries)
        if cfg.aug == "fedrdn":
            raise MpiflError("--aug fedrdn draws a normalization per mini-batch, which ELCFS cannot undo to reach the "
                             "pixels; use another --aug")
        self.bank_size = cfg.opt("elcfs_bank")
        self._spec: TensorSpec | None = None
        self._amplitudes: torch.Tensor | None = None  # (N_train, N, C, H, W // 2 + 1)
        self._pixel_affine: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # client -> its (scale, shift)

    def bind_clients(self, clients):
        super().bind_clients(clients)
        trainers = [c for c in clients if c.trains]
        if len(trainers) < 2:
            raise MpiflError("elcfs interpolates with the amplitude spectra of *other* clients; it needs at least "
                             "2 training clients (--clients-per-domain, --num-clients)")
        smallest = min(trainers, key=lambda c: c.num_train)
        if not self.cfg.opt("elcfs_bank"):
            self.bank_size = max(1, smallest.num_train // CODE_BANK_FRACTION)
        elif self.bank_size > smallest.num_train:
            raise MpiflError(f"--elcfs-bank {self.bank_size} exceeds client {smallest.id}'s {smallest.num_train} "
                             "training images; lower it (0: an eighth of the smallest client)")

    # ------------------------------------------------------- one-time exchange
    def setup_exchange(self):
        if self._spec is None:
            manifest = DatasetManifest.load(self.cfg.data_root, self.cfg.data)
            height, width = manifest.image_size
            self._spec = TensorSpec(AMPLITUDES, (self.bank_size, manifest.channels, height, width // 2 + 1),
                                    torch.float32, derived="amplitude spectra of the client's training images",
                                    exposes="images or spectra")
        return self._spec

    def setup_contribution(self, client, data):
        """N amplitude spectra of the client's stored training images, in a seeded order; records the
        client's normalization (its evaluation one, which is also its training one unless ``--aug fedrdn``)."""
        self._pixel_affine[client.id] = data.normalizer.eval()
        split, size = data.own
        chosen = torch.from_numpy(client_rng(self.cfg.seed, client.id, 0).permutation(size)[:self.bank_size])
        return spectra_of(data.pixel_chunks(split), chosen, self._spec.shape)

    def setup_received(self, everyone):
        self._amplitudes = everyone

    # ------------------------------------------------------------------ client
    def interpolated_inputs(self, client_id: int, x: torch.Tensor) -> torch.Tensor:
        """The mini-batch's model inputs with other clients' low-frequency amplitudes (module docstring)."""
        scale, shift = self._pixel_affine[client_id]
        pixels = (x.float() - shift) / scale
        count, bank = self._amplitudes.shape[:2]
        rows = other_client(self.training_ids.index(client_id), count, len(x))
        picks = torch.randint(bank, (len(x),))
        lam = torch.ones(len(x)) if self.cfg.opt("elcfs_lambda") == "one" else torch.rand(len(x))
        target = self._amplitudes[rows.to(self._amplitudes.device), picks.to(self._amplitudes.device)]
        mask = band_mask(*x.shape[-2:], self.cfg.opt("elcfs_band"), device=x.device)
        moved = interpolate_amplitude(pixels, target.to(x.device), lam.to(x.device), mask)
        return torch.addcmul(shift, moved, scale).to(x.dtype)

    def task_loss(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The run's task loss (:mod:`mpifl.plan.task`): cross-entropy, or Dice on a segmentation task."""
        return self.task.loss(logits, y)

    def meta_test_loss(self, model, weights: dict[str, torch.Tensor], x_moved: torch.Tensor, y: torch.Tensor,
                       features: torch.Tensor) -> torch.Tensor:
        """L_out on the interpolated images with the adapted weights; on a segmentation task plus gamma
        L_boundary of the meta-train ``features`` and the meta-test ones (:mod:`mpifl.algorithms.core.boundary`)."""
        moved = []
        hook = model.classifier.register_forward_hook(lambda module, inputs, output: moved.append(inputs[0]))
        try:
            logits = functional_call(model, weights, (x_moved,))
        finally:
            hook.remove()
        loss = self.task_loss(logits, y)
        gamma = self.cfg.opt("elcfs_boundary_weight")
        if self.task.name == "segmentation" and gamma:
            loss = loss + gamma * boundary_loss(features, moved[0], y, self.task.classes(logits),
                                                self.cfg.opt("elcfs_temperature"))
        return loss

    def episodic_loss(self, client, model, x: torch.Tensor, x_moved: torch.Tensor,
                      y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(L(x; theta) + L_out(x'; theta'), logits of x) with theta' one clamped inner step from theta; with
        ``--guide-lambda`` the guiding term of the meta-train features is added to the total (not to the
        inner step's loss), as gPerXAN's ablation adds it to ELCFS's local loss."""
        features = model.encode(x)
        logits = model.classifier(features)
        inner = self.task_loss(logits, y)
        params = {k: p for k, p in model.named_parameters() if p.requires_grad}
        grads = torch.autograd.grad(inner, list(params.values()), retain_graph=True,
                                    create_graph=self.cfg.opt("elcfs_order") == "second")
        beta, g_max = self.cfg.opt("elcfs_inner_lr"), self.cfg.opt("elcfs_clip")
        adapted = {k: p - beta * g.clamp(-g_max, g_max) for (k, p), g in zip(params.items(), grads)}
        total = inner + self.meta_test_loss(model, adapted, x_moved, y, features)
        return self.plus_extra(total, client, model, features, logits, y), logits

    def batch_loss(self, client, model, x, y):
        return self.episodic_loss(client, model, x, self.interpolated_inputs(client.id, x), y)
