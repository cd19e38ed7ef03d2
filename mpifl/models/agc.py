"""Adaptive gradient clipping (AGC), FedWon eq. (4) after NF-Nets.

FedWon (Zhuang & Lyu, ICLR 2024, appendix A.3 "Implementation and Training Details") clips,
for each layer ``l`` and each row ``i`` of its weight ``W^l`` and gradient
``G^l``, eq. (4)::

    G_i <- lambda * ||W_i||*_F / ||G_i||_F * G_i   if ||G_i||_F / ||W_i||*_F > lambda
    G_i <- G_i                                      otherwise

with ``||W_i||*_F = max(||W_i||_F, eps)``, ``eps = 1e-3``.  FedWon uses it only
at batch size 32 (lambda 0.64 Digits-Five, 1.28 Office-Caltech-10 and
DomainNet) and not for small batches; those choices belong to the algorithm.

Where the paper is silent this follows the NF-Nets reference implementation
(Brock et al., 2021b, ``deepmind-research/nfnets/optim.py``, ``unitwise_norm``
and the AGC clip function):

* **Units** (:func:`unitwise_norm`): a tensor that is a scalar or a vector
  once squeezed (biases, the ``(out, 1, 1, 1)`` WSConv gain, a linear layer
  with one input) counts as **one unit**: its whole L2 norm.  Any other
  tensor has one unit per output row, the PyTorch dim 0 of ``nn.Linear``
  ``(out, in)`` and ``nn.Conv2d`` ``(out, in/groups, kh, kw)`` weights, with
  the norm over every other dim.  (NF-Nets' JAX kernels are HWIO with the
  output last; this is the same rule in PyTorch's layout.  Transposed-conv
  weights are ``(in, out, ...)`` and would need their own rule: none of
  mpifl's models has one.)  timm's PyTorch port tests ``ndim <= 1`` instead
  of the squeezed shape, which differs only for the WSConv gain (per-element
  there, whole-vector here); the reference is followed.
* **Which parameters**: all, except what the caller names in ``exclude``.
  NF-Nets (Brock et al., 2021b) does not clip the final classifier layer;
  FedWon, which follows NF-Nets, is taken to do the same; the caller passes ``exclude=model.classifier``.
* **Comparison**: clipped where ``||G_i|| > lambda * ||W_i||*`` (strict, as
  eq. (4) and NF-Nets); the clipped row is ``G_i * (lambda * ||W_i||* /
  max(||G_i||, 1e-6))``, the ``1e-6`` guard being NF-Nets'.  Rows that are
  not clipped keep their exact bits.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from mpifl.errors import MpiflError

AGC_EPS = 1e-3  # FedWon appendix A.3, NF-Nets default
_GRAD_NORM_FLOOR = 1e-6  # NF-Nets: max(||G||, 1e-6) in the clipped branch


def unitwise_norm(x: torch.Tensor) -> torch.Tensor:
    """L2 norm per unit of ``x`` (see the module docstring), broadcastable to ``x``.

    Scalars and tensors that squeeze to a vector: one 0-dim norm of the whole
    tensor.  Otherwise: the norm of each ``x[i]`` over dims ``1..``, shaped
    ``(out, 1, ..., 1)``.
    """
    if x.squeeze().dim() <= 1:
        return torch.linalg.vector_norm(x)
    return torch.linalg.vector_norm(x, dim=tuple(range(1, x.dim())), keepdim=True)


def _excluded_ids(exclude, names: dict[str, torch.Tensor] | None) -> set[int]:
    if exclude is None:
        return set()
    if isinstance(exclude, (str, nn.Module, torch.Tensor)):
        exclude = [exclude]
    ids: set[int] = set()
    for item in exclude:
        if isinstance(item, nn.Module):
            ids.update(id(p) for p in item.parameters())
        elif isinstance(item, torch.Tensor):
            ids.add(id(item))
        elif isinstance(item, str):
            if names is None:
                raise TypeError("exclude by parameter name needs a model, not a parameter list")
            matched = [p for n, p in names.items() if n == item or n.startswith(item + ".")]
            if not matched:
                raise ValueError(f"exclude {item!r} names no parameter of the model")
            ids.update(id(p) for p in matched)
        else:
            raise TypeError(f"exclude items are modules, parameters or names, not {type(item)}")
    return ids


@torch.no_grad()
def adaptive_clip_(
    parameters_or_model: nn.Module | torch.Tensor | Iterable[torch.Tensor],
    clip: float,
    eps: float = AGC_EPS,
    exclude: nn.Module | torch.Tensor | str | Iterable | None = None,
) -> None:
    """Clip ``.grad`` of every parameter in place by FedWon eq. (4).

    ``parameters_or_model``: a model (its ``named_parameters()``), one tensor
    or an iterable of tensors.  ``clip`` is lambda (> 0).  ``exclude``: modules,
    parameters, or, with a model, parameter-name prefixes (``"fc3"``) left
    untouched; pass the final classifier (``exclude=model.classifier``).
    Parameters without a gradient are skipped.  Call between ``backward()``
    and ``optimizer.step()``.
    """
    if not clip > 0:
        raise MpiflError(
            f"adaptive gradient clipping needs a positive threshold lambda, got "
            f"{clip}; FedWon uses 0.64 on Digits-Five and 1.28 on Office-Caltech-10"
        )
    if isinstance(parameters_or_model, nn.Module):
        names = dict(parameters_or_model.named_parameters())
        params = list(names.values())
    elif isinstance(parameters_or_model, torch.Tensor):
        names, params = None, [parameters_or_model]
    else:
        names, params = None, list(parameters_or_model)
    skip = _excluded_ids(exclude, names)
    for p in params:
        if p.grad is None or id(p) in skip:
            continue
        grad = p.grad
        max_norm = unitwise_norm(p.detach()).clamp(min=eps) * clip
        grad_norm = unitwise_norm(grad)
        clipped = grad * (max_norm / grad_norm.clamp(min=_GRAD_NORM_FLOOR))
        grad.copy_(torch.where(grad_norm > max_norm, clipped, grad))
