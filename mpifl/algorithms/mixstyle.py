"""MixStyle inside FedAvg clients (Zhou et al., "Domain Generalization with MixStyle", ICLR 2021).

A centralized domain-generalization method that gPerXAN (Le et al., 2024,
Table 2, "FedAvg w/ MixStyle") runs "directly integrated into the FedAvg
without further modifications": FedAvg's protocol (everything but BN step
counters goes down and up, sample-count weights, ``--uniform-weights``), with
MixStyle layers in the network that only act during local training.  The
layer (:class:`~mpifl.models.mixstyle.MixStyle`) holds no state, so the wire
is FedAvg's exactly; it mixes the instance statistics of two samples of the
client's own mini-batch (a client holds one domain, so the mixing is the
paper's random shuffle, not its cross-domain variant).  Evaluates the global
model (gPerXAN reports the global model on held-out domains).

**Positions.**  The paper inserts MixStyle after the first residual stages,
not the last (its PACS ResNet-18 uses conv2_x-conv4_x = ``layer1``-``layer3``
of 4; the authors' code names it ``resnet18_mixstyle_L234``).  Here: after
every stage of :func:`~mpifl.models.surgery.stage_outputs` but the last, for
every registered model (ResNet-18/50 ``layer1``-``layer3``, ResNet-20
``layer1``-``layer2``, SmallCNN after its first two conv blocks' norms,
AlexNet after its first four conv blocks, ...), inserted by forward hooks
(:func:`~mpifl.models.surgery.insert_after`) so state-dict keys, and
``--pretrained`` checkpoints, are unchanged.

Hyperparameters: ``--mixstyle-p`` 0.5 and ``--mixstyle-alpha`` 0.1, the
paper's defaults and the authors' PACS configuration
(``resnet18_mixstyle_L234_p0d5_a0d1``).
"""

from ..plan.config import Option
from ..models.mixstyle import MIXSTYLE_ALPHA, MIXSTYLE_P, MixStyle
from ..models.surgery import insert_after, stage_outputs
from .fedavg import FedAvg


class MixStyleFedAvg(FedAvg):
    name = "mixstyle"
    summary = "FedAvg with MixStyle layers (instance-statistics mixing) after all but the last stage"
    options = FedAvg.options + (
        Option("mixstyle_p", float, MIXSTYLE_P, "MixStyle: probability a layer mixes a mini-batch", minimum=0,
               maximum=1),
        Option("mixstyle_alpha", float, MIXSTYLE_ALPHA, "MixStyle: Beta(alpha, alpha) of the mixing weight",
               minimum=0, above=True),
    )

    @classmethod
    def adapt_model(cls, model, cfg):
        p, alpha = cfg.opt("mixstyle_p"), cfg.opt("mixstyle_alpha")
        positions = stage_outputs(model)[:-1]
        insert_after(model, positions, lambda channels: MixStyle(channels, p=p, alpha=alpha), "mixstyle")
        return model
