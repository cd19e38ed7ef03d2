"""FedWon (Zhuang & Lyu, ICLR 2024): federated learning without normalization.

Section 3 of the paper: every normalization layer is removed (``norm="none"``)
and every convolution is reparameterized with scaled weight standardization,
eq. (3), in the form of its Listing 1 (``conv="ws"``,
:class:`~mpifl.models.wsconv.WSConv2d`: gain per output channel, eps 1e-4,
fan-in scaling, xavier-normal init; no public code exists).  Fully connected
layers stay plain.  Client training and server aggregation follow FedAvg
(appendix A.3): every model entry goes down and comes back, the server takes
the weighted mean (sample count, or ``--uniform-weights`` as FedBN's code, on
which FedWon's multi-domain experiments are built), and the *global* model is
evaluated, on the seen and on a held-out domain alike.  Nothing stays on the
client, so cross-device runs (``--clients-per-domain K --fraction C``) need no
client state, and with no batch statistics any ``--batch-size``, 1 included,
trains.

Adaptive gradient clipping, eq. (4) (appendix A.3, after NF-Nets): between
``backward()`` and ``step()`` each output row ``G_i`` of a layer's gradient is
rescaled to ``lambda * max(||W_i||_F, 1e-3) / ||G_i||_F * G_i`` when
``||G_i||_F / max(||W_i||_F, 1e-3) > lambda``
(:func:`~mpifl.models.agc.adaptive_clip_`, which states the NF-Nets unit rule
for biases and WSConv gains).  The final classifier (``model.classifier``) is
not clipped, as in NF-Nets (Brock et al., 2021b), which FedWon follows.  The clipped gradient is
what plain SGD (``--momentum``, ``--weight-decay`` as given) then applies.  Under record-level DP-SGD
(``--dpsgd-clip``, :mod:`mpifl.privacy.dp_sgd`) AGC clips the privatized gradient (each record's clipped to C,
summed, noised, averaged): post-processing, which costs no privacy.

``--agc-clip LAMBDA`` sets the threshold; ``0`` turns AGC off.  Left unset
(auto), it follows the paper's settings: AGC is used only at batch size 32
and bypassed for small batches (B in {1, 2, 4}; "we recommend avoiding using
AGC when the batch size is small", appendix B), with lambda 0.64 on
Digits-Five and 1.28 on Office-Caltech-10 and DomainNet (appendix A.3).
Where the paper is silent: auto is *off* for ``--batch-size`` below 32 and
*on* from 32 up (the paper also runs B = 64 on Fed-ISIC without saying
whether AGC is used); lambda is 0.64 for digit datasets (a ``--data`` name
containing "digit": ``digits``, the generated ``styledigits``) and 1.28 for
every other dataset.  The paper's learning rates (Table 8: 0.05 Digits-Five,
0.1 Office-Caltech-10, 0.05 DomainNet at B = 32; Table 9 for small batches)
are not defaults here: pass ``--lr``.

Models (appendix A.2): Digits-Five uses the six-layer CNN of Table 5
(``--model fedwon-cnn``; FedBN's ``digitmodel`` has BN, not Dropout, between
its FC layers), Office-Caltech-10 and DomainNet the AlexNet of Table 6
(``alexnet-dropout``), each built with WSConv and no norm for FedWon and with
BN for the BN baselines; training images are flipped and rotated by up to 30
degrees on Office-Caltech-10 and DomainNet, FedBN's preprocessing
(``--train-transforms flip,rotate``).
"""

from __future__ import annotations

from ..plan.config import Option, RunConfig
from ..models import adaptive_clip_
from .fedavg import FedAvg

AGC_MIN_BATCH = 32  # the paper applies AGC at B = 32 only, never at B in {1, 2, 4}
AGC_DIGITS = 0.64  # Digits-Five (appendix A.3)
AGC_OBJECTS = 1.28  # Office-Caltech-10 and DomainNet (appendix A.3)


def auto_agc_clip(cfg: RunConfig) -> float:
    """The paper's threshold for this run: 0 (off) below batch size 32, else 0.64 digits / 1.28 others."""
    if cfg.batch_size < AGC_MIN_BATCH:
        return 0.0
    return AGC_DIGITS if "digit" in cfg.data.lower() else AGC_OBJECTS


class FedWon(FedAvg):
    name = "fedwon"
    summary = "FedWon: no normalization, scaled weight-standardized convs, adaptive gradient clipping, FedAvg"
    options = FedAvg.options + (
        Option("agc_clip", float, None,
               "FedWon adaptive gradient clipping threshold lambda (0 = off); unset: off below "
               "--batch-size 32, else 0.64 for digit datasets and 1.28 otherwise", minimum=0, zero="off"),)
    norm = "none"
    norms = ("none",)
    norms_because = "removes every normalization layer"
    conv = "ws"

    def __init__(self, cfg, entries):
        super().__init__(cfg, entries)
        clip = cfg.opt("agc_clip")
        self.agc_clip = auto_agc_clip(cfg) if clip is None else float(clip)

    def after_backward(self, client, model):
        """Eq. (4) on every parameter but the final classifier's."""
        if self.agc_clip > 0:
            adaptive_clip_(model, self.agc_clip, exclude=model.classifier)
