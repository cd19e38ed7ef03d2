"""Generic model surgery: swap BatchNorm and Conv2d modules for mpifl's kinds.

Used on torchvision networks that have no hook for the layer in question
(DenseNet has no ``norm_layer`` argument; no torchvision model has a conv
hook) and available for any ``nn.Module``:

:func:`replace_norms`
    every BatchNorm module (``BatchNorm1d``/``BatchNorm2d``) becomes
    ``make_norm(kind, num_features, dims)`` under the **same attribute name**,
    so state-dict keys keep their prefixes (``features.norm0.weight`` stays,
    ``features.norm0.running_mean`` disappears for ``gn``, PerXAN adds
    ``features.norm0.bn.*`` / ``.inorm.*``).  Kinds undefined on vectors
    (``in``, ``perxan``) put ``nn.Identity`` after linear layers, as the
    models of this package do.  ``select(name)`` restricts the replacement to
    some layers (gPerXAN's paper replaces only the first blocks' BN layers;
    its public code, which mpifl's registry follows, replaces all).
    The BatchNorm inside a PerXAN layer is part of that layer and never
    touched.
:func:`replace_convs`
    every plain ``nn.Conv2d`` (exact type: WSConv/WNConv are left alone)
    becomes the ``kind`` class (``ws`` FedWon's WSConv2d, ``wn`` FedNN's
    WNConv2d) with the same in/out channels, kernel, stride, padding,
    dilation, groups (depthwise convs stay depthwise), bias and padding
    mode.  The new conv has its class's own initialisation (WSConv: Listing
    1's xavier normal) unless ``copy_weights=True``, which copies the old
    weight and bias in (keeping e.g. torchvision's kaiming-normal init).
:func:`set_input_channels`
    rebuilds the first convolution for another number of input channels.

Each returns the number of modules replaced; a fresh module is moved to the
device and floating dtype of the one it replaces.

:func:`insert_after` (with :func:`stage_outputs` and :func:`output_channels`)
    adds layers after named modules (MixStyle, FedFA's FFA layers) through
    forward hooks, leaving every existing module and state-dict key as it
    is; :func:`stage_outputs` names where each registered architecture ends
    a stage of its feature extractor.

:func:`place_composite_norms` (``--norm-blocks``)
    keeps the composite norm layers (PerXAN, IBN, DSON) of the first stages
    only and turns the later ones back into plain ``BatchNorm2d``.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from mpifl.errors import MpiflError
from mpifl.models.fednn import AdaptiveGroupNorm
from mpifl.models.norm import _CONVS, CONV_KINDS, make_norm, supports_vectors
from mpifl.models.dson import DSON
from mpifl.models.ibn import IBN
from mpifl.models.perxan import PerXAN

_COMPOSITE_NORMS = (PerXAN, IBN, AdaptiveGroupNorm)  # their inner BNs belong to them
_PLACED_NORMS = (PerXAN, IBN, DSON)  # the kinds place_composite_norms puts in the first stages


def _like(new: nn.Module, old: nn.Module) -> nn.Module:
    """Move ``new`` to the device and floating dtype of ``old``'s first float tensor."""
    for t in list(old.parameters()) + list(old.buffers()):
        if t.is_floating_point():
            return new.to(device=t.device, dtype=t.dtype)
    return new


def _bn_dims(bn: _BatchNorm) -> int:
    if isinstance(bn, nn.BatchNorm2d):
        return 2
    if isinstance(bn, nn.BatchNorm1d):
        return 1
    raise ValueError(f"replace_norms handles BatchNorm1d/2d, not {type(bn).__name__}")


def replace_norms(
    model: nn.Module, kind: str, *, select: Callable[[str], bool] | None = None
) -> int:
    """Replace every BatchNorm of ``model`` (or those whose name ``select`` accepts) by ``kind``.

    ``kind`` is a :data:`~mpifl.models.norm.NORM_KINDS` entry; ``"bn"`` leaves
    the model unchanged.  Names are the module names of ``named_modules()``
    (``"layer1.0.bn1"``).  Returns the number of layers replaced.
    """
    on_vectors = supports_vectors(kind)  # validates kind (MpiflError)
    if kind == "bn":
        return 0
    count = 0

    def visit(module: nn.Module, prefix: str) -> None:
        nonlocal count
        for name, child in list(module.named_children()):
            full = prefix + name
            if isinstance(child, _COMPOSITE_NORMS):
                continue
            if isinstance(child, _BatchNorm):
                if select is None or select(full):
                    dims = _bn_dims(child)
                    target = kind if dims == 2 or on_vectors else "none"
                    setattr(module, name, _like(make_norm(target, child.num_features, dims), child))
                    count += 1
                continue
            visit(child, full + ".")

    visit(model, "")
    return count


def _conv_class(kind: str) -> type[nn.Conv2d]:
    if kind not in CONV_KINDS:
        raise MpiflError(f"unknown conv {kind!r}; choose one of: {', '.join(CONV_KINDS)}")
    return _CONVS[kind]


