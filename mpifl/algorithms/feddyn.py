"""FedDyn (Acar et al., ICLR 2021): federated learning with dynamic regularization.

Algorithm 1 of the paper.  Client k of the round's participants P keeps
``g_k = grad L_k(theta_k^{t-1})`` (``feddyn.grad/<key>``, private, zero at
start; a client that is not sampled keeps it) and, from the received global
model theta^{t-1}, minimizes

    L_k(theta) - <g_k, theta> + alpha/2 ||theta - theta^{t-1}||^2

by the run's local SGD (E epochs), giving theta_k^t.  The linear and the
quadratic terms enter as their gradients, ``-g_k + alpha (theta -
theta^{t-1})``, added after ``backward()`` (as FedProx's proximal term is);
the reported training loss is the cross-entropy alone.  Then, from the
first-order condition of the local problem,

    g_k <- g_k - alpha (theta_k^t - theta^{t-1}).

The server keeps h (``ServerState.extra``, ``feddyn.h/<key>``, zero at start,
never sent) and updates

    h^t = h^{t-1} - alpha (1/m) sum_{k in P} (theta_k^t - theta^{t-1}),
    theta^t = sum_{k in P} w_k theta_k^t - h^t / alpha,

m the number of training clients (``Algorithm.num_training_clients``), so
``h = (1/m) sum_k g_k`` over *all* clients after every round.  The wire is
FedAvg's: theta down, theta_k up; g_k and h never travel.  Evaluates the
global model theta^t (the paper's "cloud" model).

Choices:

* **alpha** = ``--alpha``, default 0.01: the authors' code
  (``alpemreacar/FedDyn``, CIFAR-10 example; the paper searches
  {0.1, 0.01, 0.001}).  FedNN, whose appendix sets the baselines, follows
  the authors' implementations of FedDyn and FedDC (its section 4.6).
* **Weights.**  The paper averages theta_k^t with 1/|P|; here w_k are
  FedAvg's (sample count, ``--uniform-weights`` for the paper's 1/|P|),
  as for the other methods.  h keeps the paper's 1/m.
* **alpha per client** (``--feddyn-alpha``): ``client`` (default, the
  authors' code, ``alpha / weight_k`` with ``weight_k = n_k m / sum_j n_j``)
  trains client k with ``alpha_k = alpha * n_bar / n_k``, n_bar the mean
  training-set size of the m training clients, in the regularizer and in
  the g_k update; ``global``: the paper's one alpha.  The server rule
  is the same under both (it moves by ``lambda_k``, whatever alpha_k is).
* **Gradient clipping** (``--feddyn-max-grad-norm``, default 10, 0 = off):
  the authors' code clips, before each SGD step, the global L2 norm of the
  gradient of its loss ``CE + alpha_k <theta, lambda_k - theta^{t-1}>``,
  i.e. of ``grad L_k - g_k - alpha_k theta^{t-1}``; the quadratic's
  ``alpha_k theta`` is its optimizer's weight decay, added after the clip.
  FedDyn's own rule, done here in :meth:`FedDyn.after_backward`.  The paper
  has no clipping.
* **BN.**  The dynamic regularizer, g_k and h cover the trainable
  parameters (BN affine included); BN running statistics are averaged as
  in FedAvg (no -h/alpha), ``num_batches_tracked`` stays local.  The paper
  notes BN is problematic with FedDyn; FedNN reports the same.
* **Momentum and weight decay** are the runtime's SGD (``--momentum``,
  ``--weight-decay``; the authors' code uses plain SGD with weight decay
  1e-3): they act on the corrected gradient, and the g_k update uses the
  first-order identity whether or not the local problem was solved exactly,
  as the paper and its code do.
"""

from __future__ import annotations

import torch

from ..errors import MpiflError
from ..plan.config import Option
from .core.deltas import (
    add_to_grads,
    parameters,
    trainable_keys,
    trainable_specs,
    training_share,
)
from .core.options import ALPHA
from .core.reduction import Reduction
from .fedavg import FedAvg

GRAD, H = "feddyn.grad/", "feddyn.h/"
ALPHA_RULES = ("client", "global")
SHARE_SUM = "feddyn.share_sum/"  # reduction: sum_P theta_k / m


