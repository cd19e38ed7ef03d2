"""FedAsync (Xie, Koyejo & Gupta, "Asynchronous federated optimization", OPT workshop 2020, Algorithm 1):
asynchronous aggregation, one update per server step, mixed into the global model by its staleness.

On the simulated clock (:mod:`mpifl.plan.clock`) ``--concurrency`` clients (by default max(1, round(C N)),
``--fraction`` C of the N training clients) train at once, each on the model version it downloaded (x_tau); each
arrival is one server step t:

* x_t = (1 - alpha_t) x_{t-1} + alpha_t x_new, alpha_t = alpha s(t - tau) (``--fedasync-alpha``, ``--staleness``:
  polynomial (t - tau + 1)^-a, hinge, constant; :mod:`.core.asynchronous`); t counts the step being taken, so an
  update on the newest model has t - tau = 1 (the runtime's staleness, steps since the download, plus one);
* the client minimizes f(x) + rho/2 ||x - x_tau||^2 (the paper's regularized local problem; ``--mu`` is rho, added
  as its gradient after ``backward()``, as FedProx's term).

Every shared entry, BN running statistics included, is mixed; ``num_batches_tracked`` stays on each client.
Choices: alpha = 0.6, a = 0.5 and rho = 0.005 are this implementation's defaults (the paper sweeps them); a
client waits for its update's step before it is sampled again.  Evaluates the global model.
"""

from __future__ import annotations

from ..errors import MpiflError
from ..plan.config import Option
from .core.options import CONCURRENCY, STALENESS, STALENESS_A, STALENESS_B
from .core.asynchronous import clients_at_once, run_staleness_weights
from .fedprox import FedProx


class FedAsync(FedProx):
    name = "fedasync"
    summary = "FedAsync: asynchronous; each update mixed into the global model with a staleness-weighted alpha"
    asynchronous = True
    defaults = {"mu": 0.005}
    options = FedProx.options + (CONCURRENCY, Option("fedasync_alpha", float, 0.6, "FedAsync's mixing weight alpha: "
                                                     "x <- (1 - alpha s(staleness)) x + alpha s(staleness) x_new",
                                                     minimum=0, above=True, maximum=1),
                                 STALENESS, STALENESS_A, STALENESS_B)

    def concurrency(self):
        clients = clients_at_once(self)
        if clients > self.num_training_clients:
            raise MpiflError(f"--concurrency {clients}: FedAsync has only {self.num_training_clients} training "
                             "clients to run at once; lower it")
        return clients, 1

    def global_value(self, server, key, combined, uploads):
        """(1 - alpha_t) x + alpha_t x_new, in float64."""
        alpha = self.cfg.opt("fedasync_alpha") * float(run_staleness_weights(self.cfg, uploads.staleness + 1)[0])
        return (1 - alpha) * server.model[key].double() + alpha * combined.double()
