"""State-dict entries classified by the module that owns them.

Share policies (docs/methods.md, "What a method reads") are rules over state-dict entries:
"FedBN: every BN entry stays local", "SiloBN: BN running statistics stay
local", "``num_batches_tracked`` is never averaged" (docs/design.md, "How a round is computed").
:func:`state_entries` gives one :class:`StateEntry` per key of
``model.state_dict()``, in that order, with the kind of the owning module.

Composite norm layers: every entry inside a gPerXAN layer (its ``bn.*``,
``inorm.*``, ``bn_score``, ``in_score``) has ``module_kind="perxan"`` and
``part`` ``"bn"`` or ``"in"`` for its side (:mod:`mpifl.models.perxan`); an
IBN-a layer's are ``"ibn"`` with the BN half ``"bn"`` and the IN half ``"in"``
(:mod:`mpifl.models.ibn`); a DSON layer's are ``"dson"``, all ``"bn"``
(domain-specific, :mod:`mpifl.models.dson`).  So generic BN rules do not
catch a BN side by accident, and :attr:`StateEntry.is_bn_side` names it.  FedNN's AGN layers are
``"agn"``; FedWon's WSConv and FedNN's WN conv are ``"conv"`` (attribute
``gain`` for WSConv's gain).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.conv import _ConvNd
from torch.nn.modules.instancenorm import _InstanceNorm

from mpifl.models.dson import DSON
from mpifl.models.fednn import AdaptiveGroupNorm
from mpifl.models.ibn import IBN
from mpifl.models.perxan import PerXAN
from mpifl.models.structure import block_of_keys, head_name

#: composite norm layers (their entries carry a ``part``) and their kinds
COMPOSITE_MODULES: dict[type[nn.Module], str] = {PerXAN: "perxan", IBN: "ibn", DSON: "dson"}
NORM_MODULE_KINDS = frozenset({"bn", "gn", "ln", "in", "agn", *COMPOSITE_MODULES.values()})
BN_STATS = frozenset({"running_mean", "running_var", "num_batches_tracked"})


@dataclass(frozen=True)
class StateEntry:
    """One state-dict entry: its key, owning module kind and tensor metadata."""

    key: str
    module_kind: str  # bn, gn, ln, in, perxan, ibn, dson, agn, conv, linear or other
    attr: str  # last key component: weight, bias, running_mean, bn_score, ...
    is_param: bool  # a parameter (False: a buffer)
    shape: tuple[int, ...]
    dtype: torch.dtype
    part: str = ""  # side inside a composite norm (perxan, ibn, dson): "bn" or "in", else ""
    block: str = ""  # the block (mpifl.models.structure) holding the entry, named by its first module
    depth: int = -1  # that block's position in forward order, from 0 (-1: a model without a classifier)
    is_head: bool = False  # in the final classifier, the last block

    @property
    def is_norm(self) -> bool:
        return self.module_kind in NORM_MODULE_KINDS

    @property
    def is_bn_side(self) -> bool:
        """An entry of a composite norm layer's BN side, personal under gPerXAN and FedBN.

        PerXAN: ``bn.weight``, ``bn.bias``, ``bn.running_mean``, ``bn.running_var``,
        ``bn.num_batches_tracked`` and ``bn_score`` (its IN side ``inorm.weight``,
        ``inorm.bias``, ``in_score`` has ``part == "in"``); IBN: its BN half
        ``bn.*``; DSON: every entry.
        """
        return self.module_kind in COMPOSITE_MODULES.values() and self.part == "bn"

    @property
    def is_bn_stat(self) -> bool:
        """A BatchNorm running statistic or its batch counter (composite BN sides included).

        AGN's running statistics are not: they belong to a mixed layer.
        """
        return self.attr in BN_STATS and (self.module_kind == "bn" or self.is_bn_side)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def module_kind(module: nn.Module) -> str:
    """The kind of ``module`` as used in :attr:`StateEntry.module_kind`.

    For a module inside a composite norm this is its own kind (``bn``, ``in``);
    :func:`state_entries` reports such entries with the composite's kind.
    """
    for cls, kind in COMPOSITE_MODULES.items():
        if isinstance(module, cls):
            return kind
    if isinstance(module, AdaptiveGroupNorm):
        return "agn"
    if isinstance(module, _BatchNorm):
        return "bn"
    if isinstance(module, nn.GroupNorm):
        return "ln" if module.num_groups == 1 else "gn"
    if isinstance(module, nn.LayerNorm):
        return "ln"
    if isinstance(module, _InstanceNorm):
        return "in"
    if isinstance(module, _ConvNd):
        return "conv"
    if isinstance(module, nn.Linear):
        return "linear"
    return "other"


def _composite_part(modules: dict[str, nn.Module], owner_name: str, key: str) -> tuple[str, str]:
    """(kind, ``"bn"``/``"in"``) if ``key`` lies inside a composite norm layer, else ``("", "")``."""
    names = owner_name.split(".") if owner_name else []
    for depth in range(len(names), -1, -1):
        name = ".".join(names[:depth])
        kind = COMPOSITE_MODULES.get(type(modules[name]))
        if kind:
            return kind, modules[name].part_of(key[len(name) + 1 :] if name else key)
    return "", ""


def state_entries(model: nn.Module) -> list[StateEntry]:
    """One entry per key of ``model.state_dict()``, in state-dict order; with its block and whether it is in
    the head when the model follows the registry's protocol (has a ``classifier``)."""
    modules = dict(model.named_modules(remove_duplicate=False))
    state = model.state_dict()
    structure = block_of_keys(model, list(state)) if hasattr(model, "classifier") else {}
    head = head_name(model) if structure else None
    entries = []
    for key, value in state.items():
        owner_name, _, attr = key.rpartition(".")
        owner = modules[owner_name]
        params = dict(owner.named_parameters(recurse=False, remove_duplicate=False))
        composite, part = _composite_part(modules, owner_name, key)
        entries.append(
            StateEntry(
                key=key,
                module_kind=composite or module_kind(owner),
                attr=attr,
                is_param=attr in params,
                shape=tuple(value.shape),
                dtype=value.dtype,
                part=part,
                block=structure[key][0] if structure else "",
                depth=structure[key][1] if structure else -1,
                is_head=head is not None and key.startswith(head + "."),
            )
        )
    return entries
