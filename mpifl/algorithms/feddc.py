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
* **Rule** (``--feddc-rule``).  ``paper``: everything above.  ``code``
  (default; the authors' code, ``gaoliang13/FedDC``, which produced the
  paper's numbers): with client weight ``w_i = n_i / n_bar`` (n_bar the mean
  training-set size of the N training clients; 1 with ``--uniform-weights``)
  and ``q_i = w_i / N``,

  - client i trains with ``alpha_i = alpha / w_i`` and the correction of a
    SCAFFOLD option-II pair of variates (the code's "state gradient
    diffs"): gradient ``alpha_i (theta + h_i - w) + c / w_i - c_i``, then
    ``c_i <- c_i - c / w_i - Delta theta_i / (eta K)``; c_i private
    (``feddc.control/<key>``, zero at start), c sent down
    (``feddc.global_control/<key>``); the client uploads theta_i as the
    model and ``Delta c_i`` (``feddc.control_delta/<key>``);
  - the server keeps ``c <- c + sum_S q_i Delta c_i`` and the mean drift of
    *all* clients ``H = sum_all q_i h_i`` (``feddc.mean_drift/<key>``, never
    sent), moved by ``sum_S q_i (theta_i - w)``, and sets
    ``w <- sum_S p_i theta_i + H``.

  With every client participating and the same sizes both rules give the
  same model rule.  The code's gradient clip (norm 10, over the whole
  corrected gradient, before the step) is the runtime's ``--max-grad-norm
  10``, which clips after :meth:`after_backward`; like every method's, it
  is off unless given (the FedNN presets give it).
* **BN.**  h_i, g_i, g and both penalties cover the trainable parameters
  (BN affine included); BN running statistics are uploaded as themselves
  and averaged as in FedAvg, ``num_batches_tracked`` stays local.
