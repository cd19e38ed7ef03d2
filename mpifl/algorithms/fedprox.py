"""FedProx (Li et al., 2020): FedAvg plus a proximal term on the local objective.

Local objective h(w) = F(w) + mu/2 ||w - w_t||^2 (eq. 2), w_t the global
model received this round.  Implemented as its gradient, mu (w - w_t), added
after ``backward()``: the same update without an extra autograd graph.  The
term covers the trainable parameters the method shares.  Default mu = 0.01,
FedBN's value for Digits-Five (it uses 1e-3 on Office-Caltech-10 and
DomainNet; FedRDN's appendix uses 1e-3).
"""

import torch

from .core.options import MU
from .fedavg import FedAvg


class FedProx(FedAvg):
    name = "fedprox"
    summary = "FedProx: FedAvg with proximal term mu/2 ||w - w_global||^2"
    options = FedAvg.options + (MU,)

    def begin_local(self, client, model, download):
        super().begin_local(client, model, download)
        shared = set(self.shared_keys)
        self._params = [p for n, p in model.named_parameters() if n in shared]
        self._anchor = [p.detach().clone() for p in self._params]

    def after_backward(self, client, model):
        params = [p for p in self._params if p.grad is not None]
        anchors = [a for p, a in zip(self._params, self._anchor) if p.grad is not None]
        grads = [p.grad for p in params]
        diffs = torch._foreach_sub([p.detach() for p in params], anchors)
        torch._foreach_add_(grads, diffs, alpha=self.cfg.opt("mu"))
