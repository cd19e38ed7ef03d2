"""FedAvgM (Hsu, Qi & Brown, 2019, "Measuring the effects of non-identical data distribution"): server momentum.

Clients train as in FedAvg.  The server treats the averaged update as a
pseudo-gradient and applies momentum to it (the paper's FedAvgM), a member of
the server optimizers (``core.server_opt``):

* ``Delta = x - sum_S w_i y_i``  (x the download, y_i the clients' models,
  w_i FedAvg's normalized weights: sample count, ``--uniform-weights`` for
  equal weights);
* ``v <- beta v + Delta``,  ``x <- x - eta_s v``.

``beta`` = ``--server-momentum``, default 0.9: FedRDN's appendix A.2 (0.9
for its image-classification datasets, 0.01 for ProstateMRI).  ``eta_s`` =
``--server-lr``, default 1 (the paper's ``w <- w - v``; a server learning
rate as in Reddi et al.'s formulation of FedAvgM).  With beta = 0 and
eta_s = 1 FedAvgM is FedAvg.

The momentum buffer v is server state (``fedavgm.momentum/<key>``, zero at
start), never sent: the wire is exactly FedAvg's.  It exists for trainable
parameters only; BN running statistics are averaged as in FedAvg,
``num_batches_tracked`` stays local.  Evaluates the global model.
"""

from __future__ import annotations

from ..plan.config import Option
from .core.options import SERVER_LR
from .core.server_opt import ServerOptimizer
from .fedavg import FedAvg


class FedAvgM(ServerOptimizer, FedAvg):
    name = "fedavgm"
    summary = "FedAvgM: FedAvg with server momentum on the averaged update"
    options = FedAvg.options + (
        Option("server_momentum", float, 0.9, "server momentum beta: v <- beta v + Delta, x <- x - server_lr v",
               minimum=0, maximum=1, below=True),
        SERVER_LR)
    slots = ("momentum",)

    def server_step(self, x, combined, state):
        v = self.cfg.opt("server_momentum") * state["momentum"] + (x - combined)  # Hsu's Delta = x - mean
        state["momentum"] = v
        return x - self.cfg.opt("server_lr") * v
