"""CIFAR-style ResNet-20 (He et al. 2016, section 4.2), FedWon appendix Table 13.

He et al.'s CIFAR-10 networks: a 3x3 conv with 16 filters, then three stages
of ``n`` basic blocks (two 3x3 convs each) on maps of 16, 32 and 64 filters,
the first block of stages 2 and 3 with stride 2, global average pooling and
a linear classifier; depth ``6n + 2`` (ResNet-20: ``n = 3``, 0.27 M
parameters).  FedWon compares methods on ResNet-20 (Table 13) without giving
its code; the choices where the paper is silent:

* **Shortcuts**: option A, "identity shortcuts in all cases" with zero
  padding for the increased dimensions (He et al. section 4.2 for CIFAR): the
  shortcut of a stride-2 block is ``x[:, :, ::2, ::2]`` with the new channels
  zero-padded, half before and half after the existing ones (the common
  PyTorch port's layout).  No projection convs, so every conv is a 3x3 of the
  residual branch or the stem.
* Order conv -> norm -> ReLU, second norm before the addition and ReLU after
  it (the original post-activation block, as torchvision's ``BasicBlock``).
* Convs have no bias (``bias=False``, followed by a norm in the original),
  also with ``norm="none"`` (as torchvision ResNets with the norm removed).
* Init: ``plain`` and ``wn`` convs get ``kaiming_normal_(fan_out, relu)``
  (He init, torchvision's ResNet rule); ``ws`` convs keep FedWon Listing 1's
  xavier normal; norms and the classifier keep torch's defaults.
* Names follow torchvision's ResNet (``conv1``, ``bn1``, ``layerK.I.conv1``,
  ``layerK.I.bn1``, ``...bn2``, ``fc``), ``classifier`` is ``fc``.

Input: any size of at least 8 x 8 (global pooling; the last stage is 1/4 of
the input side); the design size is CIFAR's 32 x 32.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from mpifl.models.checks import ceil_half, check_image_size, check_kinds
from mpifl.models.fednn import WNConv2d
from mpifl.models.norm import make_conv, make_norm
from mpifl.models.pooling import global_avg_pool

MIN_SIDE = 8
PAPER_SIZE = 32
WIDTHS = (16, 32, 64)


class BasicBlockA(nn.Module):
    """Two 3x3 convs with norms; option-A (strided, zero-padded identity) shortcut."""

    def __init__(self, in_planes: int, planes: int, stride: int, norm: str, conv: str):
        super().__init__()
        self.conv1 = make_conv(conv, in_planes, planes, 3, stride, 1, bias=False)
        self.bn1 = make_norm(norm, planes)
        self.conv2 = make_conv(conv, planes, planes, 3, 1, 1, bias=False)
        self.bn2 = make_norm(norm, planes)
        self.stride = stride
        self.extra = planes - in_planes

    def shortcut(self, x: torch.Tensor) -> torch.Tensor:
        if self.stride != 1:
            x = x[:, :, :: self.stride, :: self.stride]
        if self.extra:
            before = self.extra // 2
            x = F.pad(x, (0, 0, 0, 0, before, self.extra - before))
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class CifarResNet(nn.Module):
    """He et al.'s CIFAR ResNet of depth ``6 * blocks + 2``."""

    def __init__(
        self,
        num_classes: int,
        in_channels: int = 3,
        norm: str = "bn",
        conv: str = "plain",
        blocks: int = 3,
    ):
        super().__init__()
        self.conv1 = make_conv(conv, in_channels, WIDTHS[0], 3, 1, 1, bias=False)
        self.bn1 = make_norm(norm, WIDTHS[0])
        in_planes = WIDTHS[0]
        for stage, planes in enumerate(WIDTHS, start=1):
            layers = []
            for i in range(blocks):
                stride = 2 if stage > 1 and i == 0 else 1
                layers.append(BasicBlockA(in_planes, planes, stride, norm, conv))
                in_planes = planes
            setattr(self, f"layer{stage}", nn.Sequential(*layers))
        self.fc = nn.Linear(WIDTHS[-1], num_classes)
        for m in self.modules():
            if type(m) in (nn.Conv2d, WNConv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    @property
    def classifier(self) -> nn.Linear:
        """The final linear layer: the same module as ``fc`` (read-only alias)."""
        return self.fc

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Globally pooled features of the last stage, shape (B, 64)."""
        x = F.relu(self.bn1(self.conv1(x)))
        x = self.layer3(self.layer2(self.layer1(x)))
        return global_avg_pool(x).flatten(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.encode(x))


def build_resnet20(
    *, num_classes: int, in_channels: int, image_size: tuple[int, int], norm: str,
    conv: str = "plain",
) -> CifarResNet:
    """Registry builder for ``resnet20``: any input of at least 8 x 8."""
    check_kinds(norm, conv)
    check_image_size(
        "resnet20", image_size, norm, final_map=lambda s: ceil_half(ceil_half(s)),
        floor=MIN_SIDE, paper_size=PAPER_SIZE, smaller="smallcnn",
    )  # fmt: skip
    return CifarResNet(num_classes, in_channels, norm, conv, blocks=3)
