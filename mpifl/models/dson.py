"""DSON's optimized normalization: a learned mixture of BN and IN statistics.

Seo, Suh, Kim, Kim, Han & Han, "Learning to Optimize Domain Specific
Normalization for Domain Generalization", ECCV 2020, section 3.  Per layer,
with per-instance statistics ``mu_in, var_in`` (over H x W) and batch
statistics ``mu_bn, var_bn`` (over N x H x W; running averages at test)::

    (w_in, w_bn)   = softmax(mean_weight)
    (w'_in, w'_bn) = softmax(var_weight)
    mu  = w_in mu_in  + w_bn mu_bn
    var = w'_in var_in + w'_bn var_bn
    y   = gamma (x - mu) / sqrt(var + eps) + beta

Choices where the paper is silent, from the public implementation of the
layer (``OptimizedNorm2d``, as reproduced in the NormAUG repository; the
authors' own repository was not available to read): separate logits for the
mean and the variance, two scalars each (one mixture per layer, not per
channel), initialised to 1 (0.5 / 0.5 at start), order ``(in, bn)``; one
affine ``gamma, beta`` per channel (init 1, 0); eps 1e-5.  Here the batch
side follows torch's ``BatchNorm2d`` (running statistics start at 0 and 1,
momentum 0.1, the running variance updated with the unbiased batch variance,
``num_batches_tracked`` counted) and both sides normalize with biased
variances; the public code starts the running variance at 0 and computes the
instance variance with Bessel's correction over H x W.

**Domain-specific.**  DSON keeps one such layer per domain: statistics,
affine and mixture weights are all the domain's own.  In federated learning
each client is one domain, so every entry of the layer is its *BN side*
(``module_kind="dson"``, ``part="bn"`` in :func:`mpifl.models.state_entries`):
methods that keep BN sides on the client (FedBN, gPerXAN; SiloBN its
statistics) make it DSON's domain-specific normalization; FedAvg-style
methods average it like any layer.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class DSON(nn.Module):
    """Optimized normalization: softmax-mixed IN and BN statistics, one affine (section 3)."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float = 0.1):
        super().__init__()
        self.num_features = num_features
        self.eps = eps
        self.momentum = momentum
        self.weight = nn.Parameter(torch.ones(num_features))
        self.bias = nn.Parameter(torch.zeros(num_features))
        self.mean_weight = nn.Parameter(torch.ones(2))  # logits of (w_in, w_bn)
        self.var_weight = nn.Parameter(torch.ones(2))  # logits of (w'_in, w'_bn)
        self.register_buffer("running_mean", torch.zeros(num_features))
        self.register_buffer("running_var", torch.ones(num_features))
        self.register_buffer("num_batches_tracked", torch.tensor(0, dtype=torch.long))

    @staticmethod
    def part_of(key: str) -> str:
        """Every entry is domain-specific: ``"bn"``."""
        return "bn"

    def mixing_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``softmax(mean_weight)``, ``softmax(var_weight)``: each ``(w_in, w_bn)``."""
        return F.softmax(self.mean_weight, dim=0), F.softmax(self.var_weight, dim=0)

    def _batch_statistics(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch mean and biased variance per channel (shape 1 x C x 1 x 1); updates the running ones."""
        mean = x.mean(dim=(0, 2, 3), keepdim=True)
        var = x.var(dim=(0, 2, 3), unbiased=False, keepdim=True)
        with torch.no_grad():
            n = x.numel() // x.shape[1]
            unbiased = var.flatten() * (n / max(n - 1, 1))
            self.running_mean.lerp_(mean.flatten(), self.momentum)
            self.running_var.lerp_(unbiased, self.momentum)
            self.num_batches_tracked.add_(1)
        return mean, var

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean_in = x.mean(dim=(2, 3), keepdim=True)
        var_in = x.var(dim=(2, 3), unbiased=False, keepdim=True)
        if self.training:
            mean_bn, var_bn = self._batch_statistics(x)
        else:
            mean_bn = self.running_mean.view(1, -1, 1, 1)
            var_bn = self.running_var.view(1, -1, 1, 1)
        w_mean, w_var = self.mixing_weights()
        mean = w_mean[0] * mean_in + w_mean[1] * mean_bn
        var = w_var[0] * var_in + w_var[1] * var_bn
        y = (x - mean) / torch.sqrt(var + self.eps)
        return y * self.weight.view(1, -1, 1, 1) + self.bias.view(1, -1, 1, 1)
