"""COPA (Wu & Gong, ICCV 2021, "Collaborative Optimization and Aggregation for Decentralized Domain
Generalization and Adaptation"): one feature extractor, averaged, under an ensemble of every client's own
classifier.

No public code of the authors exists to compare with (GitHub searched for the method's name and the paper's
title: only paper lists cite it), and the paper's full text was not at hand when this was written: the rule
below is the abstract's (a domain-invariant extractor trained under every client's classifier, the
classifiers assembled into an ensemble), and the two choices the abstract leaves open (the frozen heads'
weight in the local loss, how the ensemble combines) are options.  Check them against the paper's section 3
before citing numbers from this implementation.  The model is a feature extractor f (the *body*: every block but the last,
:mod:`mpifl.models.structure`) under one linear classifier h_i per training client i (the *head*,
``model.classifier``); N is the number of training clients (every client but a held-out domain's) and
their heads are ordered by client id.

* **Local objective** of client i, from the round's global extractor f and every client's head
  h_1..h_N sent by the server::

      L_i = CE(h_i(f(x)), y) + lambda * sum_{j != i} CE(hbar_j(f(x)), y)

  hbar_j the other clients' heads, frozen: they give f a gradient and never change, so f and h_i are
  what trains.  lambda = ``--copa-frozen-weight``, default 1: each of the N heads, the trainable one and
  the N - 1 frozen ones, weighs alike in the sum.  The training loss the run reports is L_i, frozen terms
  included.
* **Server**: f <- sum_i w_i f_i over the round's participants (FedAvg: w_i by training samples,
  ``--uniform-weights`` for equal weights; the step counters of BN stay with each client).  Heads are
  assembled, not averaged: the server holds one head per training client (``ServerState.extra``, so a
  checkpoint keeps it); a participant's upload replaces its own row, and a client not sampled keeps its
  row as last uploaded (the seeded initial head until its first round).
* **Wire**: down, per participant, the body plus ``copa.heads/<key>`` [N, ...]: all N heads (N times the
  head; with K participants the server sends K N heads a round); up, the body plus ``copa.head/<key>``,
  the client's own head.  A client keeps its head (private state) between its rounds.
* **Global model**: f under the ensemble of the N heads, the paper's generalized model for an unseen
  domain.  ``--copa-ensemble prob`` (default): the mean of the heads' softmax probabilities,
  p(y|x) = (1/N) sum_j softmax(h_j(f(x)))_y, evaluated as the logits log p (so the reported loss is
  -log p(y|x)); ``logit``: the mean of the heads' logits, (1/N) sum_j h_j(f(x)) (for linear heads the
  same as one head with the averaged weights).  Every head counts, also one whose client has not yet
  been sampled.  With ``--holdout`` this model evaluates the held-out domain.  No code settles the
  combination rule or the frozen terms' weight, hence the two options.  Mechanism: a forward hook on
  ``model.classifier`` (installed by :meth:`COPA.begin_eval`) returns the ensemble's logits while the
  global model is evaluated (:meth:`COPA.global_private` turns it on; the personal model and local
  training turn it off).
* **Personal model** of client i: f under its own head h_i (its domain-specific classifier on the
  current averaged extractor).

* **Normalization**: the abstract's hybrid batch-instance normalization is IBN-Net's IBN-a here
  (:class:`~mpifl.models.IBN`, the method's default norm kind, in the first stages as ``--norm-blocks``
  places it); which variant and placement the paper uses was not at hand.  ``--norm bn`` runs COPA on
  plain BN.

Not implemented: decentralized unsupervised adaptation (the prediction-agreement mechanism needs an
unlabeled target client, which mpifl's runs do not have).
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import MpiflError
from ..plan.config import Option
from ..transport.wire import TensorSpec
from .fedavg import FedAvg

HEAD, HEADS = "copa.head/", "copa.heads/"
ENSEMBLES = ("prob", "logit")


def heads_logits(features: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """(H, B, C) logits of H linear heads, ``weight`` (H, C, D) and ``bias`` (H, C), on (B, D) features."""
    logits = torch.matmul(features, weight.transpose(1, 2))
    return logits if bias is None else logits + bias[:, None, :]


def ensemble_logits(logits: torch.Tensor, rule: str) -> torch.Tensor:
    """(B, C) logits of the ensemble of (H, B, C) heads' logits: ``prob``, the log of the mean softmax
    probability, log((1/H) sum_h softmax(z_h)); ``logit``, the mean logit (1/H) sum_h z_h."""
    if rule == "logit":
        return logits.mean(0)
    return torch.logsumexp(F.log_softmax(logits.float(), dim=-1), dim=0) - math.log(logits.shape[0])


class COPA(FedAvg):
    name = "copa"
    summary = "COPA: the feature extractor is averaged; every client's head goes to everyone, trained against frozen"
    classification_only = "ensembles the clients' image classifiers"
    evaluates = ("global", "personal")
    norm = "ibn"
    options = FedAvg.options + (
        Option("copa_ensemble", str, "prob", "COPA: how the global model combines the N heads: prob (mean of "
               "softmax probabilities) or logit (mean of logits)", choices=ENSEMBLES),
        Option("copa_frozen_weight", float, 1.0, "COPA: weight lambda of the cross-entropy through the other "
               "clients' frozen heads in the local objective", minimum=0),
    )

    def __init__(self, cfg, entries):
        super().__init__(cfg, entries)
        self.head = {e.attr: e for e in entries if e.is_head}
        if set(self.head) - {"bias"} != {"weight"} or len(self.head["weight"].shape) != 2:
            raise MpiflError("copa needs a model whose classifier is one linear layer (model.classifier)")
        self.row: dict[int, int] = {}  # training client id -> its head's row in the stack (client-id order)
        self._ensemble = None  # the stacked heads while a global model is evaluated, else None
        self._hooked: list = []  # classifiers carrying the ensemble hook

    def bind_clients(self, clients):
        super().bind_clients(clients)
        self.row = {cid: r for r, cid in enumerate(self.training_ids)}

    def shares(self, entry):
        return not entry.is_head and super().shares(entry)

    def extra_upload(self):
        return [self.entry_spec(e, HEAD + e.key) for e in self.head.values()]

    def extra_download(self):
        return [TensorSpec(HEADS + e.key, (self.num_training_clients, *e.shape), e.dtype)
                for e in self.head.values()]

    # ------------------------------------------------------------------ server
    def init_server(self, initial):
        server = super().init_server(initial)
        n = self.num_training_clients
        server.extra = {HEADS + e.key: initial[e.key].expand(n, *e.shape).clone() for e in self.head.values()}
        return server

    def download(self, server):
        return {**super().download(server), **server.extra}

    def gathered_keys(self):
        """Every participant's head, whole: each replaces its own row of the stack (no sum can)."""
        return [HEAD + e.key for e in self.head.values()]

    def aggregate(self, server, uploads):
        """FedAvg over the bodies; each participant's head replaces its row of the stack."""
        super().aggregate(server, uploads)
        rows = [self.row[int(c)] for c in uploads.clients]
        for e in self.head.values():
            server.extra[HEADS + e.key][rows] = torch.from_numpy(np.stack(uploads.tensors[HEAD + e.key])).to(e.dtype)

    # ------------------------------------------------------------------ client
    def stacked(self, download, rows=None):
        """(weight, bias) of the heads in ``rows`` of the download's stack (None: all N)."""
        weight = download[HEADS + self.head["weight"].key]
        bias = download[HEADS + self.head["bias"].key] if "bias" in self.head else None
        if rows is None:
            return weight, bias
        return weight[rows], None if bias is None else bias[rows]

    def begin_local(self, client, model, download):
        super().begin_local(client, model, download)
        self._ensemble = None
        others = [r for cid, r in self.row.items() if cid != client.id]
        self._frozen = self.stacked(download, others)

    def batch_loss(self, client, model, x, y):
        features = model.encode(x)
        logits = model.classifier(features)
        loss = F.cross_entropy(logits, y)
        frozen = heads_logits(features, *self._frozen)
        if len(frozen):  # sum over the frozen heads of each one's mean cross-entropy
            flat = frozen.reshape(-1, frozen.shape[-1])
            loss = loss + self.cfg.opt("copa_frozen_weight") * len(frozen) * F.cross_entropy(flat, y.repeat(len(frozen)))
        return self.plus_extra(loss, client, model, features, logits, y), logits

    def end_local(self, client, model):
        state = model.state_dict()
        return {HEAD + e.key: state[e.key] for e in self.head.values()}

    # -------------------------------------------------------------- evaluation
    def begin_eval(self, model, round_index):
        """Hook the classifier once: while a global model is evaluated, its output is the ensemble's."""
        if not any(head is model.classifier for head in self._hooked):
            model.classifier.register_forward_hook(self._ensemble_output)
            self._hooked.append(model.classifier)

    def _ensemble_output(self, module, inputs, output):
        if self._ensemble is None:
            return None
        return ensemble_logits(heads_logits(inputs[0], *self._ensemble), self.cfg.opt("copa_ensemble")).float()

    def global_private(self, client, download):
        """The client's own entries; the classifier's output becomes the ensemble of the download's N heads."""
        self._ensemble = self.stacked(download)
        return client.private

    @property
    def global_model_shared(self):
        """One model for every client: the ensemble of the download's heads replaces the client's own head's output."""
        return True

    def personalize(self, client, model, fit):
        """The personal model is the client's own head on the global body: no ensemble."""
        self._ensemble = None
