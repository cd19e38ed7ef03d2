"""Every method's local optimizer: ``--optimizer``, ``--lr-schedule`` and ``--keep-optimizer``.

The learning rate of round r is a pure function of r and the configuration (:func:`round_lr`), so a
resumed run and any number of ranks agree.  With ``--keep-optimizer`` a client's optimizer state (SGD
momentum buffers, Adam moments and step counts) is part of its private state, under ``optimizer/<param>/
<name>`` (:data:`KEPT`): loaded into the fresh optimizer of each of its rounds (:func:`restore_state`),
taken back after training (:func:`keep_state`), checkpointed by its host rank, never sent.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch
from torch import nn

from .config import RunConfig

KEPT = "optimizer/"  # prefix of the kept optimizer state in ClientState.private


def round_lr(cfg: RunConfig, r: int) -> float:
    """Local learning rate of round r = 1, 2, ... (``--lr`` = lr, R = :attr:`RunConfig.horizon`):

    * none: lr;
    * exp: lr gamma^(r-1) (FedNN, Kang et al. 2024, section 4.5 and its authors' code: gamma = 0.998);
    * step: lr gamma^floor((r-1) / ``--lr-step``);
    * cosine: lr_min + (lr - lr_min) (1 + cos(pi min(r, R) / R)) / 2 -- gPerXAN's public code (torch's
      CosineAnnealingLR with T_max = R and eta_min 0, stepped *before* each round's training): round 1
      already trains below lr, round R at lr_min (0 by default), rounds beyond R stay there.
    """
    if cfg.lr_schedule == "exp":
        return cfg.lr * cfg.lr_gamma ** (r - 1)
    if cfg.lr_schedule == "step":
        return cfg.lr * cfg.lr_gamma ** ((r - 1) // cfg.lr_step)
    if cfg.lr_schedule == "cosine":
        return cfg.lr_min + (cfg.lr - cfg.lr_min) * (1 + math.cos(math.pi * min(r, cfg.horizon) / cfg.horizon)) / 2
    return cfg.lr


def build_optimizer(parameters: Iterable[nn.Parameter], cfg: RunConfig, lr: float) -> torch.optim.Optimizer:
    """``--optimizer sgd``: SGD with ``--momentum`` and ``--weight-decay``; ``adam``: Adam (betas 0.9, 0.999,
    eps 1e-8) with ``--weight-decay`` as an L2 term (FedRDN's segmentation setting: lr 1e-3, decay 1e-4)."""
    if cfg.optimizer == "adam":
        return torch.optim.Adam(parameters, lr=lr, weight_decay=cfg.weight_decay)
    return torch.optim.SGD(parameters, lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)


def _names(model: nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in model.named_parameters()}


def restore_state(optimizer: torch.optim.Optimizer, model: nn.Module, private: dict[str, torch.Tensor]) -> None:
    """Load the kept state in ``private`` into ``optimizer``, freshly made over ``model``'s parameters (its
    hyperparameters, the round's learning rate included, stay those it was made with)."""
    names = _names(model)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    kept: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in private.items():
        if key.startswith(KEPT):
            param, name = key[len(KEPT):].rsplit("/", 1)
            kept.setdefault(param, {})[name] = value
    state = optimizer.state_dict()
    state["state"] = {i: kept[names[id(p)]] for i, p in enumerate(params) if names[id(p)] in kept}
    optimizer.load_state_dict(state)


def keep_state(optimizer: torch.optim.Optimizer, model: nn.Module, private: dict[str, torch.Tensor]) -> None:
    """After local training: every per-parameter tensor of ``optimizer`` into ``private`` (parameters that
    took no step yet have none)."""
    names = _names(model)
    for param, entry in optimizer.state.items():
        for name, value in entry.items():
            private[f"{KEPT}{names[id(param)]}/{name}"] = value.detach()
