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
    only and turns the later ones back into plain ``BatchNorm2d``; IBN layers
    only at the architecture's IBN-a sites (:func:`ibn_sites`: IBN-Net's
    builders for ResNet and DenseNet, a stated rule for the others).
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
    every stage but the last (IBN-Net's builders: ResNet ``ibn_cfg=('a', 'a', 'a', None)``, DenseNet
    dense blocks 1-3 of 4), at least one."""
    if any(isinstance(m, IBN) for m in model.modules()):
        return str(max(len(stage_outputs(model)) - 1, 1))
    return "all"


# The modules before the first stage of :data:`_STAGES` (the stem), for ``--norm-blocks N-nostem``; an
# architecture not listed has no stem (its first stage starts at its first layer).
_STEMS: dict[str, tuple[str, ...]] = {
    "CifarResNet": ("conv1", "bn1"),
    "ResNetFL": ("conv1", "bn1", "relu", "maxpool"),
    "MobileNetV2FL": ("features.0",),
    "DenseNetFL": ("features.conv0", "features.norm0", "features.relu0", "features.pool0"),
}
NO_STEM = "-nostem"  # --norm-blocks N-nostem: the first N stages without the stem


def _first_stages(model: nn.Module, blocks: str, flag: str) -> set[str] | None:
    """Names of the modules up to the end of stage N, the stem included (``N``) or left out (``N-nostem``);
    None for ``all``."""
    if blocks == "all":
        return None
    ends = stage_outputs(model)
    count = blocks.removesuffix(NO_STEM)
    if not count.isdigit() or not 1 <= int(count) <= len(ends):
        raise MpiflError(f"{flag} must be auto, all, N or N{NO_STEM} with N a number of stages from 1 to "
                         f"{len(ends)} for {type(model).__name__}, got {blocks!r}")
    last = ends[int(count) - 1]
    names = [n for n, _ in model.named_modules()]
    cut = max(i for i, n in enumerate(names) if n == last or n.startswith(last + "."))
    kept = set(names[: cut + 1])
    if count == blocks:
        return kept
    stem = _STEMS.get(type(model).__name__)
    if stem is None:
        raise MpiflError(f"{flag} {blocks}: {type(model).__name__} has no stem before its first stage; "
                         f"pass {flag} {count}")
    return {n for n in kept if not any(n == s or n.startswith(s + ".") for s in stem)}


_DENSE_IN_RATIO = 0.4  # ibnnet/densenet_ibn.py: IBN(num_input_features, 0.4)


def _half_first(channels: int) -> tuple[int, bool]:
    """IBN-Net ``modules.py`` ``IBN(planes)``: IN on the first ``int(planes * 0.5)`` channels."""
    return channels // 2, True


def _dense_last(channels: int) -> tuple[int, bool]:
    """IBN-Net ``densenet_ibn.py`` ``IBN(planes, 0.4)``: BN on the first ``int(planes * 0.6)``, IN on the rest."""
    return channels - int(channels * (1 - _DENSE_IN_RATIO)), False


def _residual_first_norms(model: nn.Module) -> list[str]:
    """``<stage>.<block>.bn1`` of every residual block (torchvision's BasicBlock and Bottleneck, the
    CIFAR ResNet's block), ``layerS.B.bn1``."""
    return [name for name, _ in model.named_modules()
            if name.startswith("layer") and name.count(".") == 2 and name.endswith(".bn1")]


def _inverted_residual_first_norms(model: nn.Module) -> list[str]:
    """``features.K.conv.0.1``: the first norm of every MobileNetV2 inverted-residual block."""
    return [f"{name}.conv.0.1" for name, m in model.named_modules() if type(m).__name__ == "InvertedResidual"]


def _every_third_dense_layer_norm1(model: nn.Module) -> list[str]:
    """``norm1`` of dense layers 1, 4, 7, ... of every dense block (``i % 3 == 0``, i from 0)."""
    names = []
    for name, _ in model.named_modules():
        parts = name.split(".")
        if (len(parts) == 4 and parts[1].startswith("denseblock") and parts[2].startswith("denselayer")
                and parts[3] == "norm1" and (int(parts[2][len("denselayer"):]) - 1) % 3 == 0):
            names.append(name)
    return names


def _every_conv_norm(model: nn.Module) -> list[str]:
    """Every 2-D norm layer: IBN layers and plain ``BatchNorm2d`` (not the BN half inside an IBN)."""
    names: list[str] = []
    for name, m in model.named_modules():
        if names and name.startswith(names[-1] + "."):
            continue  # inside the IBN layer listed just before
        if isinstance(m, (IBN, nn.BatchNorm2d)):
            names.append(name)
    return names


#: architecture (class name) -> (its IBN-a site names, the split of a site with C channels): :func:`ibn_sites`
_IBN_RULES: dict[str, tuple[Callable[[nn.Module], list[str]], Callable[[int], tuple[int, bool]]]] = {
    "ResNetFL": (_residual_first_norms, _half_first),
    "CifarResNet": (_residual_first_norms, _half_first),
    "DenseNetFL": (_every_third_dense_layer_norm1, _dense_last),
    "MobileNetV2FL": (_inverted_residual_first_norms, _half_first),
    "SmallCNN": (_every_conv_norm, _half_first),
    "DigitModel": (_every_conv_norm, _half_first),
    "LeNet": (_every_conv_norm, _half_first),
    "AlexNet": (_every_conv_norm, _half_first),
    "UNet": (_every_conv_norm, _half_first),
}


def ibn_sites(model: nn.Module) -> dict[str, tuple[int, bool]]:
    """IBN-a's sites in ``model``, every stage counted: norm module name -> (IN channels, whether they
    are the layer's first channels), by the architecture's rule (:data:`_IBN_RULES`).

    IBN-Net's code (github.com/XingangPan/IBN-Net, ``ibnnet/``) has a builder per family, each with its
    own rule:

    * ``resnet_ibn.py`` (ResNet-18/34/50/101/152-IBN-a; ``resnext_ibn.py`` and ``se_resnet_ibn.py`` the
      same): ``bn1`` of every BasicBlock/Bottleneck of layer1-layer3 is ``IBN(planes)`` of
      ``modules.py``, IN (affine) on the first ``int(planes * 0.5)`` channels, BN on the rest; the
      stem's ``bn1``, every ``bn2``/``bn3``, the downsample BNs and all of layer4 stay BN.
    * ``densenet_ibn.py`` (DenseNet-121/169/201/161-IBN-a): in dense blocks 1-3, ``norm1`` of every
      third dense layer (``denselayer1``, ``4``, ``7``, ...: ``i % 3 == 0`` counting from 0) is that
      file's own ``IBN(C, 0.4)``: BN on the *first* ``int(C * (1 - 0.4))`` channels, IN (affine) on the
      remaining ones (the newest dense-layer outputs); ``norm0``, every ``norm2``, the transitions,
      block 4 and ``norm5`` stay BN.  DenseNet-121: 14 IBN layers.

    mpifl follows those two rules on its torchvision ResNet-18/50 and DenseNet-121.  For the registry's
    other architectures, which IBN-Net has no builder for, the rules chosen are:

    * CIFAR ResNet-20: the ResNet rule, ``bn1`` of each residual block, ``C // 2`` IN channels first.
    * MobileNetV2: the ResNet rule on its inverted-residual blocks: the first norm of each block
      (``features.K.conv.0.1``: the expansion 1x1 conv's, or the depthwise conv's in block 1, which
      has no expansion), ``C // 2`` IN channels first; the stem ``features.0``, the other norms of
      each block and the final ``features.18`` stay BN.
    * plain CNNs (SmallCNN, DigitModel, LeNet, AlexNet) and the U-Net: every 2-D conv norm (a conv
      block has no residual branch to pick a first norm of), ``C // 2`` IN channels first; norms
      after linear layers are plain BN anyway.

    Which *stages* hold those sites is ``--norm-blocks`` (:func:`place_composite_norms`); ``auto`` is
    every stage but the last, as IBN-Net's builders.  Defined for the registered architectures (by
    class); another model raises :class:`MpiflError`.
    """
    rule = _IBN_RULES.get(type(model).__name__)
    if rule is None:
        raise MpiflError(f"no IBN-a placement is known for {type(model).__name__}; "
                         f"known: {', '.join(sorted(_IBN_RULES))}")
    sites, split = rule
    modules = dict(model.named_modules())
    return {name: split(modules[name].num_features) for name in sites(model)}


def place_composite_norms(model: nn.Module, blocks: str, flag: str) -> nn.Module:
    """Keep PerXAN, IBN and DSON layers where ``blocks`` puts them, plain ``BatchNorm2d`` elsewhere.

    ``blocks``: ``auto`` (:func:`default_norm_blocks`), ``all``, ``N``: the stem and the first ``N``
    stages of :func:`stage_outputs`, or ``N-nostem``: those stages without the stem (:data:`_STEMS`: the
    modules before the first stage, e.g. DenseNet's ``conv0``/``norm0``/``relu0``/``pool0``).  PerXAN and
    DSON fill those stages.  IBN stands only at the architecture's IBN-a sites inside them
    (:func:`ibn_sites`: IBN-Net's builders for ResNet and DenseNet, the rule stated there for the others),
    rebuilt with that site's split (DenseNet: IN on the last 40 % of the channels).  A ``blocks`` other
    than ``auto`` on a model without such layers is a one-line error naming ``flag``.
    """
    layers = [(name, m) for name, m in model.named_modules() if isinstance(m, _PLACED_NORMS)]
    if not layers:
        if blocks != "auto":
            raise MpiflError(f"{flag} places perxan, ibn and dson layers and this model has none; "
                             f"drop {flag} or pick one of those with --norm")
        return model
    text = default_norm_blocks(model) if blocks == "auto" else blocks.strip()
    kept = _first_stages(model, text, flag)
    sites = ibn_sites(model) if any(isinstance(m, IBN) for _, m in layers) else {}
    for name, layer in layers:
        in_stages = kept is None or name in kept
        owner, _, attr = name.rpartition(".")
        if isinstance(layer, IBN) and in_stages and name in sites:
            if layer.split != sites[name]:
                setattr(model.get_submodule(owner), attr, _like(IBN(layer.num_features, *sites[name]), layer))
        elif not in_stages or isinstance(layer, IBN):
            setattr(model.get_submodule(owner), attr, _like(nn.BatchNorm2d(layer.num_features), layer))
    return model
