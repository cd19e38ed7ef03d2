"""FedAvg with a server learning rate (Reddi et al., "Adaptive Federated Optimization", ICLR 2021, Algorithm 1
with server SGD).

Clients train as in FedAvg; the server steps along the averaged update, a
pseudo-gradient (``core.server_opt``)::

    Delta = sum_S w_i y_i - x,   x <- x + eta Delta

w_i FedAvg's weights, eta = ``--server-lr`` (default 1: FedAvg, bit for
bit).  eta on trainable parameters only; BN running statistics are averaged.
No server state; the wire is FedAvg's.  Evaluates the global model.
"""

from .core.options import SERVER_LR
from .core.server_opt import ServerOptimizer
from .fedavg import FedAvg


class FedAvgServerLR(ServerOptimizer, FedAvg):
    name = "fedavg-slr"
    summary = "FedAvg with a server learning rate: x <- x + server_lr (mean - x)"
    options = FedAvg.options + (SERVER_LR,)
