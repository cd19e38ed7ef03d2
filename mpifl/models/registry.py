"""Model registry: ``--model NAME`` -> a built ``nn.Module``.

Every model follows one protocol (algorithms pick the norm and share by
state-dict key, docs/methods.md, "What a method reads"): ``encode(x)`` returns the (B, D) features
before the final classifier, ``classifier`` is that final ``nn.Linear``, and
``forward(x) == classifier(encode(x))``; the segmentation ``unet`` gives (B, D, H, W)
maps and a 1x1 conv ``classifier`` (per-pixel logits).  Weights use torch's default
initialisation, so a model is reproducible under ``torch.manual_seed``.

:data:`_MODELS` maps name -> (builder, one-line description); new models are
new rows.
"""

from __future__ import annotations

from typing import Callable

from torch import nn

from mpifl.errors import MpiflError
from mpifl.models.alexnet import build_alexnet, build_alexnet_dropout
from mpifl.models.digitmodel import build_digitmodel, build_fedwon_cnn
from mpifl.models.lenet import build_lenet
from mpifl.models.resnet_cifar import build_resnet20
from mpifl.models.smallcnn import build_smallcnn
from mpifl.models.unet import build_unet


def _torchvision_builder(name: str) -> Callable[..., nn.Module]:
    """``mpifl.models.tv.<name>``, imported on first use.

    Importing torchvision costs seconds per process; only a process that builds
    a torchvision model pays it.
    """

    def build(**kwargs) -> nn.Module:
        from mpifl.models import tv

        return getattr(tv, name)(**kwargs)

    build.__name__ = build.__qualname__ = name
    return build


_MODELS: dict[str, tuple[Callable[..., nn.Module], str]] = {
    "digitmodel": (
        build_digitmodel,
        "FedBN's Digits CNN, conv 64-64-128 5x5 + fc 6272-2048-512, 28x28 only",
    ),
    "fedwon-cnn": (
        build_fedwon_cnn,
        "FedWon's six-layer CNN (Table 5): digitmodel with Dropout instead of norms between its FCs, 28x28 only",
    ),
    "smallcnn": (
        build_smallcnn,
        "small 3-conv CNN (16-32-64) with global pooling, any size >= 8x8",
    ),
    "alexnet": (
        build_alexnet,
        "FedBN/FedRDN AlexNet, norm after every conv and after fc1/fc2, >= 63x63 (papers: 256)",
    ),
    "alexnet-dropout": (
        build_alexnet_dropout,
        "FedWon's AlexNet (Table 6): norm after convs only, Dropout before fc1/fc2, >= 63x63",
    ),
    "lenet": (
        build_lenet,
        "FedNN's LeNet, conv 64-64 5x5 (norm after each) + fc 1600-384-192, 32x32 only",
    ),
    "resnet20": (
        build_resnet20,
        "CIFAR ResNet-20 (16-32-64, option-A shortcuts, He et al. 4.2), any size >= 8x8",
    ),
    "resnet18": (
        _torchvision_builder("build_resnet18"),
        "torchvision ResNet-18 (torchvision keys), >= 32x32 (33 with in/perxan; papers: 224/256)",
    ),
    "resnet50": (
        _torchvision_builder("build_resnet50"),
        "torchvision ResNet-50 (torchvision keys), >= 32x32 (33 with in/perxan; gPerXAN: 224)",
    ),
    "mobilenetv2": (
        _torchvision_builder("build_mobilenetv2"),
        "torchvision MobileNetV2 (head key classifier.1 -> classifier), >= 32x32 (33: in/perxan)",
    ),
    "densenet121": (
        _torchvision_builder("build_densenet121"),
        "torchvision DenseNet-121 (torchvision keys), >= 32x32 (61 with in/perxan; gPerXAN: 96)",
    ),
    "unet": (
        build_unet,
        "HarmoFL/FedFA prostate 2D U-Net (32-512, 4 poolings), per-pixel logits, sides multiples of 16 (papers: 384)",
    ),
}

MODEL_NAMES: tuple[str, ...] = tuple(_MODELS)
MODEL_DESCRIPTIONS: dict[str, str] = {name: desc for name, (_, desc) in _MODELS.items()}


def build_model(
    name: str,
    *,
    num_classes: int,
    in_channels: int = 3,
    image_size: tuple[int, int] = (28, 28),
    norm: str = "bn",
    conv: str = "plain",
) -> nn.Module:
    """Build model ``name`` with the given head size, input, normalization and conv kind.

    ``norm`` is a :data:`~mpifl.models.norm.NORM_KINDS` entry, ``conv`` a
    :data:`~mpifl.models.norm.CONV_KINDS` one (FedWon: ``norm="none",
    conv="ws"``; FedNN: ``norm="agn", conv="wn"``; gPerXAN: ``norm="perxan"``).
    """
    if name not in _MODELS:
        raise MpiflError(
            f"unknown model {name!r}; choose one of: {', '.join(MODEL_NAMES)}"
        )
    builder, _ = _MODELS[name]
    return builder(
        num_classes=num_classes,
        in_channels=in_channels,
        image_size=tuple(image_size),
        norm=norm,
        conv=conv,
    )
