"""FedStein's James-Stein shrinkage of BN statistics (Gupta, Jangid & Sethi, 2024, arXiv, "FedStein:
Enhancing Multi-Domain Federated Learning Through James-Stein Estimator", eq. (9)).

FedStein (section 2.3, eq. (9); Algorithm 1, lines 21-24) shrinks each
client-averaged BN statistic vector ``theta`` (the running means, or the
running variances, of one BN layer: ``c`` channels) toward 0::

    theta_JS = (1 - (c - 2) * sigma^2 / ||theta||_2^2) * theta          (9)

Choices, and where they differ from the James-Stein normalization FedStein builds on:

* **The formula is eq. (9) as printed.**  The factor
  ``1 - (c-2) * sigma^2 * c/(c+1) / ||theta||^2`` carries an extra ``c/(c+1)``
  taken from the James-Stein normalization work FedStein builds on
  (Khoshsirat & Kambhamettu, its ref. [24]); neither eq. (8), eq. (9) nor
  Algorithm 1 has it, and FedStein has no public code, so the paper wins.
  ``jsnorm_scale=True`` gives the JSNorm variant.  The
  two factors differ by ``(c-2) sigma^2 / ||theta||^2 / (c+1)``, under 1 %
  for layers of 64+ channels.
* **sigma^2**: the paper only says "the variance"; Algorithm 1 writes
  ``sigma^2_{mu_B,agg}`` / ``sigma^2_{sigma_B,agg}``.  Two readings, both
  available: the estimate's own sampling variance (classical James-Stein:
  :func:`sampling_sigma2` for batch statistics, the variance of the clients'
  weighted mean for aggregated ones, FedStein's ``--js-sigma2 sampling``), and
  the biased ``1/c`` variance across the ``c`` channels of ``theta`` itself,
  the rule of the James-Stein normalization layers of Khoshsirat &
  Kambhamettu (WACV 2024) that FedStein builds on (``--js-sigma2 channels``;
  the default of :func:`james_stein_factor` when no ``sigma2`` is given).
* **Sign**: the factor is clamped at 0 (positive-part James-Stein) so the
  estimate never flips sign (the paper is silent).  With the
  default ``sigma^2`` the clamp never binds: ``c * sigma^2 <= ||theta||^2``,
  so the factor is at least ``2 / c`` (``3 / (c + 1)`` with ``jsnorm_scale``);
  it binds only for an explicit ``sigma2``.
* ``c <= 2``: James-Stein needs ``c >= 3`` (section 2.3); the factor is 1
  and the vector is returned unchanged (what eq. (9) gives with the default
  ``sigma^2``: ``c - 2 = 0``, or ``sigma^2 = 0`` for ``c = 1``).
  ``theta = 0`` returns 0 (factor 1; no 0/0).
* Computed in float64 and returned in ``theta``'s dtype.
"""

from __future__ import annotations

import torch
from torch import nn


def james_stein_factor(
    theta: torch.Tensor, *, sigma2: float | torch.Tensor | None = None, jsnorm_scale: bool = False
) -> torch.Tensor:
    """The 0-dim float64 shrinkage factor of eq. (9), clamped at 0 (module docstring)."""
    if theta.dim() != 1 or theta.numel() == 0:
        raise ValueError(f"James-Stein needs a non-empty vector, got shape {tuple(theta.shape)}")
    t = theta.to(torch.float64)
    c = t.numel()
    s2 = t.var(correction=0) if sigma2 is None else torch.as_tensor(sigma2, dtype=torch.float64)
    if jsnorm_scale:
        s2 = s2 * (c / (c + 1))
    norm2 = t.square().sum()
    if c <= 2:
        return torch.ones((), dtype=torch.float64, device=t.device)
    shrink = torch.where(norm2 > 0, (c - 2) * s2 / torch.where(norm2 > 0, norm2, 1.0), 0.0)
    return (1.0 - shrink).clamp(min=0.0)


