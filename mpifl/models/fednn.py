"""FedNN's weight normalization (WN) conv and Adaptive Group Normalization (AGN).

FedNN (Kang, Kim, Jin, Adeli, Pohl & Park, 2024, Pattern Recognition, "FedNN: Federated learning on
concept drift data using weight and adaptive group normalizations"), section 3.  Where the paper is silent or its
equations differ from the authors' public code (``myeongkyunkang/FedNN``,
``Models.py``), each choice is stated below.

WN conv, section 3.1, eq. (4)
-----------------------------
The paper writes ``theta_hat = (theta - mu) / sigma`` per output channel with
``sigma = sqrt(biased var + eps)``.  The public code, which produced the paper's
numbers, computes ``(w - mean) / (std + 1e-5)`` with torch's default
**unbiased** ``std`` and ``eps`` outside the square root; :class:`WNConv2d`
does exactly that.  Up to the eps placement the two differ by the factor
``sqrt((m - 1) / m)``, the same for every output channel (``m`` = fan-in),
which the following AGN normalizes away.  No gain; weight and bias keep
``nn.Conv2d``'s default init.

AGN, section 3.2, eqs. (5)-(10)
-------------------------------
* Statistics: BN's per channel over (batch, spatial), eq. (6); GN's per
  sample over each group of ``C / g`` channels and the spatial dims, eq. (7),
  ``g = 2`` (section 4.4, following FedDyn; the public code too).  Both are
  the biased ``1/m`` variances of eq. (5) (the code uses torch's unbiased
  ``var()`` for the GN and per-sample terms), ``eps = 1e-5`` (eq. (5) gives
  no value; torch's and the code's).
* Selection, eq. (9): ``s = softmax((log pi + g) / tau)``, Gumbel noise ``g``.
  The code feeds the raw parameter to ``F.gumbel_softmax(select_logits, tau,
  hard=False)``, i.e. ``pi = exp(select_logits)``; logits start at ones
  (uniform), index 0 = BN and 1 = GN as in the paper (the code happens to
  store them in the opposite order).
* Mixing, eq. (10): ``mu = s0 mu_BN + s1 mu_GN`` and ``sigma = s0 sigma_BN +
  s1 sigma_GN`` with ``sigma = sqrt(var + eps)`` (eq. (5)): the paper mixes
  **standard deviations** (``mix="std"``).  The public code, which produced
  the paper's numbers (and FedNN's ablations), mixes the **variances**,
  ``sigma = sqrt(s0 var_BN + s1 var_GN + eps)``: ``mix="var"``, the default.
  Both agree whenever the selection is one-hot.
* Affine, eq. (8): per-channel ``gamma`` (``weight``, ones) and ``beta``
  (``bias``, zeros).
* BN running statistics: exponential moving averages with decay 0.997 (the
  code's ``momentum=0.997``): ``running = 0.997 * running + 0.003 * batch``,
  which is ``torch.nn.BatchNorm``'s ``momentum = 1 - 0.997 = 0.003``.  As in torch, the running
  variance is updated with the unbiased batch variance and starts at ones
  (the code starts it at zeros and mixes biased/unbiased terms).
* Evaluation (the paper is silent): the BN statistics are the running ones,
  GN's are per sample as in training.  The selection of a free (not frozen)
  layer is, with ``eval_noise=True``, a fresh Gumbel-softmax draw at every
  forward, as the public code does (FedNN turns it on: ``--agn-eval``); by
  default the noise-free ``softmax(select_logits / tau)``, deterministic.
  An evaluation draw never freezes the layer.
* Temperature: ``tau`` is a plain attribute, not state: the algorithm sets it
  at each round start (:func:`set_agn_tau`; FedNN decays it linearly from 5 to
  about 0, as its public code does).  It must stay positive.
* Freezing (public code): in training, once a Gumbel-softmax draw is exactly
  one-hot (``max - min >= 1``, as the code tests), the choice is frozen: from
  then on the one-hot is the selection, no noise, no gradient to the logits.
  The frozen choice is the int64 state buffer ``choice`` (-1 = not frozen,
  0 = BN, 1 = GN) so checkpoints keep it.  It is *not* averageable: an
  algorithm sharing the whole state must decide what the global ``choice``
  is (the code averages a 0/1 flag and truncates it, i.e. the global layer is
  frozen only when every participant froze).  ``freeze_on_one_hot=False``
  turns the automatic freeze off; :meth:`AdaptiveGroupNorm.freeze_if_one_hot`
  and :meth:`~AdaptiveGroupNorm.freeze` do it by hand.

State-dict entries of an AGN layer: ``weight``, ``bias``, ``select_logits``
(parameters), ``running_mean``, ``running_var``, ``choice`` (buffers).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

WN_EPS = 1e-5  # public code: std + 1e-5
AGN_EPS = 1e-5
AGN_DECAY = 0.997  # public code: momentum=0.997 (moving-average decay)
AGN_TAU0 = 5.0  # section 3.2: "We initially set tau to 5"
BN, GN = 0, 1  # selection indices (eq. (9): r = 0 BN, r = 1 GN)


class WNConv2d(nn.Conv2d):
    """``nn.Conv2d`` with FedNN's weight normalization (public code form of eq. (4)).

    ``effective_weight() = (W - mean_i) / (std_i + 1e-5)``, row statistics of
    output channel ``i`` over dims (1, 2, 3), ``std`` unbiased; no gain.  The
    stored ``weight`` stays raw.
    """

    def __init__(self, *args, eps: float = WN_EPS, **kwargs):
        super().__init__(*args, **kwargs)
        self.eps = float(eps)

    def effective_weight(self) -> torch.Tensor:
        w = self.weight
        centered = w - w.mean(dim=(1, 2, 3), keepdim=True)
        std = centered.flatten(1).std(dim=1).view(-1, 1, 1, 1) + self.eps
        return centered / std

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._conv_forward(x, self.effective_weight(), self.bias)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", eps={self.eps}"


class AdaptiveGroupNorm(nn.Module):
    """FedNN's AGN: BN and GN statistics mixed by a Gumbel-softmax selection.

    Input ``(N, C, *spatial)`` (``(N, C)`` after a linear layer works too).
    See the module docstring for the equations and every choice made.
    """

    def __init__(
        self,
        num_channels: int,
        num_groups: int = 2,
        eps: float = AGN_EPS,
        decay: float = AGN_DECAY,
        tau: float = AGN_TAU0,
        mix: str = "var",
        freeze_on_one_hot: bool = True,
        eval_noise: bool = False,
    ):
        super().__init__()
        if num_channels % num_groups:
            raise ValueError(f"{num_channels} channels do not split into {num_groups} groups")
        if mix not in ("std", "var"):
            raise ValueError(f"mix must be 'std' (paper eq. 10) or 'var' (public code), got {mix!r}")
        self.num_channels = num_channels
        self.num_groups = num_groups
        self.eps = float(eps)
        self.decay = float(decay)
        self.mix = mix
        self.freeze_on_one_hot = freeze_on_one_hot
        self.eval_noise = eval_noise
        self.tau = tau
        self.weight = nn.Parameter(torch.ones(num_channels))
        self.bias = nn.Parameter(torch.zeros(num_channels))
        self.select_logits = nn.Parameter(torch.ones(2))
        self.register_buffer("running_mean", torch.zeros(num_channels))
        self.register_buffer("running_var", torch.ones(num_channels))
        self.register_buffer("choice", torch.tensor(-1, dtype=torch.int64))
        self.last_selection: torch.Tensor | None = None  # last training draw, detached

    # ------------------------------------------------------------ temperature
    @property
    def tau(self) -> float:
        """Gumbel-softmax temperature (eq. (9)); set by the algorithm each round."""
        return self._tau

    @tau.setter
    def tau(self, value: float) -> None:
        value = float(value)
        if not value > 0:
            raise ValueError(f"AGN temperature must be positive, got {value}")
        self._tau = value

    # --------------------------------------------------------------- freezing
    @property
    def is_frozen(self) -> bool:
        return int(self.choice) >= 0

    def freeze(self, index: int) -> None:
        """Fix the selection to BN (0) or GN (1)."""
        if index not in (BN, GN):
            raise ValueError(f"AGN choice is 0 (BN) or 1 (GN), got {index}")
        self.choice.fill_(index)

    def freeze_if_one_hot(self, selection: torch.Tensor | None = None) -> bool:
        """Freeze if ``selection`` (default: the last training draw) is exactly one-hot.

        One-hot is the public code's test ``max - min >= 1``.  Returns whether
        the layer is frozen afterwards.
        """
        if selection is None:
            selection = self.last_selection
        if not self.is_frozen and selection is not None:
            if float(selection.max() - selection.min()) >= 1:
                self.freeze(int(selection.argmax()))
        return self.is_frozen

    # ---------------------------------------------------------------- forward
    def selection(self) -> torch.Tensor:
        """The (2,) weights ``(s_BN, s_GN)`` this forward uses; draws noise in training (and in evaluation
        with ``eval_noise``)."""
        if self.training:
            soft = F.gumbel_softmax(self.select_logits, tau=self.tau, hard=False)
            with torch.no_grad():
                self.last_selection = soft.detach()
                if self.freeze_on_one_hot:  # on-device, no host sync
                    one_hot = (soft.max() - soft.min()) >= 1
                    newly = (self.choice < 0) & one_hot
                    self.choice.copy_(torch.where(newly, soft.argmax(), self.choice))
        elif self.eval_noise:
            soft = F.gumbel_softmax(self.select_logits, tau=self.tau, hard=False)
        else:
            soft = F.softmax(self.select_logits / self.tau, dim=0)
        fixed = (torch.arange(2, device=soft.device) == self.choice).to(soft.dtype)
        return torch.where(self.choice >= 0, fixed, soft)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, c = x.shape[:2]
        if c != self.num_channels:
            raise ValueError(f"AGN expects {self.num_channels} channels, got {c}")
        shape = (1, c) + (1,) * (x.dim() - 2)
        # BN statistics, eq. (6): per channel over batch and spatial dims
        if self.training:
            dims = (0,) + tuple(range(2, x.dim()))
            var_bn, mean_bn = torch.var_mean(x, dim=dims, correction=0, keepdim=True)
            with torch.no_grad():
                count = x.numel() // c
                unbiased = var_bn.flatten() * (count / max(count - 1, 1))
                self.running_mean.mul_(self.decay).add_(mean_bn.flatten(), alpha=1 - self.decay)
                self.running_var.mul_(self.decay).add_(unbiased, alpha=1 - self.decay)
        else:
            mean_bn = self.running_mean.view(shape)
            var_bn = self.running_var.view(shape)
        # GN statistics, eq. (7): per sample over each group of C/g channels
        groups = x.reshape(n, self.num_groups, -1)
        var_gn, mean_gn = torch.var_mean(groups, dim=2, correction=0, keepdim=True)
        per_channel = (n, c) + (1,) * (x.dim() - 2)
        size = c // self.num_groups
        mean_gn = mean_gn.repeat_interleave(size, dim=1).view(per_channel)
        var_gn = var_gn.repeat_interleave(size, dim=1).view(per_channel)
        # mixing, eqs. (9)-(10)
        s = self.selection()
        mean = s[BN] * mean_bn + s[GN] * mean_gn
        if self.mix == "std":
            sigma = s[BN] * torch.sqrt(var_bn + self.eps) + s[GN] * torch.sqrt(var_gn + self.eps)
        else:
            sigma = torch.sqrt(s[BN] * var_bn + s[GN] * var_gn + self.eps)
        # affine, eq. (8)
        return (x - mean) / sigma * self.weight.view(shape) + self.bias.view(shape)

    def extra_repr(self) -> str:
        return (
            f"{self.num_channels}, groups={self.num_groups}, eps={self.eps}, "
            f"decay={self.decay}, tau={self.tau}, mix={self.mix!r}, eval_noise={self.eval_noise}"
        )



def set_agn_tau(model: nn.Module, tau: float) -> int:
    """Set the temperature of every AGN layer of ``model``; returns how many."""
    layers = [m for m in model.modules() if isinstance(m, AdaptiveGroupNorm)]
    for layer in layers:
        layer.tau = tau
    return len(layers)
