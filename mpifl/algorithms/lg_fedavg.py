"""LG-FedAvg (Liang, Liu, Ziyin, Allen, Auerbach, Brent, Salakhutdinov & Morency, "Think Locally, Act
Globally: Federated Learning with Local and Global Representations", 2020).

Section 3 and Algorithm 1 of the paper: each client's model is a *local*
representation (the lower layers, private to the client, learned only on its
data) under a *global* model (the top layers), and the global layers are
averaged as in FedAvg: ``theta_g <- sum_k (n_k / n) theta_g^k`` over the
round's participants (``--uniform-weights`` for equal weights).  Locally,
every layer trains on the client's cross-entropy (the paper's end-to-end
local objective without its optional auxiliary representation losses).

* **Which layers are global**: ``--lg-global-layers N``, the last N
  *blocks* of the model in forward order (:mod:`mpifl.models.structure`: a
  conv or linear layer with the normalization after it, a residual stage ...),
  so N = 1 is the classifier alone on every model: the authors' code default
  (``--num_layers_keep 1``; their README uses 2 on CIFAR-10 and 3 on MNIST
  for models without normalization layers).  A global block shares all its
  entries (a BN layer: weight, bias and running statistics; never
  ``num_batches_tracked``).  Examples: SmallCNN N = 2 is ``conv3``, ``norm3``
  and ``classifier``; AlexNet N = 3 is ``fc1``/``bn6``, ``fc2``/``bn7`` and
  ``fc3``; LeNet N = 1 is ``fc3`` (``--show-manifest`` lists exactly what
  travels).  The paper's description (top layers global) is followed; note
  that the authors' CIFAR-10 CNN lists its ``weight_keys`` as fc1, fc2, fc3,
  conv2, conv1, so there ``--num_layers_keep 2`` makes the two *conv* layers
  global.
* **Down/up**: the global layers' entries only; everything else never
  leaves its client, including for clients not sampled in a round.
* **Initialization**: every client starts from the same seeded initial
  model (the paper starts LG-FedAvg from a FedAvg-trained model; use
  ``--pretrained`` for that).
* **Evaluation**: personal models, each client's local layers under the
  current global layers (the paper's "local test"; the global layers alone
  are no model, so there is no global evaluation and no ``--holdout``).
"""

from __future__ import annotations

from ..plan.config import Option
from ..models.structure import last_blocks
from .fedavg import FedAvg


class LGFedAvg(FedAvg):
    name = "lg-fedavg"
    summary = "LG-FedAvg: local lower layers stay private, the last --lg-global-layers layers are averaged"
    classification_only = "shares the layers next to the image classifier and keeps the lower ones"
    evaluates = ("personal",)
    options = FedAvg.options + (
        Option("lg_global_layers", int, 1,
               "LG-FedAvg: number of global (averaged) blocks, counted back from the classifier (1 = classifier)",
               minimum=1),
    )

    def __init__(self, cfg, entries):
        super().__init__(cfg, entries)
        self.global_blocks = last_blocks(entries, cfg.opt("lg_global_layers"), "--lg-global-layers")

    def shares(self, entry):
        return entry.block in self.global_blocks and super().shares(entry)
