"""FedProto (Tan, Long, Liu, Zhou, Lu, Jiang & Zhang, "FedProto: Federated Prototype Learning across
Heterogeneous Clients", AAAI 2022).

Clients exchange class prototypes instead of weights (section 3):

* **Private**: the whole model, every state entry, stays on its client
  (nothing of it crosses the wire); clients start from the same seeded
  initial model.  Evaluates the personal models.
* **Up**: ``fedproto.protos`` (K x D) the client's local prototypes,
  ``C_i^(j) = mean of f_i(x) over its samples of class j`` (zeros for a class
  it lacks), and ``fedproto.counts`` (K) how many feature vectors each mean
  is over.  D is the feature dimension of ``model.encode`` (the input width
  of the final linear layer), K the number of classes.
* **Server** (global prototype aggregation): per class, the count-weighted
  mean of the round's client prototypes, ``C_bar^(j) = sum_i n_ij C_i^(j) /
  sum_i n_ij`` over the clients that have class j (count 0: left out): each
  client weighs by its share of the class's samples, as in the paper's
  aggregation (the authors' code takes the plain mean over clients), so the
  global prototype is the mean feature of the class over all those clients'
  samples.  A class no participant of the round has keeps its previous
  global prototype (the code has every client in every round; with
  ``--fraction`` < 1 this keeps what partial participation would otherwise
  forget).
* **Down**: ``fedproto.protos`` (K x D) the global prototypes and
  ``fedproto.present`` (K) 1 where class j has one (0 until some client has
  reported the class; all 0 in round 1).
* **Local objective**: ``CE(h(f(x)), y) + lambda L_R`` with the
  authors' code's ``L_R = MSE(f(x), C_bar^(y))``: the squared distance
  between each sample's features and the global prototype of its label,
  averaged over the mini-batch's B x D entries (``nn.MSELoss``); a sample
  whose class has no global prototype contributes 0 to the sum (the code
  compares it with itself), and round 1 has no term.  ``lambda`` is ``--mu``
  (FedProx's option, :mod:`~mpifl.algorithms.core.options`), default 1: FedRDN's appendix A.2 ("We
  empirically set mu to 0.001 for FedProx and 1 for FedProto").
* **Which features make the prototypes** (``--proto-epochs``): those of the
  local training pass itself, computed in training mode and detached.
  ``last`` (default, the authors' code, ``yuetan031/FedProto``, which empties
  its per-label feature lists at the start of every local epoch): every
  mini-batch of the last local epoch only.  ``all``: every mini-batch of
  every local epoch, a mean over E passes of a model that moves while it
  trains (the paper, section 3, does not say which).  The last epoch is found
  by counting mini-batches: ``ceil(n_i / B)`` per epoch as the runtime takes
  them (``deltas.local_steps``).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import MpiflError
from ..plan.config import Option
from ..transport.wire import TensorSpec
from .core.deltas import local_steps
from .core.options import MU
from .fedavg import FedAvg

PROTOS, COUNTS, PRESENT = "fedproto.protos", "fedproto.counts", "fedproto.present"
PROTO_EPOCHS = ("last", "all")


def head_shape(entries) -> tuple[int, int]:
    """(K, D) of the model's classifier: the last linear weight in state-dict order (mpifl's model protocol
    puts the final ``nn.Linear`` last)."""
    for entry in reversed(entries):
        if entry.module_kind == "linear" and entry.attr == "weight" and len(entry.shape) == 2:
            return entry.shape
    raise MpiflError("FedProto needs a model whose classifier is a linear layer")


def aggregate_prototypes(protos: np.ndarray, counts: np.ndarray, previous: torch.Tensor,
                         present: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Count-weighted per-class mean of ``protos`` (N, K, D) with ``counts`` (N, K), in float64
    and client order; classes nobody reported keep ``previous`` and their ``present`` flag."""
    counts = counts.astype(np.float64)
    total = counts.sum(0)
    mean = np.einsum("nk,nkd->kd", counts, protos.astype(np.float64)) / np.maximum(total, 1)[:, None]
    reported = torch.from_numpy(total > 0)
    new = torch.where(reported[:, None], torch.from_numpy(mean).to(previous.dtype), previous)
    return new, torch.where(reported, torch.ones_like(present), present)


