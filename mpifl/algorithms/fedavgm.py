"""FedAvgM (Hsu, Qi & Brown, 2019, "Measuring the effects of non-identical data distribution"): server momentum.

Clients train as in FedAvg.  The server treats the averaged update as a
pseudo-gradient and applies momentum to it (the paper's FedAvgM):

* ``Delta = x - sum_S w_i y_i``  (x the download, y_i the clients' models,
  w_i FedAvg's normalized weights: sample count, ``--uniform-weights`` for
  equal weights);
* ``v <- beta v + Delta``,  ``x <- x - eta_s v``.

``beta`` = ``--server-momentum``, default 0.9: FedRDN's appendix A.2 (0.9
for its image-classification datasets, 0.01 for ProstateMRI).  ``eta_s`` =
``--server-lr``, default 1 (the paper's ``w <- w - v``; a server learning
rate as in Reddi et al.'s formulation of FedAvgM).  With beta = 0 and
eta_s = 1 FedAvgM is FedAvg.

The momentum buffer v is server state (``ServerState.extra``,
``fedavgm.momentum/<key>``, zero at start), never sent: the wire is exactly
FedAvg's.  It exists for trainable parameters only; BN running statistics
are averaged as in FedAvg (momentum on them could push a running variance
below zero), ``num_batches_tracked`` stays local.  Evaluates the global
model.
"""

from __future__ import annotations

import torch

from ..errors import MpiflError
from ..plan.config import Option
from .core.deltas import SERVER_LR, check_server_lr, trainable_keys
from .fedavg import FedAvg

MOMENTUM = "fedavgm.momentum/"


class FedAvgM(FedAvg):
    name = "fedavgm"
    summary = "FedAvgM: FedAvg with server momentum on the averaged update"
    options = FedAvg.options + (
        Option("server_momentum", float, 0.9, "server momentum beta: v <- beta v + Delta, x <- x - server_lr v"),
        SERVER_LR)

    def __init__(self, cfg, entries):
        super().__init__(cfg, entries)
        check_server_lr(cfg)
        if not 0 <= cfg.opt("server_momentum") < 1:  # at 1 and above v never decays: the model runs away
            raise MpiflError(f"--server-momentum must be in [0, 1), got {cfg.opt('server_momentum')}")
        self.params = trainable_keys(self)

    def init_server(self, initial):
        server = super().init_server(initial)
        server.extra = {MOMENTUM + k: torch.zeros_like(initial[k]) for k in self.params}
        return server

    def global_value(self, server, key, combined, uploads):
        if key not in self.params:
            return combined
        beta, eta = self.cfg.opt("server_momentum"), self.cfg.opt("server_lr")
        x = server.model[key].double()
        v = beta * server.extra[MOMENTUM + key].double() + (x - combined)
        server.extra[MOMENTUM + key] = v.to(server.model[key].dtype)
        return x - eta * v