* **Momentum and weight decay** are the runtime's SGD acting on the
  corrected gradient (the authors' code: plain SGD, weight decay 1e-3).
"""

from __future__ import annotations

import numpy as np
import torch

from ..errors import MpiflError
from ..plan.config import Option
from .core.deltas import (
    add_to_grads,
    local_steps,
    parameters,
    solver_norm,
    trainable_keys,
    trainable_specs,
)
from .core.options import ALPHA
from .core.reduction import Reduction, mean_weights
from .fedavg import FedAvg

DRIFT, LAST = "feddc.drift/", "feddc.last_update/"
GLOBAL_UPDATE, THETA_PLUS_DRIFT, UPDATE = "feddc.global_update/", "feddc.theta_plus_drift/", "feddc.update/"
CONTROL, GLOBAL_CONTROL, CONTROL_DELTA = "feddc.control/", "feddc.global_control/", "feddc.control_delta/"
MEAN_DRIFT = "feddc.mean_drift/"
Q_SUM = "feddc.q_sum/"  # reduction: sum_i q_i theta_i
RULES = ("code", "paper")


class FedDC(FedAvg):
    name = "feddc"
    fresh_optimizer = True  # a_K (deltas.solver_norm) assumes zero momentum at each round's start
    summary = "FedDC: private drift h_i penalizes theta + h_i - w, gradient correction; theta_i + h_i sent up"
    options = FedAvg.options + (
        ALPHA,
        Option("feddc_rule", str, "code", "FedDC: code (authors' code: alpha and correction per client, "
               "variates, mean drift of all clients) or paper (Algorithm 1)", choices=RULES),
    )

    def __init__(self, cfg, entries):
        super().__init__(cfg, entries)
        if not cfg.opt("alpha") >= 0:  # a negative penalty rewards the drift it is there to bound
            raise MpiflError(f"--alpha must be >= 0, got {cfg.opt('alpha')}")
        self.code = cfg.opt("feddc_rule") == "code"
        self.params = trainable_keys(self)
        self.mean_train = 0.0

    def bind_clients(self, clients):
        super().bind_clients(clients)
        self.mean_train = sum(c.num_train for c in clients) / max(self.num_training_clients, 1)

    def weight(self, num_train: int) -> float:
        """The code's client weight w_i = n_i / n_bar (1 with ``--uniform-weights``)."""
        if self.cfg.opt("uniform_weights"):
            return 1.0
        if not self.mean_train:
            raise RuntimeError("FedDC needs the clients' training-set sizes (Algorithm.bind_clients)")
        return num_train / self.mean_train

    def sends_back(self, entry):
        """Paper: trainable parameters come back as theta_i + h_i (an extra upload), not as theta_i."""
        return self.code or not (entry.is_param and entry.dtype.is_floating_point)

    @property
    def adopted_keys(self):
        """Nothing: the parameters not sent back as such go down every round."""
        return []

    def extra_download(self):
        return trainable_specs(self, GLOBAL_CONTROL if self.code else GLOBAL_UPDATE)

    def extra_upload(self):
        if self.code:
            return trainable_specs(self, CONTROL_DELTA)
        return trainable_specs(self, THETA_PLUS_DRIFT) + trainable_specs(self, UPDATE)

    def extra_private(self):
        return trainable_specs(self, DRIFT) + trainable_specs(self, CONTROL if self.code else LAST)

    # ------------------------------------------------------------------ server
    def init_server(self, initial):
        server = super().init_server(initial)
        kept = (GLOBAL_CONTROL, MEAN_DRIFT) if self.code else (GLOBAL_UPDATE,)
        server.extra = {p + k: torch.zeros_like(initial[k]) for p in kept for k in self.params}
        return server

    def download(self, server):
        return {**super().download(server), **{s.name: server.extra[s.name] for s in self.extra_download()}}

    def q(self, uploads) -> list[float]:
        """The code's q_i = w_i / N: client i's share of the mean over all N training clients."""
        return [self.weight(int(n)) / self.num_training_clients for n in uploads.num_samples]

    def reductions(self, server, uploads):
        """Weighted means of the uploaded entries; the code: sum_i q_i theta_i and sum_i q_i dc_i, the
        paper: the weighted means of theta_i + h_i and of the updates."""
        sums = super().reductions(server, uploads)
        if self.code:
            q = np.array(self.q(uploads))
            for key in self.params:
                sums[Q_SUM + key] = Reduction(key, q)
                sums[CONTROL_DELTA + key] = Reduction(CONTROL_DELTA + key, q)
        else:
            p = mean_weights(self.client_weights(uploads))
            for key in self.params:
                sums[THETA_PLUS_DRIFT + key] = Reduction(THETA_PLUS_DRIFT + key, p)
                sums[UPDATE + key] = Reduction(UPDATE + key, p)
        return sums

    def aggregate(self, server, uploads):
        old = {k: server.model[k].double() for k in self.params}
        super().aggregate(server, uploads)  # BN running statistics (code: and theta_i): weighted means
        if self.code:
            q = self.q(uploads)
            for key in self.params:
                moved = torch.from_numpy(uploads.sums[Q_SUM + key]) - sum(q) * old[key]
                drift = server.extra[MEAN_DRIFT + key].double() + moved
                server.extra[MEAN_DRIFT + key] = drift.to(server.model[key].dtype)
                server.model[key] = (server.model[key].double() + drift).to(server.model[key].dtype)
                control = server.extra[GLOBAL_CONTROL + key].double() + torch.from_numpy(
                    uploads.sums[CONTROL_DELTA + key])
                server.extra[GLOBAL_CONTROL + key] = control.to(server.model[key].dtype)
            return
        for key in self.params:
            server.model[key] = torch.from_numpy(uploads.sums[THETA_PLUS_DRIFT + key]).to(server.model[key].dtype)
            server.extra[GLOBAL_UPDATE + key] = torch.from_numpy(uploads.sums[UPDATE + key]).to(server.model[key].dtype)

    # ------------------------------------------------------------------ client
    def begin_local(self, client, model, download):
        super().begin_local(client, model, download)
        self._params = parameters(model, self.params)
        self._w = [p.detach().clone() for p in self._params]
        self._drift = [client.private[DRIFT + k] for k in self.params]
        self._center = [w - h for w, h in zip(self._w, self._drift)]  # R pulls theta toward w - h_i
        steps = local_steps(client.spec.num_train, self.cfg.batch_size, self.cfg.local_epochs)
        self._scale = 1.0 / (self.lr * float(solver_norm(steps, self.cfg.momentum))) if steps else 0.0
        if self.code:
            weight = self.weight(client.spec.num_train)
            self._alpha = self.cfg.opt("alpha") / weight
            self._global = [download[GLOBAL_CONTROL + k] / weight for k in self.params]  # c / w_i
            self._correction = [g - client.private[CONTROL + k] for g, k in zip(self._global, self.params)]
        else:
            self._alpha = self.cfg.opt("alpha")
            self._correction = [(client.private[LAST + k] - download[GLOBAL_UPDATE + k]) * self._scale
                                for k in self.params]

    def after_backward(self, client, model):
        live = [i for i, p in enumerate(self._params) if p.grad is not None]
        if not live:
            return
        terms = torch._foreach_sub([self._params[i].detach() for i in live], [self._center[i] for i in live])
        torch._foreach_mul_(terms, self._alpha)
        torch._foreach_add_(terms, [self._correction[i] for i in live])
        add_to_grads([self._params[i] for i in live], terms)

    @torch.no_grad()
    def end_local(self, client, model):
        out = {}
        for i, (key, theta, w, h) in enumerate(zip(self.params, self._params, self._w, self._drift)):
            update = theta - w
            h.add_(update)
            if self.code:  # c_i <- c_i - c / w_i - Delta theta / (eta K)
                control = client.private[CONTROL + key]
                new = control - self._global[i] - update * self._scale
                out[CONTROL_DELTA + key] = new - control
                control.copy_(new)
                continue
            client.private[LAST + key].copy_(update)
            out[THETA_PLUS_DRIFT + key] = theta + h
            out[UPDATE + key] = update
        return out