class FedDyn(FedAvg):
    name = "feddyn"
    summary = "FedDyn: dynamic linear + quadratic regularizer per client, server state h corrects the average"
    options = FedAvg.options + (
        ALPHA,
        Option("feddyn_alpha", str, "client", "FedDyn: alpha per client, alpha * mean n / n_k (client, authors' "
               "code) or one alpha (global, paper)", choices=ALPHA_RULES),
        Option("feddyn_max_grad_norm", float, 10.0, "FedDyn: clip of the authors' code, L2 norm of the loss and "
               "linear-term gradient before the quadratic's (0 = off)", minimum=0, zero="off"),
    )

    def __init__(self, cfg, entries):
        super().__init__(cfg, entries)
        if not cfg.opt("alpha") > 0:
            raise MpiflError(f"--alpha must be > 0 for feddyn (theta = mean - h/alpha), got {cfg.opt('alpha')}")
        self.alpha = cfg.opt("alpha")
        self.clip = cfg.opt("feddyn_max_grad_norm")
        self.params = trainable_keys(self)
        self.mean_train = 0.0

    def bind_clients(self, clients):
        super().bind_clients(clients)
        self.mean_train = sum(c.num_train for c in clients) / max(self.num_training_clients, 1)

    def client_alpha(self, num_train: int) -> float:
        """alpha_k: ``alpha * n_bar / n_k`` (``--feddyn-alpha client``) or alpha."""
        if self.cfg.opt("feddyn_alpha") == "global":
            return self.alpha
        if not self.mean_train:
            raise RuntimeError("FedDyn needs the clients' training-set sizes (Algorithm.bind_clients)")
        return self.alpha * self.mean_train / num_train

    def extra_private(self):
        return trainable_specs(self, GRAD)

    # ------------------------------------------------------------------ server
    def init_server(self, initial):
        server = super().init_server(initial)
        server.extra = {H + k: torch.zeros_like(initial[k]) for k in self.params}
        return server

    def reductions(self, server, uploads):
        """The weighted means, and sum_P theta_k / m for h."""
        share = training_share(self, len(uploads.clients))
        return {**super().reductions(server, uploads), **{SHARE_SUM + k: Reduction(k, share) for k in self.params}}

    def global_value(self, server, key, combined, uploads):
        if key not in self.params:
            return combined
        m = self.num_training_clients
        x = server.model[key].double()
        moved = torch.from_numpy(uploads.sums[SHARE_SUM + key]) - (len(uploads.clients) / m) * x
        h = server.extra[H + key].double() - self.alpha * moved  # h - alpha/m sum_P (theta_k - x)
        server.extra[H + key] = h.to(server.model[key].dtype)
        return combined - h / self.alpha

    # ------------------------------------------------------------------ client
    def begin_local(self, client, model, download):
        super().begin_local(client, model, download)
        self._alpha = self.client_alpha(client.spec.num_train)
        self._params = parameters(model, self.params)
        self._anchor = [p.detach().clone() for p in self._params]
        self._grads = [client.private[GRAD + k] for k in self.params]

    def after_backward(self, client, model):
        """grad += -g_k + alpha_k (theta - theta^{t-1}); with the code's clip, clip before the alpha_k theta."""
        live = [i for i, p in enumerate(self._params) if p.grad is not None]
        if not live:
            return
        params = [self._params[i].detach() for i in live]
        if not self.clip:
            terms = torch._foreach_sub(params, [self._anchor[i] for i in live])
            torch._foreach_mul_(terms, self._alpha)
            torch._foreach_sub_(terms, [self._grads[i] for i in live])
            add_to_grads([self._params[i] for i in live], terms)
            return
        linear = torch._foreach_mul([self._anchor[i] for i in live], -self._alpha)
        torch._foreach_sub_(linear, [self._grads[i] for i in live])
        add_to_grads([self._params[i] for i in live], linear)
        torch.nn.utils.clip_grad_norm_(model.parameters(), self.clip)
        add_to_grads([self._params[i] for i in live], torch._foreach_mul(params, self._alpha))

    @torch.no_grad()
    def end_local(self, client, model):
        for g, theta, anchor in zip(self._grads, self._params, self._anchor):
            g.sub_(self._alpha * (theta - anchor))
        return {}
