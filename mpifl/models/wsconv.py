"""FedWon's scaled weight-standardized convolution (WSConv).

FedWon (Zhuang & Lyu, ICLR 2024, "FedWon: Triumphing Multi-domain Federated Learning Without
Normalization") removes every normalization layer and
reparameterizes each convolution with scaled weight standardization
(Brock et al., 2021a), section 3, eq. (3)::

    W_hat[i, j] = gamma * (W[i, j] - mu_i) / (sigma_i * sqrt(N))

with ``i`` the output channel, ``N`` the fan-in and ``mu_i``, ``sigma_i^2``
the mean and variance of row ``i``.  This module follows the paper's exact
implementation, **appendix A.3, Listing 1** (``class WSConv(nn.Conv2d)``),
where eq. (3) and the listing disagree (no public code exists; the listing is what the
authors ran):

* ``mean = W.mean(dims 1,2,3)``; ``var = torch.var(W, dims 1,2,3)``, torch's
  default **unbiased** variance (eq. (3) writes the biased ``1/N`` one);
* ``scale = rsqrt(max(var * fan_in, eps))`` with ``eps = 1e-4``: a floor on
  ``var * N`` rather than a ``+ eps``;
* ``gain`` is a learnable ``nn.Parameter`` of shape ``(out, 1, 1, 1)``
  initialised to ones (eq. (3) calls gamma "a constant number");
* ``fan_in = weight.shape[1:].numel()`` = ``in_channels / groups * kh * kw``;
* the raw weight is re-initialised with ``nn.init.xavier_normal_`` after
  ``nn.Conv2d``'s own init; the bias keeps ``nn.Conv2d``'s default init;
* the standardization runs in ``forward``, so the stored ``weight`` parameter
  stays raw and the optimizer, AGC and aggregation all act on it.

Hence each output row of the effective weight has zero mean and *unbiased*
variance ``gain_i^2 / fan_in`` (exactly, whenever ``var * fan_in >= eps``).

State-dict entries: ``weight`` (raw), ``bias`` and ``gain``.  ``eps`` and
``fan_in`` are constants (Listing 1 keeps them as non-persistent buffers, so
they are not in its state dict either).

FedWon applies WSConv to convolutions only: its fully connected layers stay
plain ``nn.Linear`` (appendix A.2, Tables 5 and 6), so there is no
``WSLinear`` here.
"""

from __future__ import annotations

import torch
from torch import nn

WS_EPS = 1e-4  # Listing 1, line 6


class WSConv2d(nn.Conv2d):
    """``nn.Conv2d`` with FedWon's scaled weight standardization (Listing 1).

    Same constructor as ``nn.Conv2d``.  ``forward(x)`` is
    ``conv2d(x, effective_weight(), bias)`` with
    ``effective_weight() = gain * (W - mean_i) * rsqrt(max(var_i * fan_in, 1e-4))``,
    row statistics over dims (1, 2, 3), ``var`` unbiased (module docstring).
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size,
        stride=1,
        padding=0,
        dilation=1,
        groups: int = 1,
        bias: bool = True,
        padding_mode: str = "zeros",
        eps: float = WS_EPS,
    ):
        super().__init__(
            in_channels, out_channels, kernel_size, stride, padding, dilation,
            groups, bias, padding_mode,
        )  # fmt: skip
        nn.init.xavier_normal_(self.weight)
        self.gain = nn.Parameter(torch.ones(self.out_channels, 1, 1, 1))
        self.eps = float(eps)
        self.fan_in = self.weight.shape[1:].numel()

    def effective_weight(self) -> torch.Tensor:
        """The standardized weight the convolution uses (Listing 1, ``standardized_weights``)."""
        w = self.weight
        mean = torch.mean(w, dim=(1, 2, 3), keepdim=True)
        var = torch.var(w, dim=(1, 2, 3), keepdim=True)  # unbiased, as Listing 1
        scale = torch.rsqrt(torch.clamp(var * self.fan_in, min=self.eps))
        return (w - mean) * scale * self.gain

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._conv_forward(x, self.effective_weight(), self.bias)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", eps={self.eps}"
