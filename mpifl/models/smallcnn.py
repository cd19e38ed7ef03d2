"""A small CNN for fast CPU runs and tests (mpifl's own; no paper).

::

    conv1 3x3 in->16  norm1 ReLU maxpool2
    conv2 3x3 16->32  norm2 ReLU maxpool2
    conv3 3x3 32->64  norm3 ReLU global average pool -> (B, 64)
    classifier 64->num_classes

Convs are padded, so any image of at least 8 x 8 works (2 x 2 before the
pool, enough for per-instance statistics).  Norm kinds undefined on vectors
are fine here: every norm follows a conv.  Widths are chosen so a training
step on a batch of 32 28 x 28 images costs about a tenth of DigitModel's on
CPU.

``conv`` picks the convolution kind (``plain``, FedWon's ``ws``, FedNN's
``wn``; :func:`~mpifl.models.norm.make_conv`).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from mpifl.errors import MpiflError
from mpifl.models.norm import make_conv, make_norm
from mpifl.models.pooling import global_avg_pool

MIN_IMAGE_SIZE = 8


class SmallCNN(nn.Module):
    """Three 3x3 conv blocks, global average pool, one linear classifier."""

    def __init__(
        self, num_classes: int, in_channels: int = 3, norm: str = "bn", conv: str = "plain"
    ):
        super().__init__()
        self.conv1 = make_conv(conv, in_channels, 16, 3, padding=1)
        self.norm1 = make_norm(norm, 16)
        self.conv2 = make_conv(conv, 16, 32, 3, padding=1)
        self.norm2 = make_norm(norm, 32)
        self.conv3 = make_conv(conv, 32, 64, 3, padding=1)
        self.norm3 = make_norm(norm, 64)
        self.classifier = nn.Linear(64, num_classes)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Features before the classifier, shape (B, 64)."""
        x = F.max_pool2d(F.relu(self.norm1(self.conv1(x))), 2)
        x = F.max_pool2d(F.relu(self.norm2(self.conv2(x))), 2)
        x = F.relu(self.norm3(self.conv3(x)))
        return global_avg_pool(x).flatten(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.encode(x))


def build_smallcnn(
    *, num_classes: int, in_channels: int, image_size: tuple[int, int], norm: str,
    conv: str = "plain",
) -> SmallCNN:
    """Registry builder: checks the image is at least 8 x 8."""
    h, w = image_size
    if min(h, w) < MIN_IMAGE_SIZE:
        raise MpiflError(
            f"SmallCNN needs images of at least {MIN_IMAGE_SIZE}x{MIN_IMAGE_SIZE} "
            f"but the data is {h}x{w}; prepare the dataset at a larger size"
        )
    return SmallCNN(num_classes, in_channels, norm, conv)
