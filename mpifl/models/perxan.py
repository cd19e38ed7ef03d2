"""gPerXAN's eXplicitly Assembled Normalization (XAN / PerXAN).

gPerXAN (Le, Ho, Do, Le-Phuoc & Wong, CVPR 2024, "Efficiently Assemble Normalization Layers
and Regularization for Federated Domain Generalization"), section 3.1, eq. (2)::

    h_hat = w_in * (gamma_in (h - mu_in) / sqrt(sigma_in^2 + eps) + beta_in)
          + w_bn * (gamma_bn (h - mu_bn) / sqrt(sigma_bn^2 + eps) + beta_bn)

the *outputs* of an InstanceNorm and a BatchNorm mixed explicitly (not their
statistics).  The paper only says ``w_in``, ``w_bn`` are "ratios ... randomly
initialized"; the authors' public code (``lhkhiem28/gPerXAN``,
``eXplicitOptimizedNorm2d``) is followed:

* ``(w_bn, w_in) = softmax([bn_score, in_score])``, two scalar logits of
  shape ``(1,)`` initialised to **1.0** (so 0.5 / 0.5 at start);
* the BN side is ``nn.BatchNorm2d(C)`` (affine, running statistics, torch's
  momentum 0.1 and eps 1e-5), the IN side ``nn.InstanceNorm2d(C,
  affine=True)`` (no running statistics, eps 1e-5), both with default
  init;
* conv inputs only: IN is undefined on feature vectors, so ``make_norm`` on
  ``dims=1`` raises, as it does for ``in``.

"PerXAN" is XAN under gPerXAN's share policy (section 3.1, "Personalized
eXplicitly Assembled Normalization"): the **BN side is personal** (never sent
down) and the IN side is aggregated with the rest of the model.  The layer is
the same; which state-dict keys form which side (relative to the layer):

=========  ============================================================
BN side    ``bn.weight``, ``bn.bias``, ``bn.running_mean``,
           ``bn.running_var``, ``bn.num_batches_tracked``, ``bn_score``
IN side    ``inorm.weight``, ``inorm.bias``, ``in_score``
=========  ============================================================

(The public code selects the personal keys by ``"batchnorm" in key``, which
takes its ``batchnorm.*`` and ``score_batchnorm``: the same split.)
:func:`mpifl.models.state_entries` reports ``module_kind="perxan"`` and
``part="bn"`` / ``"in"`` for these entries (``StateEntry.is_bn_side``).

For a BN-pretrained backbone (paper section 4: "parameters related to BN
layers are initialized with ImageNet pre-trained weights") use
:func:`load_bn_state`: BN entries go to the BN sides, the IN sides and the
scores keep their init.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn
from torch.nn import functional as F

from mpifl.errors import MpiflError

BN_SIDE = ("bn", "bn_score")
IN_SIDE = ("inorm", "in_score")
_BN_ATTRS = ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")


class PerXAN(nn.Module):
    """XAN / PerXAN: ``softmax([bn_score, in_score])``-weighted BN and IN outputs (eq. (2))."""

    def __init__(self, num_features: int):
        super().__init__()
        self.num_features = num_features
        self.bn = nn.BatchNorm2d(num_features)
        self.bn_score = nn.Parameter(torch.ones(1))
        self.inorm = nn.InstanceNorm2d(num_features, affine=True)
        self.in_score = nn.Parameter(torch.ones(1))

    @staticmethod
    def part_of(key: str) -> str:
        """``"bn"`` or ``"in"``: the side of a state-dict key relative to the layer."""
        head = key.split(".", 1)[0]
        if head in BN_SIDE:
            return "bn"
        if head in IN_SIDE:
            return "in"
        raise KeyError(f"{key!r} is not a PerXAN state entry")

    def mixing_weights(self) -> torch.Tensor:
        """``(w_bn, w_in) = softmax([bn_score, in_score])``, shape (2,)."""
        return F.softmax(torch.cat([self.bn_score, self.in_score]), dim=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.mixing_weights()
        return w[0] * self.bn(x) + w[1] * self.inorm(x)



def perxan_state_from_bn(
    model: nn.Module, bn_state: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Rename a BN model's state dict for ``model``, the same model built with PerXAN.

    ``P.weight``, ``P.bias``, ``P.running_*``, ``P.num_batches_tracked`` of
    every PerXAN layer ``P`` of ``model`` become ``P.bn.*``; other keys are
    unchanged.
    """
    layers = {name for name, m in model.named_modules() if isinstance(m, PerXAN)}
    out = {}
    for key, value in bn_state.items():
        owner, _, attr = key.rpartition(".")
        if owner in layers and attr in _BN_ATTRS:
            key = f"{owner}.bn.{attr}" if owner else f"bn.{attr}"
        out[key] = value
    return out


def load_bn_state(model: nn.Module, bn_state: Mapping[str, torch.Tensor]) -> list[str]:
    """Load a BN model's state into ``model`` built with PerXAN (``--pretrained``).

    Every entry of ``model`` must come from ``bn_state`` except the IN sides and
    scores of its PerXAN layers, which keep their init (and ``num_batches_tracked``
    counters, which older checkpoints lack); the keys not loaded are returned.
    A mismatch is a user error naming the offending keys.
    """
    state = perxan_state_from_bn(model, bn_state)
    own = model.state_dict()
    layers = {name for name, m in model.named_modules() if isinstance(m, PerXAN)}

    def fresh(key: str) -> bool:  # an IN-side entry or the BN score of a PerXAN layer
        for name in layers:
            if not name or key.startswith(name + "."):
                rel = key[len(name) + 1 :] if name else key
                return PerXAN.part_of(rel) == "in" or rel == "bn_score"
        return False

    missing = [
        k for k in own
        if k not in state and not fresh(k) and not k.endswith("num_batches_tracked")
    ]  # fmt: skip
    unexpected = [k for k in state if k not in own]
    wrong = [k for k in state if k in own and state[k].shape != own[k].shape]
    if missing or unexpected or wrong:
        raise MpiflError(
            f"the pretrained BN state does not fit this PerXAN model (missing: "
            f"{', '.join(missing[:5]) or 'none'}; unexpected: "
            f"{', '.join(unexpected[:5]) or 'none'}; other shape: "
            f"{', '.join(wrong[:5]) or 'none'}); use a BN checkpoint of the same model"
        )
    model.load_state_dict(state, strict=False)
    return [k for k in own if k not in state]
