"""gPerXAN (Le et al., 2024): personalized explicitly assembled normalization + guiding regularizer.

**PerXAN (section 3.1, eq. 2).**  BN layers of the feature extractor are
PerXAN layers: BN and IN outputs mixed by ``softmax([s_bn, s_in])``
(``mpifl.models.perxan``).  The BN side (its affine parameters, running
statistics and score ``s_bn``) is personal: it is never broadcast.  The IN
side, its score and all other parameters, classifier included, are averaged
as in FedAvg.

**Which layers (``--perxan-blocks``, the run's ``--norm-blocks`` for
gPerXAN).**  The paper (section 4.2) replaces BN only in the first blocks:
the first four of ResNet-50 on PACS, the first two on Office-Home, the first
dense block and its transition on Camelyon17 (DenseNet-121).  The authors'
public code builds ``resnet50(norm_layer=<PerXAN>)``, which replaces every
BN, stem included; that is the default (``auto``, which is ``all`` for
PerXAN); it has no DenseNet.  ``N`` keeps PerXAN in the stem and the first
``N`` stages of :func:`~mpifl.models.surgery.stage_outputs` (ResNet
``layer1..layerN``; DenseNet dense block k with transition k), ``N-nostem``
in those stages only (DenseNet's ``norm0`` plain: the paper's Camelyon17
rule, the ``gperxan-t3-camelyon17`` preset's ``1-nostem``), and turns the
others back into plain ``BatchNorm2d`` (:func:`~mpifl.models.surgery.place_composite_norms`,
the one placement rule of every composite norm; ``--norm-blocks``, when
given, wins over ``--perxan-blocks``).  Those plain BN layers are
**shared**: weight, bias and running statistics averaged like every other
parameter (step counters stay local), as the public code's rule (personal =
keys containing ``batchnorm``, which plain BN keys do not) makes them.

**The ablation's layers (``--norm ibn`` / ``--norm dson``).**  gPerXAN's
rule reads the BN side of composite norm layers (``StateEntry.is_bn_side``),
so PerXAN may be replaced by IBN-Net's IBN-a (its BN half stays personal, its
IN half is averaged; placed as IBN-a by default: every stage but the last)
or by DSON (every entry of the layer is domain-specific, so the whole layer
stays personal).  Other kinds have no BN side and are refused.

**Guiding regularizer (section 3.2, eqs. 3-4).**  Local loss
``l(h_i(g_i(x)), y) + lambda * l(h_g(g_i(x)), y)`` where ``h_g`` is the
global classifier received this round, frozen (a copy taken when the round's
download arrives, so only the feature extractor ``g_i`` gets its gradient),
and ``l`` the one base loss of both terms: the task's (cross-entropy, as the
authors' code; the run's ``--seg-loss`` on a segmentation task).
It is the plug-in every method takes (:mod:`mpifl.algorithms.core.guide`), on here
by default: ``--guide-lambda`` defaults to 0.5, the authors' public code (the
paper searches [0, 1] in steps of 0.25).

**Evaluation.**  Source clients are evaluated with their personal models.
For leave-one-domain-out (``--holdout``) the paper builds the global model
"by averaging all model parameters of clients" at inference (section 3.1),
and the authors' code tests the held-out domain with BN sides averaged over
clients.  So, only when a domain is held out, participating
clients also upload their BN sides (running statistics and affine, not the
step counter); the server averages them and sends the average down under
``gperxan.global_bn/<key>``, used *only* to assemble the global model that
evaluates the held-out domain (and the source domains' "global" rows);
training clients never load it (:class:`~mpifl.algorithms.core.held_out.HeldOutAverage`).

**Model selection (``--select-by``).**  The paper picks "the best validation
model selected based on the average of accuracies on validation sets of
source clients" (section 4.2).  The authors' code scores each round by the
validation accuracy of every client's *post-training local model* (right
after local training, before aggregation), averaged with the clients'
training-sample counts as weights, and keeps the aggregated model of the best
round (the first on ties).  That is the default here (``auto`` =
``local-val``); ``val-mean`` takes the unweighted mean over source domains
of the evaluated model's validation accuracy.

Hyperparameters of the paper (section 4.1): SGD lr 2e-3, 100 rounds, E = 1,
224 px, flip + color jitter, ResNet-50 with PerXAN in the first blocks;
the authors' code adds momentum 0.9, wd 5e-4, a cosine schedule, colour
jitter with p 0.5 and strengths 0.2 (``--train-transforms flip,jitter-hue``)
and ImageNet input normalization (what ``--pretrained`` applies).
"""

from __future__ import annotations

from ..plan.config import Option
from .core.held_out import HeldOutAverage
from .fedavg import FedAvg


class GPerXAN(HeldOutAverage, FedAvg):
    name = "gperxan"
    summary = "gPerXAN: PerXAN layers with personal BN sides + guiding regularizer through the global classifier"
    norm = "perxan"
    norms = ("perxan", "ibn", "dson")
    norms_because = "keeps the BN side of composite norm layers personal, which only these kinds have"
    selects_by = "local-val"
    defaults = {"guide_lambda": 0.5}  # the authors' code
    options = FedAvg.options + (
        Option("perxan_blocks", str, "auto", "PerXAN in the stem and the first N stages (N-nostem: those stages "
               "without the stem), plain shared BN elsewhere (auto: every BN layer, the authors' code; paper: 4 "
               "PACS, 2 Office-Home, 1-nostem Camelyon17); --norm-blocks, when given, wins"),
    )

    @classmethod
    def norm_placement(cls, cfg):
        """``--norm-blocks`` when given, else ``--perxan-blocks``."""
        if cfg.norm_blocks != "auto":
            return super().norm_placement(cfg)
        return str(cfg.opt("perxan_blocks")), "--perxan-blocks"

    def __init__(self, cfg, entries):
        super().__init__(cfg, entries)
        self.evaluates = ("global", "personal") if cfg.holdout is not None else ("personal",)

    def shares(self, entry):
        return not entry.is_bn_side and entry.attr != "num_batches_tracked"

    def averaged_for_held_out(self, entry):
        """The BN sides (affine and running statistics, not the step counter)."""
        return entry.is_bn_side and entry.attr != "num_batches_tracked"