class FedProto(FedAvg):
    name = "fedproto"
    summary = "FedProto: models stay local, class prototypes (mean features) are averaged and regularize"
    classification_only = "averages class prototypes, one mean feature per class of the images"
    evaluates = ("personal",)
    options = (MU,  # no model is averaged: no --uniform-weights
               Option("proto_epochs", str, "last", "FedProto: local epochs whose features make the prototypes: "
                      "last (authors' code) or all", choices=PROTO_EPOCHS))
    defaults = {"mu": 1.0}  # FedRDN's appendix A.2 (above)

    def __init__(self, cfg, entries):
        super().__init__(cfg, entries)
        self.classes, self.dim = head_shape(entries)

    def shares(self, entry):
        return False

    def extra_download(self):
        return [TensorSpec(PROTOS, (self.classes, self.dim), torch.float32,
                           derived="clients' class-mean features, averaged", exposes="prototypes"),
                TensorSpec(PRESENT, (self.classes,), torch.float32, derived="which classes some client holds",
                           exposes="data statistics")]

    def extra_upload(self):
        return [TensorSpec(PROTOS, (self.classes, self.dim), torch.float32,
                           derived="class-mean features of the client's training data", exposes="prototypes"),
                TensorSpec(COUNTS, (self.classes,), torch.float32, derived="the client's samples per class",
                           exposes="data statistics")]

    # ------------------------------------------------------------------ server
    def init_server(self, initial):
        server = super().init_server(initial)
        server.extra = {PROTOS: torch.zeros(self.classes, self.dim), PRESENT: torch.zeros(self.classes)}
        return server

    def download(self, server):
        return dict(server.extra)

    def gathered_keys(self):
        """Prototypes and counts: a per-class, count-weighted mean (classes x features per client)."""
        return [PROTOS, COUNTS]

    def aggregate(self, server, uploads):
        server.extra[PROTOS], server.extra[PRESENT] = aggregate_prototypes(
            np.stack(uploads.tensors[PROTOS]), np.stack(uploads.tensors[COUNTS]),
            server.extra[PROTOS], server.extra[PRESENT])

    # ------------------------------------------------------------------ client
    def begin_local(self, client, model, download):
        super().begin_local(client, model, download)
        self._global = download[PROTOS]
        self._present = download[PRESENT] > 0
        self._sum = torch.zeros(self.classes, self.dim, device=self._global.device)
        self._count = torch.zeros(self.classes, device=self._global.device)
        self._batches = 0  # mini-batches seen this round: the first _skip make no prototype
        last = self.cfg.opt("proto_epochs") == "last"
        self._skip = local_steps(client.spec.num_train, self.cfg.batch_size, self.local_epochs() - 1) if last else 0

    def prototype_loss(self, features: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """``nn.MSELoss`` between features and their labels' global prototypes; 0 where a class has none."""
        has = self._present[labels]
        target = torch.where(has[:, None], self._global[labels], features.detach())
        return F.mse_loss(features, target)

    def batch_loss(self, client, model, x, y):
        features = model.encode(x)
        logits = model.classifier(features)
        loss = self.plus_extra(F.cross_entropy(logits, y) + self.cfg.opt("mu") * self.prototype_loss(features, y),
                               client, model, features, logits, y)
        self._batches += 1
        if self._batches > self._skip:
            with torch.no_grad():
                self._sum.index_add_(0, y, features.detach().float())
                self._count.index_add_(0, y, torch.ones_like(y, dtype=self._count.dtype))
        return loss, logits

    def end_local(self, client, model):
        protos = self._sum / self._count.clamp(min=1)[:, None]
        return {PROTOS: protos, COUNTS: self._count}