def _rebuild_conv(
    cls: type[nn.Conv2d], old: nn.Conv2d, in_channels: int | None = None
) -> nn.Conv2d:
    return cls(
        old.in_channels if in_channels is None else in_channels,
        old.out_channels,
        old.kernel_size,
        stride=old.stride,
        padding=old.padding,
        dilation=old.dilation,
        groups=old.groups,
        bias=old.bias is not None,
        padding_mode=old.padding_mode,
    )


def replace_convs(model: nn.Module, kind: str, *, copy_weights: bool = False) -> int:
    """Replace every plain ``nn.Conv2d`` of ``model`` by the ``kind`` convolution.

    ``kind`` is a :data:`~mpifl.models.norm.CONV_KINDS` entry; ``"plain"``
    leaves the model unchanged.  With ``copy_weights`` the old ``weight`` (and
    ``bias``) are copied into the new conv.  Returns the number replaced.
    """
    cls = _conv_class(kind)
    if cls is nn.Conv2d:
        return 0
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Conv2d:
                new = _like(_rebuild_conv(cls, child), child)
                if copy_weights:
                    with torch.no_grad():
                        new.weight.copy_(child.weight)
                        if child.bias is not None:
                            new.bias.copy_(child.bias)
                setattr(parent, name, new)
                count += 1
    return count


def _kaiming_fan_out(weight: torch.Tensor) -> None:
    nn.init.kaiming_normal_(weight, mode="fan_out", nonlinearity="relu")


def set_input_channels(
    model: nn.Module,
    in_channels: int,
    init: Callable[[torch.Tensor], object] = _kaiming_fan_out,
) -> bool:
    """Rebuild ``model``'s first ``nn.Conv2d`` (module order) for ``in_channels`` inputs.

    Same class and hyperparameters; the weight is re-initialised by ``init``
    (default torchvision ResNet/MobileNetV2's ``kaiming_normal_(fan_out,
    relu)``), a bias, if any, set to zero.  Returns whether it changed
    anything (False when the conv already takes ``in_channels``).
    """
    if in_channels < 1:
        raise MpiflError(f"a model needs at least one input channel, got {in_channels}")
    for full, child in model.named_modules():
        if isinstance(child, nn.Conv2d):
            if child.in_channels == in_channels:
                return False
            if child.groups != 1:
                raise ValueError("the first convolution is grouped; cannot change its inputs")
            owner, _, name = full.rpartition(".")
            new = _like(_rebuild_conv(type(child), child, in_channels), child)
            init(new.weight)
            if new.bias is not None:
                nn.init.zeros_(new.bias)
            setattr(model.get_submodule(owner), name, new)
            return True
    raise ValueError("model has no Conv2d")


# ------------------------------------------------------------------ inserted layers
# Where each registered architecture ends a stage of its feature extractor (module names, in
# forward order): the positions methods insert layers after (MixStyle, FedFA's FFA layers).
# A stage is a residual stage (ResNets: layer1..; MobileNetV2: the last block of each
# resolution, torchvision ``features`` indices 3, 6, 13 and the final 1x1 conv 18; DenseNet:
# each dense block with its transition, the last one up to ``norm5``) or a conv block
# (AlexNet: conv-norm-ReLU[-pool], the FedFA code's positions).  mpifl's small CNNs apply
# ReLU and pooling functionally, so their blocks end, as modules, at the norm layer: the
# inserted layer then sees the normalized map before the ReLU.
_STAGES: dict[str, tuple[str, ...]] = {
    "SmallCNN": ("norm1", "norm2", "norm3"),
    "DigitModel": ("bn1", "bn2", "bn3"),
    "LeNet": ("bn1", "bn2"),
    "AlexNet": ("features.maxpool1", "features.maxpool2", "features.relu3", "features.relu4",
                "features.maxpool5"),
    "CifarResNet": ("layer1", "layer2", "layer3"),
    "ResNetFL": ("layer1", "layer2", "layer3", "layer4"),
    "MobileNetV2FL": ("features.3", "features.6", "features.13", "features.18"),
    "DenseNetFL": ("features.transition1", "features.transition2", "features.transition3",
                   "features.norm5"),
    "UNet": ("pool1", "pool2", "pool3", "pool4", "bottleneck"),  # the encoder's stages, as FedFA's U-Net code
}


def stage_outputs(model: nn.Module) -> list[str]:
    """Names of the modules whose outputs end the stages of ``model``'s feature extractor, in forward order.

    Defined for the registered architectures (by class); another model raises :class:`MpiflError`.
    """
    names = _STAGES.get(type(model).__name__)
    if names is None:
        raise MpiflError(f"no stage positions are known for {type(model).__name__}; "
                         f"known: {', '.join(sorted(_STAGES))}")
    modules = dict(model.named_modules())
    missing = [n for n in names if n not in modules]
    if missing:
        raise MpiflError(f"{type(model).__name__} has no module {', '.join(missing)}")
    return list(names)