def james_stein(
    theta: torch.Tensor, *, sigma2: float | torch.Tensor | None = None, jsnorm_scale: bool = False
) -> torch.Tensor:
    """``theta`` shrunk toward 0 by eq. (9): ``james_stein_factor(theta) * theta``.

    Differentiable (the factor too), so JSNorm layers train through it.
    """
    factor = james_stein_factor(theta, sigma2=sigma2, jsnorm_scale=jsnorm_scale)
    return (factor * theta.to(torch.float64)).to(theta.dtype)


SIGMA2_RULES = ("sampling", "channels")


def sampling_sigma2(kind: str, var: torch.Tensor, n: int) -> torch.Tensor:
    """Classical James-Stein's sigma^2 for a batch statistic: the sampling variance of its estimate.

    For ``n`` values per channel with biased variance ``var_j``, the channel
    mean's estimate has variance ``var_j / n`` and the variance's about
    ``2 var_j^2 / (n - 1)`` (normal data); eq. (9) takes one sigma^2 for the
    whole vector, their mean over the ``c`` channels.  ``kind`` is "mean" or "var".
    """
    per_channel = var / n if kind == "mean" else 2 * var.square() / max(n - 1, 1)
    return per_channel.mean()


class _JSNorm:
    """BatchNorm whose training forward normalizes with James-Stein-shrunk batch statistics.

    FedStein section 3.2 ("the batch mean mu_B and variance sigma_B^2 are
    adjusted using the James-Stein estimator") and Algorithm 1 lines 26-27:
    ``(x - JS(mu_B)) / sqrt(JS(sigma_B^2) + eps) * gamma + beta`` with the
    biased batch variance, differentiated through like BN's batch statistics.

    ``sigma2_rule`` picks eq. (9)'s sigma^2 (FedStein's ``--js-sigma2``):
    "sampling", each statistic's own sampling variance
    (:func:`sampling_sigma2`, classical James-Stein), or "channels", the
    biased variance across the vector's channels (the James-Stein
    normalization layers of Khoshsirat & Kambhamettu, WACV 2024).

    The running statistics track the statistics the layer *normalized with*
    (the shrunk ones; torch's momentum rule, the variance scaled by
    ``n / (n - 1)`` as torch does), so evaluation mode, which is a BatchNorm
    with its running statistics, reproduces what training did on the same
    data.  Tracking the plain batch statistics instead, as before, made a
    model evaluate with means it never subtracted in training: with the
    "channels" rule the batch means shrink to about ``2/c`` of their value.
    """

    sigma2_rule = "sampling"

    def shrink(self, mean: torch.Tensor, var: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(JS(mu_B), JS(sigma_B^2)) of one batch by eq. (9) under :attr:`sigma2_rule`."""
        if self.sigma2_rule == "channels":
            return james_stein(mean), james_stein(var)
        return (james_stein(mean, sigma2=sampling_sigma2("mean", var, n)),
                james_stein(var, sigma2=sampling_sigma2("var", var, n)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return super().forward(x)
        self._check_input_dim(x)
        dims = (0,) + tuple(range(2, x.dim()))
        var, mean = torch.var_mean(x, dim=dims, correction=0)
        n = x.numel() // x.shape[1]
        js_mean, js_var = self.shrink(mean, var, n)
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                rate = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
                self.running_mean.lerp_(js_mean, rate)
                self.running_var.lerp_(js_var * (n / max(n - 1, 1)), rate)
        shape = (1, -1) + (1,) * (x.dim() - 2)
        out = (x - js_mean.view(shape)) * torch.rsqrt(js_var.view(shape) + self.eps)
        return out * self.weight.view(shape) + self.bias.view(shape) if self.affine else out


class JSBatchNorm1d(_JSNorm, nn.BatchNorm1d):
    """JSNorm after a linear layer (state identical to ``nn.BatchNorm1d``)."""


class JSBatchNorm2d(_JSNorm, nn.BatchNorm2d):
    """JSNorm after a convolution (state identical to ``nn.BatchNorm2d``)."""
