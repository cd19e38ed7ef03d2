"""FedBN's DigitModel (FedBN public code, ``DigitModel``) and FedWon's six-layer CNN (Table 5).

Input 3 x 28 x 28 (Digits-Five)::

    conv1 5x5 3->64   bn1 ReLU maxpool2     28 -> 14
    conv2 5x5 64->64  bn2 ReLU maxpool2     14 -> 7
    conv3 5x5 64->128 bn3 ReLU              flatten 128*7*7 = 6272
    fc1 6272->2048    bn4 ReLU
    fc2 2048->512     bn5 ReLU
    fc3 512->num_classes

Attribute names are FedBN's, so a FedBN state dict loads by name.  With
``norm`` other than ``bn`` the attributes ``bn1``..``bn5`` keep their names
but hold that norm's layer (GroupNorm, InstanceNorm, Identity...).  FedWon's
GN variant uses GN after the linear layers too, and so does ``ln``; for kinds
undefined on vectors (``in``, ``perxan``) ``bn4`` and ``bn5`` are
``nn.Identity``.

``conv`` picks the convolution of ``conv1``..``conv3`` (``plain``, FedWon's
``ws``, FedNN's ``wn``; :func:`~mpifl.models.norm.make_conv`).  ``plain``
keeps FedBN's ``nn.Conv2d`` and state dict; ``ws`` adds ``convN.gain``.

``fedwon-cnn`` is FedWon's six-layer CNN (Zhuang & Lyu, ICLR 2024, appendix
A.2, Table 5), the same convolutions and conv norms but **no norm after the
FC layers** (``bn4``/``bn5`` are ``nn.Identity``) and ``Dropout`` before fc1
and before fc2 (``drop1``/``drop2``; the rate is not given: torch's default
0.5, as ``alexnet-dropout``).  FedWon uses it for every method it compares:
BN methods with ``norm="bn"``, FedWon itself with ``norm="none",
conv="ws"``.  In ``digitmodel`` ``drop1``/``drop2`` are ``nn.Identity``.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from mpifl.errors import MpiflError
from mpifl.models.norm import make_conv, make_norm, supports_vectors

IMAGE_SIZE = (28, 28)
FC_DROPOUT = 0.5  # FedWon Table 5 "Dropout" without a rate: torch's default


class DigitModel(nn.Module):
    """FedBN's Digits CNN with a chosen normalization; see the module docstring."""

    def __init__(
        self, num_classes: int, in_channels: int = 3, norm: str = "bn", conv: str = "plain",
        fc_norm: bool = True, dropout: float = 0.0,
    ):
        super().__init__()
        fc_kind = norm if fc_norm and supports_vectors(norm) else "none"
        self.conv1 = make_conv(conv, in_channels, 64, 5, 1, 2)
        self.bn1 = make_norm(norm, 64)
        self.conv2 = make_conv(conv, 64, 64, 5, 1, 2)
        self.bn2 = make_norm(norm, 64)
        self.conv3 = make_conv(conv, 64, 128, 5, 1, 2)
        self.bn3 = make_norm(norm, 128)
        self.drop1 = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.fc1 = nn.Linear(128 * 7 * 7, 2048)
        self.bn4 = make_norm(fc_kind, 2048, dims=1)
        self.drop2 = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.fc2 = nn.Linear(2048, 512)
        self.bn5 = make_norm(fc_kind, 512, dims=1)
        self.fc3 = nn.Linear(512, num_classes)

    @property
    def classifier(self) -> nn.Linear:
        """The final linear layer: the same module as ``fc3`` (read-only alias)."""
        return self.fc3

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Features before the classifier, shape (B, 512)."""
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
        x = F.relu(self.bn3(self.conv3(x))).flatten(1)
        x = F.relu(self.bn4(self.fc1(self.drop1(x))))
        return F.relu(self.bn5(self.fc2(self.drop2(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.encode(x))


def _check_size(name: str, image_size: tuple[int, int]) -> None:
    """The 28 x 28 input the fc1 size is fixed for."""
    if image_size != IMAGE_SIZE:
        h, w = image_size
        raise MpiflError(
            f"{name} needs 28x28 inputs but the data is {h}x{w}; use "
            f"--model smallcnn, or prepare the dataset resized to 28x28"
        )


def build_digitmodel(
    *, num_classes: int, in_channels: int, image_size: tuple[int, int], norm: str,
    conv: str = "plain",
) -> DigitModel:
    """Registry builder for ``digitmodel`` (FedBN: norm after every layer)."""
    _check_size("DigitModel", image_size)
    return DigitModel(num_classes, in_channels, norm, conv)


def build_fedwon_cnn(
    *, num_classes: int, in_channels: int, image_size: tuple[int, int], norm: str,
    conv: str = "plain",
) -> DigitModel:
    """Registry builder for ``fedwon-cnn`` (FedWon Table 5: conv norms, Dropout before fc1/fc2)."""
    _check_size("fedwon-cnn", image_size)
    return DigitModel(num_classes, in_channels, norm, conv, fc_norm=False, dropout=FC_DROPOUT)
