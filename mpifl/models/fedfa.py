"""FedFA's feature augmentation layer (FFA; Zhou & Konukoglu, "FedFA: Federated Feature Augmentation", ICLR 2023).

For a feature map X (B x C x H x W) in training, with probability p per
mini-batch (one draw per layer call, as the authors' ``FFALayer``), following
section 3 of the paper (named by its paragraphs; the authors' code,
``tfzhou/FedFA`` ``pyfed/utils/ffa_layer.py``, where it fixes a detail):

* instance statistics: ``mu`` the per-sample per-channel mean over H x W,
  ``sigma = sqrt(var + eps)`` (biased variance over H x W);
* *client-specific statistic variances*: ``Sigma2_mu = Var_b[mu]`` and
  ``Sigma2_sigma = Var_b[sigma]`` over the mini-batch (1/B, per channel; the
  code's unbiased ``var`` is undefined for a batch of one), plus eps;
* *client-sharing statistic variances*: each client keeps momentum averages
  of the batch means of its statistics, ``mu_bar <- a mu_bar + (1 - a)
  mean_b mu``, ``sigma_bar`` alike (a = ``momentum``, 0.99 in the code;
  updated when the layer is active, as in the code; a round starts them from
  (0, 1), Algorithm 1 line 5, :meth:`FeatureAugmentation.reset_running`, or,
  as the authors' code, from the server's average, :meth:`~FeatureAugmentation.load_running`).  The server's per-channel variance of
  the clients' ``(mu_bar, sigma_bar)`` comes back as the buffers
  ``shared_var_mean`` and ``shared_var_std`` (initially 1, the code's value:
  every channel then weighs the same);
* *adaptive variance fusion*: ``T(v) = 1 / (1 + 1 / (v + eps))`` per channel
  of a shared variance, ``gamma = C T / sum_c T``, and the Gaussian's
  variance ``Sigma2_hat = (gamma + 1) Sigma2`` (client-specific), as the code
  computes it;
* augmented statistics: ``beta = mu + e_mu sqrt(Sigma2_hat_mu)``,
  ``gamma_s = sigma + e_s sqrt(Sigma2_hat_sigma)``, e ~ N(0, 1) per sample and
  channel (reparameterization), and ``FFA(X) = gamma_s (X - mu) / sigma + beta``.

In evaluation the layer is the identity.  Random numbers come from torch's
global generators (the activation draw on the CPU, e on the map's device),
seeded by the runtime per client and round; the layer holds no random state.
Defaults p = 0.5, momentum 0.99, eps 1e-6: the authors' ``FFALayer``.

Only ``shared_var_mean`` and ``shared_var_std`` are in the state dict (the
global values the server sends); the client's momentum statistics
``running_mean``/``running_std`` are non-persistent buffers, read by the
method after local training and uploaded.
"""

from __future__ import annotations

import torch
from torch import nn

FEDFA_P = 0.5
FEDFA_MOMENTUM = 0.99
EPS = 1e-6


def fusion_gamma(shared_var: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    """Adaptive variance fusion: ``C T(v) / sum_c T(v)`` with ``T(v) = 1 / (1 + 1 / (v + eps))``, per channel."""
    t = 1.0 / (1.0 + 1.0 / (shared_var + eps))
    return shared_var.numel() * t / t.sum()


class FeatureAugmentation(nn.Module):
    """The FFA layer for a map of ``channels`` channels."""

    def __init__(self, channels: int, p: float = FEDFA_P, momentum: float = FEDFA_MOMENTUM, eps: float = EPS):
        super().__init__()
        if not 0 <= p <= 1:
            raise ValueError(f"FFA probability must be in [0, 1], got {p}")
        if not 0 <= momentum < 1:
            raise ValueError(f"FFA momentum must be in [0, 1), got {momentum}")
        self.channels, self.p, self.momentum, self.eps = channels, p, momentum, eps
        self.register_buffer("shared_var_mean", torch.ones(channels))
        self.register_buffer("shared_var_std", torch.ones(channels))
        self.register_buffer("running_mean", torch.zeros(channels), persistent=False)
        self.register_buffer("running_std", torch.ones(channels), persistent=False)

    def extra_repr(self) -> str:
        return f"{self.channels}, p={self.p}, momentum={self.momentum}, eps={self.eps}"

    @torch.no_grad()
    def reset_running(self) -> None:
        """Algorithm 1, line 5: a client starts each round from mu_bar = 0, sigma_bar = 1."""
        self.running_mean.zero_()
        self.running_std.fill_(1.0)

    @torch.no_grad()
    def load_running(self, stats: torch.Tensor) -> None:
        """Start from given (2, C) statistics (mu_bar, sigma_bar): the server's average (authors' code)."""
        self.running_mean.copy_(stats[0])
        self.running_std.copy_(stats[1])

    def client_stats(self) -> torch.Tensor:
        """(2, C): the client's momentum statistics (mu_bar, sigma_bar), what it uploads."""
        return torch.stack([self.running_mean, self.running_std])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or x.dim() != 4:
            return x
        if float(torch.rand(())) >= self.p:
            return x
        return self.augment(x, torch.randn(2, *x.shape[:2], device=x.device, dtype=x.dtype))

    def augment(self, x: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """The augmentation with given standard-normal ``noise`` (2, B, C): [e_mu, e_sigma]."""
        mu = x.mean(dim=(2, 3))
        sigma = (x.var(dim=(2, 3), unbiased=False) + self.eps).sqrt()
        with torch.no_grad():
            a = self.momentum
            self.running_mean.mul_(a).add_(mu.mean(0), alpha=1 - a)
            self.running_std.mul_(a).add_(sigma.mean(0), alpha=1 - a)
        var_mu = mu.var(0, unbiased=False) + self.eps
        var_sigma = sigma.var(0, unbiased=False) + self.eps
        var_mu = (fusion_gamma(self.shared_var_mean, self.eps) + 1) * var_mu
        var_sigma = (fusion_gamma(self.shared_var_std, self.eps) + 1) * var_sigma
        beta = mu + noise[0] * var_mu.sqrt()
        gamma = sigma + noise[1] * var_sigma.sqrt()
        return (x - mu[..., None, None]) / sigma[..., None, None] * gamma[..., None, None] + beta[..., None, None]
