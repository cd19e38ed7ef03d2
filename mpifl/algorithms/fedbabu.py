"""FedBABU (Oh, Kim & Yun, ICLR 2022, "FedBABU: Toward Enhanced Representation for Federated Image
Classification").

Section 4 of the paper: the head (the classifier) is randomly initialized and never trained during
federated training; only the body learns, locally, and is averaged by the server (FedAvg, weighted by
sample count; ``--uniform-weights`` for equal weights).  For evaluation each client fine-tunes the
global model on its own training data, and the paper reports accuracy before and after fine-tuning.

* **Head**: the same seeded initial classifier on every client, frozen (no gradient, so no step and
  no weight decay).  It never changes, so it never travels: it is kept by each client, identical
  everywhere.
* **Evaluation**: ``global`` is the averaged body under the initial head (the paper's accuracy before
  fine-tuning; with ``--holdout`` the unseen domain's); ``personal`` is that model fine-tuned on the
  client's training split for ``--fedbabu-finetune-epochs`` (default 5) with the local optimizer's
  settings, the whole model (``--fedbabu-finetune full``, the paper's main protocol) or the head only
  (``head``).  Fine-tuning starts from the current global model before every evaluation and changes
  nothing the client keeps.
"""

from __future__ import annotations

from ..plan.config import Option
from .fedavg import FedAvg

FINETUNE_PARTS = ("full", "head")


class FedBABU(FedAvg):
    name = "fedbabu"
    summary = "FedBABU: the body is averaged under a frozen random head; each client fine-tunes to evaluate"
    classification_only = "fixes a random image-classifier head and fine-tunes it to evaluate"
    evaluates = ("global", "personal")
    options = FedAvg.options + (
        Option("fedbabu_finetune_epochs", int, 5,
               "FedBABU: epochs of fine-tuning on a client's training data before its personal evaluation",
               minimum=0),
        Option("fedbabu_finetune", str, "full",
               f"FedBABU: what fine-tuning trains: {' or '.join(FINETUNE_PARTS)}", choices=FINETUNE_PARTS),
    )

    def shares(self, entry):
        return not entry.is_head and super().shares(entry)

    def trainable(self, entry, epoch):
        return not entry.is_head

    @property
    def global_model_shared(self):
        """One model for every client: its private head is the same seeded initial one everywhere, never trained
        (fine-tuning changes a personal model, not the client's state)."""
        return True

    def personalize(self, client, model, fit):
        epochs = self.cfg.opt("fedbabu_finetune_epochs")
        if epochs:
            head_only = self.cfg.opt("fedbabu_finetune") == "head"
            fit(self.make_optimizer(model, self.cfg.lr), epochs, lambda entry, epoch: entry.is_head or not head_only)
