"""Model structure for share policies: a model's blocks in forward order, the last one its head.

A *block* is what a share policy counts as one layer: a conv or linear layer with the normalization
after it, a residual stage, a dense block or transition, an inverted-residual block; the *head* is the
block of the final classifier (``model.classifier``).  Head-based personalization (LG-FedAvg, FedPer,
FedRep, FedBABU) and stage-wise rules read it from :class:`~mpifl.models.entries.StateEntry`'s
``block``, ``depth`` (position from 0, forward order) and ``is_head``.

Every registry architecture declares its blocks below (:data:`_BLOCKS`: groups of module names, forward
order), because registration order is not forward order (LeNet registers ``bn1`` and ``bn2`` after its
linear layers) and grouping is the architecture's (a ResNet stage holds many layers).  Another model's
blocks are its top-level children that hold state, in registration order.  Layers inserted after a
module (:func:`~mpifl.models.surgery.insert_after`: MixStyle, FedFA) belong to that module's block.
"""

from __future__ import annotations

from torch import nn

from mpifl.errors import MpiflError

_BLOCKS: dict[str, tuple[tuple[str, ...], ...]] = {
    "SmallCNN": (("conv1", "norm1"), ("conv2", "norm2"), ("conv3", "norm3"), ("classifier",)),
    "DigitModel": (("conv1", "bn1"), ("conv2", "bn2"), ("conv3", "bn3"), ("fc1", "bn4"), ("fc2", "bn5"), ("fc3",)),
    "LeNet": (("conv1", "bn1"), ("conv2", "bn2"), ("fc1",), ("fc2",), ("fc3",)),
    "AlexNet": tuple(tuple(f"features.{m}{i}" for m in ("conv", "bn", "relu", "maxpool")) for i in range(1, 6))
    + (("fc1", "bn6"), ("fc2", "bn7"), ("fc3",)),  # a conv block's ReLU and pool: FedFA's layers go after them
    "CifarResNet": (("conv1", "bn1"), ("layer1",), ("layer2",), ("layer3",), ("fc",)),
    "ResNetFL": (("conv1", "bn1"), ("layer1",), ("layer2",), ("layer3",), ("layer4",), ("fc",)),
    "MobileNetV2FL": tuple((f"features.{i}",) for i in range(19)) + (("classifier",),),
    "DenseNetFL": (("features.conv0", "features.norm0"),)
    + tuple((f"features.{part}{i}",) for i in range(1, 4) for part in ("denseblock", "transition"))
    + (("features.denseblock4",), ("features.norm5",), ("classifier",)),
    "UNet": tuple((f"enc{i}", f"pool{i}") for i in range(1, 5)) + (("bottleneck",),)
    + tuple((f"up{i}",) for i in range(4, 0, -1)) + (("classifier",),),
}


def blocks(model: nn.Module) -> list[tuple[str, ...]]:
    """The model's blocks in forward order, each a group of module names; the last is the head."""
    declared = _BLOCKS.get(type(model).__name__)
    if declared is not None:
        return [tuple(group) for group in declared]
    return [(name,) for name, child in model.named_children()
            if next(child.parameters(), None) is not None or next(child.buffers(), None) is not None]


def block_of_keys(model: nn.Module, keys: list[str]) -> dict[str, tuple[str, int]]:
    """{state-dict key: (block name, depth)}: the block is named by its first module; a key of an inserted
    layer (``<attr>.<i>.*`` after module ``after[i]``) goes with that module."""
    groups = blocks(model)
    owner = {name: (group[0], depth) for depth, group in enumerate(groups) for name in group}
    inserted = {f"{attr}.{i}": after for attr, layers in model.named_children()
                for i, after in enumerate(getattr(layers, "inserted_after", ()))}
    out = {}
    for key in keys:
        module = next((a for prefix, a in inserted.items() if key.startswith(prefix + ".")), key)
        parts = module.split(".")
        found = next((owner[".".join(parts[:n])] for n in range(len(parts), 0, -1) if ".".join(parts[:n]) in owner),
                     None)
        if found is None:
            raise ValueError(f"{type(model).__name__}: state entry {key} belongs to none of its blocks "
                             f"{[g[0] for g in groups]}; declare them in mpifl/models/structure.py")
        out[key] = found
    return out


def head_name(model: nn.Module) -> str:
    """The module name of ``model.classifier`` (``fc`` in torchvision's ResNets, ``fc3`` in AlexNet ...)."""
    return next(name for name, module in model.named_modules() if module is model.classifier)


def last_blocks(entries, n: int, flag: str) -> set[str]:
    """The names of the last ``n`` blocks of a model's entries (``n = 1``: the head); past the model's number
    of blocks, a one-line error naming the option ``flag`` that asked for them."""
    depth = {e.block: e.depth for e in entries}
    order = sorted(depth, key=depth.get)
    if not 1 <= n <= len(order):
        raise MpiflError(f"{flag}: the model has {len(order)} blocks, asked for the last {n}; "
                         "pass a number from 1 (the classifier)")
    return set(order[-n:])
