"""FedAdam (Reddi, Charles, Zaheer, Garrett, Rush, Konečný, Kumar & McMahan, "Adaptive Federated Optimization",
ICLR 2021, Algorithm 2): Adam on the server.

Clients train as in FedAvg; the server applies Adam to the averaged update
Delta (``core.server_opt.AdaptiveServerOptimizer``), with

    v_t = beta2 v_{t-1} + (1 - beta2) Delta_t^2.

``--server-lr`` default 1e-2: the authors' best on Stack Overflow word
prediction (their optimization README; 10^-2.5 to 1 over their tasks, 1 on
CIFAR-100 with tau 0.1).  ``--beta2`` default 0.99 is Flower's (its FedAdam
and FedYogi strategies), not the authors': Algorithm 2 leaves beta2 a
parameter, and the authors' experiments keep Keras' Adam defaults, beta1 0.9
and beta2 0.999 (their optimization/docs/hyperparameters.md); ``--beta2
0.999`` takes theirs.  m and v stay on the server; the wire is FedAvg's.
Evaluates the global model.
"""

from .core.options import BETA1, BETA2, SERVER_LR, TAU
from .core.server_opt import AdaptiveServerOptimizer
from .fedavg import FedAvg


class FedAdam(AdaptiveServerOptimizer, FedAvg):
    name = "fedadam"
    summary = "FedAdam: Adam on the server over the averaged update (m, v kept on the server)"
    options = FedAvg.options + (SERVER_LR, BETA1, BETA2, TAU)
    defaults = {"server_lr": 1e-2}

    def second_moment(self, v, squared):
        beta2 = self.cfg.opt("beta2")
        return beta2 * v + (1 - beta2) * squared
