"""FedPer (Arivazhagan, Aggarwal, Singh & Choudhary, 2019, arXiv, "Federated Learning with Personalization
Layers"): base layers shared, personalization layers kept by each client.

Section 3 of the paper: every client trains its whole model (base + personalization layers) on its own
data; the server averages only the base layers (FedAvg, weighted by sample count; ``--uniform-weights``
for equal weights); the personalization layers never leave their client.  Each client is evaluated with
its own model: the current base under its personalization layers.

* **Which layers are personal**: ``--fedper-personal-layers K``, the last K blocks of the model in
  forward order (:mod:`mpifl.models.structure`), so K = 1 is the classifier alone; the paper tries
  K_P = 1 to 4 fully connected layers on top of a ResNet or MobileNet.  The complement of LG-FedAvg's
  rule: there the top layers are the shared ones.
* **Initialization**: every client's personalization layers start from the same seeded model.
"""

from __future__ import annotations

from ..models.structure import last_blocks
from ..plan.config import Option
from .fedavg import FedAvg


class FedPer(FedAvg):
    name = "fedper"
    summary = "FedPer: the last --fedper-personal-layers blocks stay on each client, the base is averaged"
    classification_only = "splits the network at its image classifier, a personal head"
    evaluates = ("personal",)
    options = FedAvg.options + (
        Option("fedper_personal_layers", int, 1,
               "FedPer: number of personal blocks kept by each client, counted back from the classifier "
               "(1 = classifier)", minimum=1),
    )

    def __init__(self, cfg, entries):
        super().__init__(cfg, entries)
        self.personal_blocks = last_blocks(entries, cfg.opt("fedper_personal_layers"), "--fedper-personal-layers")

    def shares(self, entry):
        return entry.block not in self.personal_blocks and super().shares(entry)
