"""2D U-Net for segmentation (Ronneberger, Fischer & Brox, MICCAI 2015) as the prostate MRI code of the FL papers builds it.

FedRDN's Table 2 (Yan, Fu, Li, Xie, Ma, Yang & Zhu, 2023, arXiv: multi-site prostate MRI) trains a U-Net; its
authors' public code (``IAMJackYan/FedRDN``) holds the classification experiments only, so the network follows
the U-Net of the code its segmentation setting comes from: HarmoFL's
(Jiang, Wang & Dou, AAAI 2022, ``nets/models.py`` ``UNet``) and FedFA's (Zhou & Konukoglu, ICLR 2023,
``pyfed/network/unet.py`` ``UNet``), the same architecture::

    enc1   DoubleConv(in -> w)        pool1 maxpool 2x2
    enc2   DoubleConv(w -> 2w)        pool2 maxpool 2x2
    enc3   DoubleConv(2w -> 4w)       pool3 maxpool 2x2
    enc4   DoubleConv(4w -> 8w)       pool4 maxpool 2x2
    bottleneck DoubleConv(8w -> 16w)
    up4    ConvTranspose 2x2/2 (16w -> 8w), concat [up, enc4] -> DoubleConv(16w -> 8w)
    up3, up2, up1 likewise down to w channels
    classifier 1x1 conv w -> num_classes: per-pixel logits (N, num_classes, H, W)

    DoubleConv(a -> b) = conv3x3(a -> b) norm ReLU conv3x3(b -> b) norm ReLU

with ``w = 32`` and depth 4 (widths 32-64-128-256, bottleneck 512; 7,763,074 parameters with BN, 3 input
channels and 2 classes, as FedFA's code).
3x3 convs are padded and have no bias; transposed convs and the classifier have a bias; torch's default
initialisation (neither code re-initialises).  ``encode(x)`` is the last decoder map (N, w, H, W);
``forward(x) == classifier(encode(x))``.  Input: (N, in_channels, H, W) with H and W multiples of
``2**depth`` (16), so every pooled map concatenates with its up-sampled partner; other sizes raise
``ValueError``.  The papers' size is 384 x 384 (three adjacent slices as channels).

Choices where the reference is silent or differs between the two codes:

* ``norm="bn"`` is FedFA's BatchNorm (affine, running statistics, torch's defaults); HarmoFL's code uses
  BatchNorm without affine and without running statistics (batch statistics at test time too) behind its
  amplitude-normalization input layer, which is HarmoFL's method and not part of this model.  Any mpifl norm
  kind goes where the BNs are; the least side is 16 (32 with ``in``, ``perxan``, ``ibn``, ``dson``, whose
  instance statistics need a 2 x 2 bottleneck map).
* ``conv`` (``plain``, FedWon's ``ws``, FedNN's ``wn``) is the kind of the 3x3 convs.  The transposed
  up-sampling convs stay ``nn.ConvTranspose2d`` (no weight-standardized or weight-normalized transposed conv
  exists in the papers) and the 1x1 classifier a plain ``nn.Conv2d`` (as the classification models keep a
  plain ``nn.Linear`` head); 3x3 convs stay bias-free with ``norm="none"`` too.
* Module names are mpifl's (``encK.conv1``, ``encK.norm1``, ``upK.up``, ``upK.block.*``, ``classifier``),
  registered in forward order, each pool its own module (``poolK``) so a layer can be inserted after it, as
  FedFA's code puts its FFA layers after the pools and the bottleneck.  The state-dict entries correspond one
  to one, in order and shape, to those of FedFA's ``UNet``.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from mpifl.errors import MpiflError
from mpifl.models.checks import INSTANCE_NORMS, check_kinds
from mpifl.models.norm import make_conv, make_norm

WIDTH = 32
DEPTH = 4
PAPER_SIZE = 384


class DoubleConv(nn.Module):
    """conv3x3 -> norm -> ReLU -> conv3x3 -> norm -> ReLU, padded (size kept), convs without bias."""

    def __init__(self, in_channels: int, out_channels: int, norm: str, conv: str):
        super().__init__()
        self.conv1 = make_conv(conv, in_channels, out_channels, 3, 1, 1, bias=False)
        self.norm1 = make_norm(norm, out_channels)
        self.conv2 = make_conv(conv, out_channels, out_channels, 3, 1, 1, bias=False)
        self.norm2 = make_norm(norm, out_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.norm1(self.conv1(x)))
        return F.relu(self.norm2(self.conv2(x)))


class UpStage(nn.Module):
    """``block(cat([up(x), skip], dim=1))``: a 2x2 stride-2 transposed conv (in -> out), then DoubleConv(2 out -> out)."""

    def __init__(self, in_channels: int, out_channels: int, norm: str, conv: str):
        super().__init__()
        self.up = nn.ConvTranspose2d(in_channels, out_channels, 2, stride=2)
        self.block = DoubleConv(2 * out_channels, out_channels, norm, conv)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        return self.block(torch.cat([self.up(x), skip], dim=1))


class UNet(nn.Module):
    """U-Net of ``depth`` poolings, encoder widths ``width * 2**i`` (i = 0..depth-1), bottleneck ``width * 2**depth``."""

    def __init__(
        self, num_classes: int, in_channels: int = 3, norm: str = "bn", conv: str = "plain",
        width: int = WIDTH, depth: int = DEPTH,
    ):  # fmt: skip
        super().__init__()
        if depth < 1 or width < 1:
            raise ValueError(f"depth and width must be positive, got depth {depth}, width {width}")
        self.depth = depth
        widths = [width * 2**i for i in range(depth + 1)]
        previous = in_channels
        for i in range(1, depth + 1):
            setattr(self, f"enc{i}", DoubleConv(previous, widths[i - 1], norm, conv))
            setattr(self, f"pool{i}", nn.MaxPool2d(2))
            previous = widths[i - 1]
        self.bottleneck = DoubleConv(widths[depth - 1], widths[depth], norm, conv)
        for i in range(depth, 0, -1):
            setattr(self, f"up{i}", UpStage(widths[i], widths[i - 1], norm, conv))
        self.classifier = nn.Conv2d(width, num_classes, 1)

    def _check_input(self, x: torch.Tensor) -> None:
        multiple = 2**self.depth
        if x.dim() != 4 or x.shape[-2] % multiple or x.shape[-1] % multiple:
            raise ValueError(f"UNet of depth {self.depth} takes (N, C, H, W) with H and W multiples of {multiple}, "
                             f"got shape {tuple(x.shape)}")

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """The last decoder map, shape (N, width, H, W)."""
        self._check_input(x)
        skips = []
        for i in range(1, self.depth + 1):
            x = getattr(self, f"enc{i}")(x)
            skips.append(x)
            x = getattr(self, f"pool{i}")(x)
        x = self.bottleneck(x)
        for i in range(self.depth, 0, -1):
            x = getattr(self, f"up{i}")(x, skips[i - 1])
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.encode(x))


def least_side(norm: str) -> int:
    """Smallest input side: one multiple of 16 (two with instance-statistics norms, for a 2 x 2 bottleneck)."""
    multiple = 2**DEPTH
    return 2 * multiple if norm in INSTANCE_NORMS else multiple


def build_unet(
    *, num_classes: int, in_channels: int, image_size: tuple[int, int], norm: str, conv: str = "plain",
) -> UNet:
    """Registry builder for ``unet``: sides multiples of 16, at least :func:`least_side`."""
    check_kinds(norm, conv)
    h, w = image_size
    least, multiple = least_side(norm), 2**DEPTH
    if h % multiple or w % multiple or min(h, w) < least:
        raise MpiflError(
            f"model unet needs image sides that are multiples of {multiple} and at least {least} (norm {norm!r}) "
            f"but the data is {h}x{w}; prepare the dataset at such a size "
            f"(python -m mpifl.data prepare NAME --size {max(least, PAPER_SIZE)})"
        )
    return UNet(num_classes, in_channels, norm, conv)
