"""FedAdagrad (Reddi, Charles, Zaheer, Garrett, Rush, Konečný, Kumar & McMahan, "Adaptive Federated
Optimization", ICLR 2021, Algorithm 2): Adagrad on the server.

Clients train as in FedAvg; the server applies Adagrad to the averaged
update Delta (``core.server_opt.AdaptiveServerOptimizer``), with

    v_t = v_{t-1} + Delta_t^2.

``--beta1`` default 0, m_t = Delta_t: the authors' experiments (Keras'
Adagrad, no first moment; Algorithm 2 allows beta1 > 0).  ``--server-lr``
default 1e-1: the authors' best on CIFAR-100 (their optimization
README).  m and v stay on the server; the wire is FedAvg's.
Evaluates the global model.
"""

from .core.options import BETA1, SERVER_LR, TAU
from .core.server_opt import AdaptiveServerOptimizer
from .fedavg import FedAvg


class FedAdagrad(AdaptiveServerOptimizer, FedAvg):
    name = "fedadagrad"
    summary = "FedAdagrad: Adagrad on the server over the averaged update (m, v kept on the server)"
    options = FedAvg.options + (SERVER_LR, BETA1, TAU)
    defaults = {"server_lr": 1e-1, "beta1": 0.0}

    def second_moment(self, v, squared):
        return v + squared
