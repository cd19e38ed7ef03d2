"""FedBuff (Nguyen et al., "Federated learning with buffered asynchronous aggregation", AISTATS 2022, Algorithm 1):
asynchronous aggregation with a buffer of K updates.

On the simulated clock (:mod:`mpifl.plan.clock`) ``--concurrency`` clients (by default max(1, round(C N)),
``--fraction`` C of the N training clients) train at once, each on the model version it downloaded; a client
that finishes is replaced at once.  Every update that arrives goes into the server's buffer; when it holds K
(``--buffer-size``), the server steps:

* a client uploads its update Delta_k = y_k - x_{tau_k} (trained minus downloaded) in place of its model entries;
* x <- x + eta_g (1/K) sum_k s(tau_k) Delta_k, tau_k the server steps since client k's download,
  s(tau) = 1/sqrt(1 + tau) (``--staleness polynomial``, a = 1/2: the paper's; :mod:`.core.asynchronous`), eta_g
  ``--server-lr``.

Every shared entry, BN running statistics included, moves by its weighted update; ``num_batches_tracked`` stays on
each client.  The clients weigh 1/K each, whatever their sizes (the paper's uniform buffer average).  Choices where
the paper is silent (docs/clients.md): the local work is ``--local-epochs`` over the client's data, as every
method's; a client waits in the buffer until its step before it is sampled again.  Evaluates the global model.
"""

from __future__ import annotations

import torch

from ..errors import MpiflError
from ..plan.config import Option
from .core.base import Algorithm
from .core.options import CONCURRENCY, SERVER_LR, STALENESS, STALENESS_A, STALENESS_B
from .core.reduction import Reduction
from .core.asynchronous import clients_at_once, run_staleness_weights


class FedBuff(Algorithm):
    name = "fedbuff"
    summary = "FedBuff: asynchronous, buffered: a server step every K staleness-weighted client updates"
    asynchronous = True
    options = (CONCURRENCY, Option("buffer_size", int, 2, "FedBuff's K: client updates the server's buffer holds "
                                   "before a server step", minimum=1),
               SERVER_LR, STALENESS, STALENESS_A, STALENESS_B)

    def concurrency(self):
        clients = clients_at_once(self)
        if not self.cfg.opt("buffer_size") <= clients <= self.num_training_clients:
            raise MpiflError(f"--concurrency {clients} and --buffer-size {self.cfg.opt('buffer_size')}: FedBuff "
                             f"needs buffer size <= concurrency <= the {self.num_training_clients} training clients")
        return clients, self.cfg.opt("buffer_size")

    def begin_local(self, client, model, download):
        super().begin_local(client, model, download)
        self._downloaded = {k: download[k] for k in self.uploaded_keys}

    def end_local(self, client, model):
        """Delta_k = y_k - x_{tau_k} under each uploaded entry's name."""
        state = model.state_dict()
        return {k: state[k] - self._downloaded[k] for k in self.uploaded_keys}

    def reductions(self, server, uploads):
        """sum_k (s(tau_k) / K) Delta_k of every uploaded entry."""
        weights = run_staleness_weights(self.cfg, uploads.staleness) / self.cfg.opt("buffer_size")
        sums = super().reductions(server, uploads)
        sums.update((key, Reduction(key, weights)) for key in self.uploaded_keys)
        return sums

    def aggregate(self, server, uploads):
        eta = self.cfg.opt("server_lr")
        for key in self.uploaded_keys:
            x = server.model[key]
            server.model[key] = torch.from_numpy(x.double().numpy() + eta * uploads.sums[key]).to(x.dtype)
