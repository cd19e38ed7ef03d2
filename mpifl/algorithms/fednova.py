"""FedNova (Wang et al., NeurIPS 2020): normalized averaging of heterogeneous local updates.

Clients that run more local steps move further; FedAvg's plain average then
optimizes a surrogate objective weighted by step counts (the paper's
objective inconsistency).  FedNova normalizes each client's
cumulative update by its local-solver norm ``a_i = ||a_i||_1`` before
averaging:

* ``d_i = (x - y_i) / a_i``  (x the download, y_i the trained model);
* ``x <- x - tau_eff sum_S p_i d_i``,  ``p_i = n_i / sum_S n``;
* vanilla SGD: ``a_i = tau_i``, the client's number of local steps this
  round, which every upload carries (``Uploads.num_steps``), so FedNova
  needs nothing beyond FedAvg's wire; with ``--momentum rho > 0`` (the
  paper's momentum-SGD local solver, fresh momentum every round as here):
  ``a_i = [tau_i - rho (1 - rho^tau_i) / (1 - rho)] / (1 - rho)``;
* ``tau_eff = sum_S p_i a_i``: for vanilla SGD this is the paper's
  ``sum_S p_i tau_i``; with momentum it is the authors' code
  (``JYWa/FedNova``, ``tau_eff = sum ratio * local_normalizing_vec``), the
  choice that keeps FedNova equal to FedAvg whenever all clients take the
  same number of steps (the other reading, ``sum p_i tau_i`` with momentum,
  shrinks every global step by about ``1 - rho``).

Clients with more data take more steps (E epochs of ceil(n_i/B) batches),
so with unequal client sizes FedNova differs from FedAvg; with equal step
counts and the same solver it *is* FedAvg.

Choices: p_i are FedAvg's weights normalized (sample count;
``--uniform-weights``: 1/|S|).  A client with tau_i = 0 contributes no
update (d_i = 0).  Only trainable parameters are normalized; BN running
statistics are averaged as in FedAvg, ``num_batches_tracked`` stays local.
Weight decay is part of the local gradient, as in the authors' code; their
proximal variant (FedNova with FedProx's mu) and server momentum (``gmf``)
are not included.  Evaluates the global model.
"""

from __future__ import annotations

import numpy as np
import torch

from .core.deltas import solver_norm, trainable_keys
from .core.reduction import Reduction, mean_weights
from .fedavg import FedAvg


class FedNova(FedAvg):
    name = "fednova"
    fresh_optimizer = True  # a_K (deltas.solver_norm) assumes zero momentum at each round's start
    reductions_need_results = True  # p_i / a_i: a_i from the steps each client took
    summary = "FedNova: client updates normalized by their local step counts (momentum-aware), then averaged"

    def __init__(self, cfg, entries):
        super().__init__(cfg, entries)
        self.params = set(trainable_keys(self))

    def normalized(self, uploads) -> tuple[float, np.ndarray]:
        """tau_eff = sum_i p_i a_i, and the coefficients p_i / a_i (0 for a client that took no step)."""
        p = mean_weights(self.client_weights(uploads))
        a = solver_norm(uploads.num_steps, self.cfg.momentum)
        return float((p * a).sum()), np.divide(p, a, out=np.zeros_like(p), where=a > 0)

    def reductions(self, server, uploads):
        """Weighted means, and for each trainable parameter sum_i (p_i / a_i) y_i."""
        _, coef = self.normalized(uploads)
        sums = super().reductions(server, uploads)
        sums.update((key, Reduction(key, coef)) for key in self.uploaded_keys if key in self.params)
        return sums

    def aggregate(self, server, uploads):
        tau_eff, coef = self.normalized(uploads)
        for key in self.uploaded_keys:
            target = server.model[key]
            value = uploads.sums[key]  # a weighted mean; for a parameter sum_i (p_i / a_i) y_i
            if key in self.params:
                x = target.double().numpy()
                value = x - tau_eff * (coef.sum() * x - value)  # d = sum_i p_i (x - y_i) / a_i
            server.model[key] = torch.from_numpy(value).to(target.dtype)