def output_channels(model: nn.Module, name: str) -> int:
    """Channels of the map module ``name`` outputs: those of the last conv or norm at or inside it,
    or before it in module order (a pool or ReLU keeps the channels of what precedes it)."""
    channels = None
    inside = False
    for full, module in model.named_modules():
        if inside and not full.startswith(name + "."):
            break
        if full == name:
            inside = True
        for attr in ("out_channels", "num_features", "num_channels"):
            value = getattr(module, attr, None)
            if isinstance(value, int):
                channels = value
                break
    if not inside:
        raise MpiflError(f"{type(model).__name__} has no module {name!r}")
    if channels is None:
        raise MpiflError(f"no conv or norm layer at or before {name!r} tells its channels")
    return channels


class _ApplyAfter:
    """Forward hook ``output -> layer(output)``; a plain object, so ``copy.deepcopy`` of the model
    maps it to the copied layer."""

    def __init__(self, layer: nn.Module):
        self.layer = layer

    def __call__(self, module: nn.Module, inputs, output):
        return self.layer(output)


def insert_after(model: nn.Module, names: list[str], make: Callable[[int], nn.Module], attr: str) -> nn.ModuleList:
    """After each module of ``names``, apply a new layer ``make(channels)`` to its output.

    The layers are registered as ``model.<attr>`` (an ``nn.ModuleList`` in the order of ``names``,
    so their state-dict keys are ``<attr>.<i>.*``) and called by forward hooks on the named modules:
    the existing modules and their state-dict keys are untouched (a pretrained checkpoint still
    loads).  A named module must run once per forward pass.  ``make`` must not draw random numbers
    (the model is built seeded, identically on every rank).
    """
    if hasattr(model, attr):
        raise ValueError(f"{type(model).__name__} already has an attribute {attr!r}")
    layers = nn.ModuleList(make(output_channels(model, n)) for n in names)
    layers.inserted_after = tuple(names)  # where each layer acts: its block (mpifl.models.structure)
    model.add_module(attr, layers)
    for name, layer in zip(names, layers):
        model.get_submodule(name).register_forward_hook(_ApplyAfter(layer))
    return layers


# ------------------------------------------------------------------ composite norm placement
def default_norm_blocks(model: nn.Module) -> str:
    """``--norm-blocks auto``: ``all`` for PerXAN and DSON (their authors' code replaces every BN); for IBN,
    every stage but the last (IBN-a: IBN in ResNet's conv2_x..conv4_x, not conv5_x), at least one."""
    if any(isinstance(m, IBN) for m in model.modules()):
        return str(max(len(stage_outputs(model)) - 1, 1))
    return "all"


def _first_stages(model: nn.Module, blocks: str, flag: str) -> set[str] | None:
    """Names of the modules up to the end of stage ``blocks`` (the stem included); None for ``all``."""
    if blocks == "all":
        return None
    ends = stage_outputs(model)
    if not blocks.isdigit() or not 1 <= int(blocks) <= len(ends):
        raise MpiflError(f"{flag} must be auto, all or a number of stages from 1 to {len(ends)} for "
                         f"{type(model).__name__}, got {blocks!r}")
    last = ends[int(blocks) - 1]
    names = [n for n, _ in model.named_modules()]
    cut = max(i for i, n in enumerate(names) if n == last or n.startswith(last + "."))
    return set(names[: cut + 1])


def _residual_first_norms(model: nn.Module) -> set[str]:
    """``<block>.bn1`` of every residual block (a submodule with ``bn1`` and ``bn2``: torchvision's
    BasicBlock and Bottleneck, the CIFAR ResNet's block)."""
    return {f"{name}.bn1" for name, m in model.named_modules()
            if name and hasattr(m, "bn1") and hasattr(m, "bn2")}


def place_composite_norms(model: nn.Module, blocks: str, flag: str) -> nn.Module:
    """Keep PerXAN, IBN and DSON layers where ``blocks`` puts them, plain ``BatchNorm2d`` elsewhere.

    ``blocks``: ``auto`` (:func:`default_norm_blocks`), ``all``, or ``N``: the stem and the first ``N``
    stages of :func:`stage_outputs`.  IBN follows IBN-a inside those stages: in a model with residual
    blocks only each block's first norm (``bn1``) is IBN and the stem's norm stays BN; in a plain CNN,
    DenseNet or MobileNetV2 every norm of those stages is IBN.  A ``blocks`` other than ``auto`` on a
    model without such layers is a one-line error naming ``flag``.
    """
    layers = [(name, m) for name, m in model.named_modules() if isinstance(m, _PLACED_NORMS)]
    if not layers:
        if blocks != "auto":
            raise MpiflError(f"{flag} places perxan, ibn and dson layers and this model has none; "
                             f"drop {flag} or pick one of those with --norm")
        return model
    text = default_norm_blocks(model) if blocks == "auto" else blocks.strip()
    kept = _first_stages(model, text, flag)
    residual = _residual_first_norms(model)
    for name, layer in layers:
        in_stages = kept is None or name in kept
        ibn_here = not isinstance(layer, IBN) or not residual or name in residual
        if not (in_stages and ibn_here):
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, _like(nn.BatchNorm2d(layer.num_features), layer))
    return model
