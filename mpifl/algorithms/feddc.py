"""FedDC (Gao et al., CVPR 2022): federated learning with local drift decoupling and correction.

Algorithm 1 of the paper.  Client i keeps a local drift variable h_i
(``feddc.drift/<key>``) and its last local update g_i
(``feddc.last_update/<key>``), both private, zero at start, kept unchanged
while the client is not sampled.  From the received global model w and
global update direction g (``feddc.global_update/<key>``) it trains theta
(initialized to w) on the penalized objective

    F(theta) = L_i(theta) + alpha/2 ||theta + h_i - w||^2 + 1/(eta K) <theta, g_i - g>

(local loss + drift penalty R + gradient correction G).  R and G enter as
their gradients, ``alpha (theta + h_i - w) + (g_i - g)/(eta K)``, added after
``backward()``; the reported training loss is the cross-entropy alone.
After the K local steps, with ``Delta theta_i = theta_i - w``:

    h_i <- h_i + Delta theta_i,     g_i <- Delta theta_i,

and the client uploads ``theta_i + h_i`` (``feddc.theta_plus_drift/<key>``)
and ``Delta theta_i`` (``feddc.update/<key>``).  The server aggregates

    w <- sum_S p_i (theta_i + h_i),     g <- sum_S p_i Delta theta_i,

and sends both down next round.  Wire per participant and round: down = w
(the model) + g; up = theta_i + h_i and Delta theta_i for every trainable
parameter, plus the BN running statistics; kept: h_i, g_i.  theta_i itself
never leaves the client (its parameter entries are sent down every round,
so nothing is adopted).  Evaluates the global model w.

Choices:

* **alpha** = ``--alpha``, default 0.01: the authors' code
  (``gaoliang13/FedDC``, ``alpha_coef = 1e-2``); FedNN, whose appendix sets
  the baselines, follows the authors' implementations of FedDC and FedDyn
  (its section 4.6).
* **eta K.**  eta = the round's lr (``--lr`` after ``--lr-schedule``); K = the client's local steps per round,
  ``E ceil(n_i / B)`` as the runtime takes them (``deltas.local_steps``),
  known before training.  The paper takes one K for all clients (the
  authors' code: E ceil(mean n / B)).  With ``--momentum rho`` K becomes
  FedNova's ``a_K = [K - rho (1 - rho^K)/(1 - rho)] / (1 - rho)``
  (``deltas.solver_norm``), the distance K momentum steps move per unit
  gradient, so that (g_i - g)/(eta a_K) stays a difference of mean
  gradients (as for SCAFFOLD's option II); rho = 0 is the paper's K.
* **Weights** p_i are FedAvg's, normalized (sample count,
  ``--uniform-weights`` for equal weights).
* **Paper, not code, where they differ.**  The authors' code keeps the
  correction as a SCAFFOLD option-II pair of variates (client and server
  "state gradient diffs"), builds w as the mean of the round's theta_i plus
  the mean drift of *all* clients, scales alpha by mean n / n_i and clips
  gradients at norm 10.  With every client participating, equal sizes and
  no clipping the model rule is the same (mean theta + mean h); the
  correction here is the paper's (g_i - g)/(eta K) from the last updates.
* **BN.**  h_i, g_i, g and both penalties cover the trainable parameters
  (BN affine included); BN running statistics are uploaded as themselves
  and averaged as in FedAvg, ``num_batches_tracked`` stays local.
* **Momentum and weight decay** are the runtime's SGD acting on the
  corrected gradient (the authors' code: plain SGD, weight decay 1e-3).
"""

from __future__ import annotations

import torch

from .deltas import (
    ALPHA,
    add_to_grads,
    local_steps,
    parameters,
    solver_norm,
    trainable_keys,
    trainable_specs,
)
from .fedavg import FedAvg

DRIFT, LAST = "feddc.drift/", "feddc.last_update/"
GLOBAL_UPDATE, THETA_PLUS_DRIFT, UPDATE = "feddc.global_update/", "feddc.theta_plus_drift/", "feddc.update/"


class FedDC(FedAvg):
    name = "feddc"
    summary = "FedDC: private drift h_i penalizes theta + h_i - w, gradient correction; theta_i + h_i sent up"
    options = FedAvg.options + (ALPHA,)

    def __init__(self, cfg, entries):
        super().__init__(cfg, entries)
        self.params = trainable_keys(self)

    def sends_back(self, entry):
        """Trainable parameters come back as theta_i + h_i (an extra upload), not as theta_i."""
        return not (entry.is_param and entry.dtype.is_floating_point)

    @property
    def adopted_keys(self):
        """Nothing: the parameters not sent back as such go down every round."""
        return []

    def extra_download(self):
        return trainable_specs(self, GLOBAL_UPDATE)

    def extra_upload(self):
        return trainable_specs(self, THETA_PLUS_DRIFT) + trainable_specs(self, UPDATE)

    def extra_private(self):
        return trainable_specs(self, DRIFT) + trainable_specs(self, LAST)

    # ------------------------------------------------------------------ server
    def init_server(self, initial):
        server = super().init_server(initial)
        server.extra = {GLOBAL_UPDATE + k: torch.zeros_like(initial[k]) for k in self.params}
        return server

    def download(self, server):
        return {**super().download(server), **server.extra}

    def aggregate(self, server, uploads):
        super().aggregate(server, uploads)  # BN running statistics: weighted means
        weights = self.client_weights(uploads)
        for key in self.params:
            server.model[key] = self.combine(key, uploads.tensors[THETA_PLUS_DRIFT + key],
                                             weights).to(server.model[key].dtype)
            server.extra[GLOBAL_UPDATE + key] = self.combine(key, uploads.tensors[UPDATE + key],
                                                             weights).to(server.model[key].dtype)

    # ------------------------------------------------------------------ client
    def begin_local(self, client, model, download):
        self._params = parameters(model, self.params)
        self._w = [p.detach().clone() for p in self._params]
        self._drift = [client.private[DRIFT + k] for k in self.params]
        self._center = [w - h for w, h in zip(self._w, self._drift)]  # R pulls theta toward w - h_i
        steps = local_steps(client.spec.num_train, self.cfg.batch_size, self.cfg.local_epochs)
        scale = 1.0 / (self.lr * float(solver_norm(steps, self.cfg.momentum))) if steps else 0.0
        self._correction = [(client.private[LAST + k] - download[GLOBAL_UPDATE + k]) * scale for k in self.params]

    def after_backward(self, client, model):
        live = [i for i, p in enumerate(self._params) if p.grad is not None]
        if not live:
            return
        terms = torch._foreach_sub([self._params[i].detach() for i in live], [self._center[i] for i in live])
        torch._foreach_mul_(terms, self.cfg.opt("alpha"))
        torch._foreach_add_(terms, [self._correction[i] for i in live])
        add_to_grads([self._params[i] for i in live], terms)

    @torch.no_grad()
    def end_local(self, client, model):
        out = {}
        for key, theta, w, h in zip(self.params, self._params, self._w, self._drift):
            update = theta - w
            h.add_(update)
            client.private[LAST + key].copy_(update)
            out[THETA_PLUS_DRIFT + key] = theta + h
            out[UPDATE + key] = update
        return out
