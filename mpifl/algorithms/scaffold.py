"""SCAFFOLD (Karimireddy et al., ICML 2020): stochastic controlled averaging.

Algorithm 1 of the paper, option II for the client control variate:

* the server holds the model x and the server control variate c
  (``ServerState.extra``); client i holds its control variate c_i
  (``scaffold.c_local/<key>``, private, on its rank).  All start at 0; a
  client that is not sampled keeps its c_i unchanged;
* each round the participants receive x and c (``scaffold.c_global/<key>``)
  and take their K local steps with the corrected gradient
  ``y <- y - eta (g_i(y) - c_i + c)``;
* then (option II) ``c_i+ = c_i - c + (x - y_i) / (K eta)``, K the
  client's own number of local steps this round, eta = the round's lr (with
  momentum, K becomes a_K, below); a client that took no step keeps c_i
  (Delta c_i = 0);
* they upload y_i (the model entries: Delta y_i = y_i - x is formed on the
  server, which holds x; same bytes) and ``Delta c_i = c_i+ - c_i``
  (``scaffold.delta_c/<key>``), and set c_i <- c_i+;
* the server: ``x <- x + eta_g sum_S w_i Delta y_i`` and
  ``c <- c + (|S|/N) mean_S Delta c_i = c + (1/N) sum_S Delta c_i``, N the
  number of training clients (``Algorithm.num_training_clients``), so
  ``c = (1/N) sum_i c_i`` over *all* clients holds after every round.

Wire per participant and round: down = the model + c (one tensor per
trainable parameter), up = the model + Delta c; kept: c_i.

Choices:

* **Weights** w_i of the model average are FedAvg's (sample count,
  ``--uniform-weights`` for the paper's 1/|S|), so with all variates at zero
  SCAFFOLD is FedAvg; c follows the paper's uniform 1/N rule.
* **eta_g** = ``--server-lr`` (default 1, the paper's experiments use 1):
  the server-SGD step of ``core.server_opt``, the mean itself at eta_g = 1.
* **BN.**  Control variates exist only for trainable parameters (conv,
  linear, BN affine); BN running statistics are averaged as in FedAvg
  (weighted mean, no eta_g) and ``num_batches_tracked`` stays local.
* **Momentum and weight decay.**  The correction ``c - c_i`` is added to
  the gradient after ``backward()``; the SGD step then adds weight decay
  ``lambda y`` (part of the local objective, hence of g_i and of the c_i
  estimates) and feeds the sum into its momentum buffer, so the correction
  is accumulated exactly like the gradient.  The paper's local solver is
  plain SGD (``--momentum 0``), where K local steps move ``K eta`` per unit
  of a constant gradient.  With ``--momentum rho`` they move ``eta a_K``,
  ``a_K = [K - rho (1 - rho^K)/(1 - rho)] / (1 - rho)`` (FedNova's
  normalizer, ``deltas.solver_norm``), and option II divides by that
  instead: ``c_i+ = c_i - c + (x - y_i) / (a_K eta)``, still the mean
  corrected gradient; dividing by ``K eta`` would inflate every variate up
  to 1/(1 - rho) times (10x at 0.9: on styledigits SCAFFOLD then fell below
  FedAvg within 4 rounds).  For rho = 0, a_K = K: the paper's rule.  eta is
  the round's learning rate as the runtime's SGD uses it (``--lr`` after
  ``--lr-schedule``: ``Algorithm.lr``).
"""

from __future__ import annotations

import torch

from .core.deltas import add_to_grads, parameters, solver_norm, trainable_specs, training_share
from .core.options import SERVER_LR
from .core.reduction import Reduction
from .core.server_opt import ServerOptimizer
from .fedavg import FedAvg

C_GLOBAL, C_LOCAL, DELTA_C = "scaffold.c_global/", "scaffold.c_local/", "scaffold.delta_c/"


class Scaffold(ServerOptimizer, FedAvg):
    name = "scaffold"
    fresh_optimizer = True  # a_K (deltas.solver_norm) assumes zero momentum at each round's start
    summary = "SCAFFOLD: server variate c sent down, client variates c_i kept, Delta c_i sent up, corrected local steps"
    options = FedAvg.options + (SERVER_LR,)

    def extra_download(self):
        return trainable_specs(self, C_GLOBAL)

    def extra_upload(self):
        return trainable_specs(self, DELTA_C)

    def extra_private(self):
        return trainable_specs(self, C_LOCAL)

    # ------------------------------------------------------------------ server
    def init_server(self, initial):
        server = super().init_server(initial)
        server.extra = {C_GLOBAL + k: torch.zeros_like(initial[k]) for k in self.params}
        return server

    def download(self, server):
        return {**super().download(server), **server.extra}

    def reductions(self, server, uploads):
        """The weighted means, and sum_S delta c_i / N for the global control variate."""
        share = training_share(self, len(uploads.clients))
        return {**super().reductions(server, uploads),
                **{DELTA_C + k: Reduction(DELTA_C + k, share) for k in self.params}}

    def aggregate(self, server, uploads):
        super().aggregate(server, uploads)
        for key in self.params:
            c = server.extra[C_GLOBAL + key]
            server.extra[C_GLOBAL + key] = (c.double() + torch.from_numpy(uploads.sums[DELTA_C + key])).to(c.dtype)

    # ------------------------------------------------------------------ client
    def begin_local(self, client, model, download):
        super().begin_local(client, model, download)
        self._params = parameters(model, self.params)
        self._x = [p.detach().clone() for p in self._params]
        self._c = [download[C_GLOBAL + k] for k in self.params]
        self._correction = [c - client.private[C_LOCAL + k] for k, c in zip(self.params, self._c)]
        self._steps = 0

    def after_backward(self, client, model):
        self._steps += 1
        add_to_grads(self._params, self._correction)

    @torch.no_grad()
    def end_local(self, client, model):
        out = {}
        moved_per_gradient = float(solver_norm(self._steps, self.cfg.momentum)) * self.lr  # K eta for SGD
        for key, y, x, c in zip(self.params, self._params, self._x, self._c):
            if self._steps:
                delta = (x - y) / moved_per_gradient - c  # c_i+ - c_i, option II
            else:
                delta = torch.zeros_like(c)
            client.private[C_LOCAL + key].add_(delta)
            out[DELTA_C + key] = delta
        return out
