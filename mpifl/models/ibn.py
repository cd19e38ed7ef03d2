"""IBN-Net's instance-batch normalization layer (IBN-a).

Pan, Luo, Shi & Tang, "Two at Once: Enhancing Learning and Generalization
Capacities via IBN-Net", ECCV 2018, section 3.2 (IBN-a): in a layer with C
channels, the first ``h = floor(C / 2)`` channels are instance-normalized
(affine, no running statistics) and the other ``C - h`` batch-normalized::

    y[:, :h] = IN(x[:, :h]),    y[:, h:] = BN(x[:, h:])

as the authors' public code (``IBN(planes, ratio=0.5)``: ``half = int(planes
* ratio)``).  Both halves use torch's defaults (eps 1e-5, BN momentum 0.1).
IBN-Net's DenseNet builder (``ibnnet/densenet_ibn.py``) splits otherwise: BN on
the first ``int(0.6 C)`` channels, IN on the rest (``in_features``,
``in_first=False``).

Where the layers go and with which split (IBN-Net's sites per architecture)
is :func:`~mpifl.models.surgery.ibn_sites`, applied by
:func:`~mpifl.models.surgery.place_composite_norms`.

State-dict keys relative to the layer, and the side
:func:`mpifl.models.state_entries` reports (``module_kind="ibn"``):

=========  =====================================================================
BN half    ``bn.weight``, ``bn.bias``, ``bn.running_mean``, ``bn.running_var``,
           ``bn.num_batches_tracked`` (``part="bn"``)
IN half    ``inorm.weight``, ``inorm.bias`` (``part="in"``)
=========  =====================================================================
"""

from __future__ import annotations

import torch
from torch import nn


class IBN(nn.Module):
    """IBN-a: IN (affine) on ``in_features`` channels (default ``C // 2``), the first ones (``in_first``) or
    the last ones, BN on the others."""

    def __init__(self, num_features: int, in_features: int | None = None, in_first: bool = True):
        super().__init__()
        self.num_features = num_features
        self.half = num_features // 2 if in_features is None else in_features
        if not 0 < self.half < num_features:
            raise ValueError(f"IBN needs 0 < IN channels < {num_features}, got {self.half}")
        self.in_first = in_first
        self.inorm = nn.InstanceNorm2d(self.half, affine=True)
        self.bn = nn.BatchNorm2d(num_features - self.half)

    @property
    def split(self) -> tuple[int, bool]:
        """(IN channels, whether they are the first channels)."""
        return self.half, self.in_first

    @staticmethod
    def part_of(key: str) -> str:
        """``"bn"`` or ``"in"``: the half a state-dict key (relative to the layer) belongs to."""
        head = key.split(".", 1)[0]
        if head in ("bn", "inorm"):
            return "bn" if head == "bn" else "in"
        raise KeyError(f"{key!r} is not an IBN state entry")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.in_first:
            first, rest = torch.split(x, [self.half, self.num_features - self.half], dim=1)
            return torch.cat([self.inorm(first.contiguous()), self.bn(rest.contiguous())], dim=1)
        rest, last = torch.split(x, [self.num_features - self.half, self.half], dim=1)
        return torch.cat([self.bn(rest.contiguous()), self.inorm(last.contiguous())], dim=1)

    def extra_repr(self) -> str:
        return f"{self.num_features}, in_features={self.half}, in_first={self.in_first}"
