"""The guiding regularizer (``--guide-lambda``), a plug-in for any method whose download holds the classifier.

Le, Ho, Do, Le-Phuoc & Wong, "Efficiently Assemble Normalization Layers and Regularization for
Federated Domain Generalization", CVPR 2024, section 3.2, eqs. 3-4: client i's local loss becomes

    L_i = sum_k [ l(h_i(g_i(x_k)), y_k) + lambda l(h_g(g_i(x_k)), y_k) ]

with ``h_g`` the global classifier received this round, frozen, and ``l`` "the base loss function, which is
usually cross-entropy in classification tasks": one loss for both terms.  Here ``l`` is the run's task loss
(:attr:`mpifl.plan.task.Task.loss`, the one the method's own term uses): cross-entropy on a classification
task, the run's ``--seg-loss`` (Dice, ``(CE + Dice) / 2`` or ELCFS's sigmoid Dice) on a segmentation task, where
``h_g`` is the downloaded 1x1 classifier giving per-pixel logits; per mini-batch, each term is reduced as
the task reduces it (a mean over images, pixels for CE; the batch's Dice).  The authors' code (classification only)
uses ``F.cross_entropy`` for both terms, which is the classification case.  The paper adds it to gPerXAN
and, in its ablation (section 4.4.2, Fig. 2), to FedAvg, ELCFS and CCST: the term is independent of the
method.

* **The global head**: a copy of ``model.classifier`` taken when the round's model is loaded (the
  download's classifier), before any local step, with ``requires_grad`` off: the term's gradient flows into
  the feature extractor g_i (through the features) and never into h_g; the local head h_i gets none from it.
  The authors' code does the same (``copy.deepcopy`` of the client's ``fc`` right after loading the
  server's parameters, its parameters frozen).
* **The features**: those the method's forward pass gets from ``model.encode``, before anything the method
  does to them on the way to its own head (RSC's mask); FedMix's forward pass encodes ``(1 - lambda) x``,
  so its guide reads those.  The labels are the mini-batch's.
* **When**: every mini-batch of a round's local training.  A personalization fine-tuning before an
  evaluation (:meth:`~mpifl.algorithms.core.base.Algorithm.personalize`) is not guided: no global head is held.
* **Which methods**: every one whose download holds every classifier entry (checked on its first stage's
  share policy when the run is built); for the others (FedPer, FedRep, FedBABU, SingleSet, FedProto, ...)
  there is no global head and ``--guide-lambda > 0`` is refused in one line.
* **Default**: 0 (off) for every method but gPerXAN, whose default 0.5 is its authors' code (the paper
  searches lambda in [0, 1] in steps of 0.25), set in its ``defaults`` (:mod:`mpifl.algorithms.core.options`
  declares the option).
  Nothing crosses the wire for it: ``--show-manifest`` is unchanged.
"""

from __future__ import annotations

import copy
from typing import Any, Mapping

import torch
from torch import nn

from ...errors import MpiflError
from ...plan.config import Option
from ...plan.task import Task
from .options import GUIDE_LAMBDA, agrees


def with_guide(method: str, options: tuple[Option, ...], defaults: Mapping[str, Any]) -> tuple[Option, ...]:
    """``options`` with ``--guide-lambda``, the option every method takes (Algorithm.__init_subclass__), last: one
    among them (inherited with a parent's options) moves there; one declared otherwise is refused."""
    for option in options:
        if option.name == GUIDE_LAMBDA.name and not agrees(option, GUIDE_LAMBDA, GUIDE_LAMBDA.name in defaults):
            raise TypeError(f"{method}: its --guide-lambda ({option}) is not the one every method takes; drop it "
                            f"(every method has it) and give its default in the method's defaults")
    return tuple(o for o in options if o.name != GUIDE_LAMBDA.name) + (GUIDE_LAMBDA,)


def frozen_head(model: nn.Module) -> nn.Module:
    """h_g: a copy of the model's classifier as loaded from the download, taking no gradient."""
    return copy.deepcopy(model.classifier).requires_grad_(False)


def guide_loss(head: nn.Module, lam: float, features: torch.Tensor, labels: torch.Tensor,
               task: Task) -> torch.Tensor:
    """lambda * L(h_g(features), labels), L = ``task.loss``: the run's task loss, the one the method's own term
    uses (cross-entropy, mean over the mini-batch; the run's ``--seg-loss`` on a segmentation task)."""
    return lam * task.loss(head(features), labels)


def check_guide(algo) -> None:
    """One line refusing ``--guide-lambda`` for a method whose download lacks (part of) the classifier."""
    if algo.guide_lambda and not algo.downloads_head():
        raise MpiflError(f"--guide-lambda: {algo.name} keeps the classifier on each client (it is not in the "
                         "download), so there is no global classifier to guide with; drop --guide-lambda or "
                         "pick a method that averages its classifier")
