"""FedRep (Collins, Hassani, Mokhtari & Shakkottai, ICML 2021, "Exploiting Shared Representations for
Personalized Federated Learning").

Algorithm 1 of the paper: the model is a shared representation (the body) under a personal head.  In
each round a sampled client first trains its head for ``tau_h`` epochs with the body frozen, then the
body for ``tau`` epochs with the head frozen; the server averages the bodies.  The head never leaves
its client.

* **Epochs**: ``--fedrep-head-epochs`` (tau_h, default 10 as in the paper's experiments, section 5) of
  head training, then ``--local-epochs`` (tau, the paper's 1) of body training; the optimizer (fresh each
  round, ``--lr``, ``--momentum``, ``--weight-decay``) steps only the parameters that train in an epoch.
* **Head and body** (:mod:`mpifl.models.structure`): the head is the classifier; the body every other
  entry, BN running statistics included (they follow the forward passes of both phases).
* **Server**: FedAvg over the round's bodies, weighted by sample count; Algorithm 1 prints the uniform
  mean, ``--uniform-weights``.
* **Evaluation**: personal models, each client's head on the current body.
"""

from __future__ import annotations

from ..plan.config import Option
from .fedavg import FedAvg


class FedRep(FedAvg):
    name = "fedrep"
    summary = "FedRep: each round the personal head trains first, then the shared body, which is averaged"
    classification_only = "trains a personal image-classifier head apart from the body"
    evaluates = ("personal",)
    options = FedAvg.options + (
        Option("fedrep_head_epochs", int, 10,
               "FedRep: local epochs training the personal head (body frozen) before the --local-epochs of the "
               "body (head frozen); 0: the head stays at its initial values", minimum=0),
    )

    def shares(self, entry):
        return not entry.is_head and super().shares(entry)

    def local_epochs(self) -> int:
        return self.cfg.opt("fedrep_head_epochs") + self.cfg.local_epochs

    def trainable(self, entry, epoch):
        """The head in the first ``fedrep_head_epochs`` epochs, the body after them."""
        return entry.is_head == (epoch < self.cfg.opt("fedrep_head_epochs"))
