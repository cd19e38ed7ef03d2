"""RSC inside FedAvg clients (Huang, Wang, Xing & Huang, "Self-Challenging Improves Cross-Domain
Generalization", ECCV 2020).

Representation Self-Challenging, section 3 and Algorithm 1 of the paper, on
each local mini-batch (x, y) with features z = encode(x) (B x D) and head h:

1. gradient of the true-class output w.r.t. the features,
   ``g = d(sum_i h(z)_{i, y_i}) / dz`` (features detached, head frozen for
   this gradient, as the authors' code does);
2. mute the features that gradient ranks highest: per sample, the top
   ``ceil(p D)`` entries of ``g_i`` get mask 0, the rest 1 (``--rsc-drop`` p,
   the *feature dropping percentage*);
3. *batch percentage* b (``--rsc-batch``): only the ``round(b B)`` samples
   whose true-class probability drops most under the mask keep it (and only
   if it drops at all: ``p_before - p_after - 1e-4 > 0``), the others are
   left unmasked (the authors' code, ``change_vector``);
4. the loss is ``CE(h(z * m), y)``, back-propagated through the unmasked
   features into the whole network.

Otherwise FedAvg: gPerXAN (Le et al., 2024, Table 2, "FedAvg w/ RSC") runs
RSC "directly integrated into the FedAvg without further modifications".
The wire is FedAvg's (RSC adds nothing); evaluates the global model.

Choices where mpifl's models differ from the paper's:

* **Channel-wise only.**  The model protocol exposes the flattened feature
  vector ``encode(x)`` (global-average-pooled for CNNs, the fc2 output for
  AlexNet and DigitModel), not the last feature map, so RSC mutes entries of
  that vector.  For a pooled CNN this is exactly the code's channel variant
  (its channel score is the spatial mean of the map gradient, proportional to
  the gradient of the pooled vector); the code's spatial variant, drawn for
  half of the batches, needs the map and is not available.
* **Defaults** p = b = 1/3: the paper's 33 % feature dropping and batch
  percentages (its hyperparameter study); the authors' code mutes
  ``ceil(HW / 3)`` positions in its spatial variant but ``ceil(C / 3.2)``
  channels in its channel variant, and starts its batch percentage at 0.3,
  raising it by 0.2 every 10 epochs (``DeLightCMU/RSC``); mpifl keeps both
  fixed.
* The logits reported for training accuracy are those of the masked features.
* With ``--guide-lambda`` (:mod:`mpifl.algorithms.core.guide`) the guiding term reads the unmasked features
  ``z``, the extractor's output g_i(x) of gPerXAN's eq. 4; the mask is RSC's challenge to the local head only.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..plan.config import Option
from .fedavg import FedAvg

RSC_DROP = 1 / 3
RSC_BATCH = 1 / 3
MARGIN = 1e-4  # the authors' code: a probability must drop by more than this for a sample to be challenged


def feature_mask(grad: torch.Tensor, drop: float) -> torch.Tensor:
    """(B, D) mask: 0 on the ``ceil(drop D)`` largest entries of each row of ``grad``, 1 elsewhere."""
    k = min(math.ceil(drop * grad.shape[1]), grad.shape[1])
    mask = torch.ones_like(grad)
    if k > 0:
        mask.scatter_(1, grad.topk(k, dim=1).indices, 0.0)
    return mask


def challenged_samples(before: torch.Tensor, after: torch.Tensor, fraction: float) -> torch.Tensor:
    """(B,) bool: the ``round(fraction B)`` samples whose true-class probability drops most (and drops at all)."""
    change = (before - after - MARGIN).clamp(min=0)
    k = min(round(fraction * len(change)), len(change))
    chosen = torch.zeros(len(change), dtype=torch.bool, device=change.device)
    if k > 0:
        chosen[change.topk(k).indices] = True
    return chosen & (change > 0)


class RSC(FedAvg):
    name = "rsc"
    summary = "FedAvg with Representation Self-Challenging: mute the features the true class relies on most"
    classification_only = "mutes the features the image's true class relies on most"
    options = FedAvg.options + (
        Option("rsc_drop", float, RSC_DROP, "RSC: fraction of feature entries muted per challenged sample",
               minimum=0, maximum=1),
        Option("rsc_batch", float, RSC_BATCH, "RSC: fraction of the mini-batch that is challenged", minimum=0,
               maximum=1),
    )

    def rsc_mask(self, head, features: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """(B, D) mask of steps 1-3 for ``features`` (not differentiated through)."""
        z = features.detach().requires_grad_(True)
        with torch.enable_grad():
            logits = head(z)
            (grad,) = torch.autograd.grad(logits.gather(1, labels[:, None]).sum(), z)
        mask = feature_mask(grad, self.cfg.opt("rsc_drop"))
        with torch.no_grad():
            before = F.softmax(logits.detach(), 1).gather(1, labels[:, None])[:, 0]
            after = F.softmax(head(z.detach() * mask), 1).gather(1, labels[:, None])[:, 0]
            keep = ~challenged_samples(before, after, self.cfg.opt("rsc_batch"))
        mask[keep] = 1.0
        return mask

    def batch_loss(self, client, model, x, y):
        features = model.encode(x)
        mask = self.rsc_mask(model.classifier, features, y)
        logits = model.classifier(features * mask)
        return self.plus_extra(F.cross_entropy(logits, y), client, model, features, logits, y), logits
