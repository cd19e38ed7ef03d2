"""Dice loss and Dice score of the multi-site prostate MRI segmentation task, as the reference code computes them.

FedRDN's public code has no segmentation part; its prostate setting is the one of HarmoFL's code (Jiang, Wang &
Dou, AAAI 2022: ``utils/loss.py`` ``DiceLoss``, ``JointLoss``; ``federated/fed_train.py``) and FedFA's code
(Zhou & Konukoglu, ICLR 2023: ``pyfed/loss/loss.py``, ``pyfed/utils/metric.py`` ``dice_func``), which agree.
``logits`` are (N, K, H, W), ``masks`` integer class maps (N, H, W) (uint8 or int64) with values in 0..K-1;
``p = softmax(logits)`` over the K classes, ``y_k = [mask == k]``, ``eps = 1e-5``.

**Loss** (:func:`dice_loss`, the codes' ``DiceLoss.forward``): a soft Dice per class over the whole batch
(sums over every image and pixel, not per image), every class including the background::

    L_dice = 1 - (1/K) sum_k (2 sum p_k y_k + eps) / (sum p_k + sum y_k + eps)

The codes' default training loss is :func:`dice_ce_loss`, ``(CE + L_dice) / 2`` with CE the mean over pixels
(``JointLoss``: HarmoFL's prostate setting, FedFA's ``TRAIN_LOSS = 'joint'``); FedRDN's paper names the Dice
loss.  The codes build the one-hot target from three fixed channels (classes 0, 1, 2), here from K.

**Score** (:func:`dice_scores`, the codes' ``dice_coef`` / ``dice_func``): hard predictions
``pred = argmax_k softmax(logits)``, one Dice per image n and class k, every class including the
background, ``eps`` in the denominator only::

    d_k(n) = 2 |pred_n = k  and  mask_n = k| / (|pred_n = k| + |mask_n = k| + eps)
    s(n)   = (1/K) sum_k d_k(n)

:func:`dice_scores` returns ``s(n)`` per image (float64; the codes compute in float32, where ``eps`` vanishes
next to any non-empty count).  A class absent from both the mask and the prediction scores 0, not 1: an
image with an empty foreground mask predicted empty scores ``(1/2) 2HW / (2HW + eps)``, about 0.5, with
K = 2 (the codes' prostate datasets drop slices without prostate, so it never arises there).

Aggregation: the codes average ``d_k`` over a batch's images, then over classes, i.e. the batch mean of
``s(n)``.  FedFA's evaluation concatenates a split's outputs and calls it once: the mean of ``s(n)`` over the
split's images, which is what summing :func:`dice_scores` and dividing by the image count gives.  HarmoFL's
averages the batch means over the loader's batches (``test_acc / len(loader)``), the same when every batch
has the same size (a smaller last batch weighs its images more).
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

DICE_EPS = 1e-5


def _check(logits: torch.Tensor, masks: torch.Tensor) -> None:
    if logits.dim() != 4 or masks.shape != (logits.shape[0], *logits.shape[2:]):
        raise ValueError(f"logits must be (N, K, H, W) and masks (N, H, W), got {tuple(logits.shape)} "
                         f"and {tuple(masks.shape)}")
    if masks.is_floating_point():
        raise ValueError(f"masks must hold integer class indices, got {masks.dtype}")


def _one_hot(masks: torch.Tensor, classes: int) -> torch.Tensor:
    """``y[n, k] = [masks[n] == k]`` as a bool tensor (N, K, H, W)."""
    return masks.unsqueeze(1) == torch.arange(classes, device=masks.device).view(1, classes, 1, 1)


def dice_loss(logits: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """``1 - (1/K) sum_k (2 sum p_k y_k + eps) / (sum p_k + sum y_k + eps)``, sums over the batch (module docstring)."""
    _check(logits, masks)
    probs = F.softmax(logits, dim=1, dtype=torch.promote_types(logits.dtype, torch.float32))
    target = _one_hot(masks, logits.shape[1]).to(probs.dtype)
    dims = (0, 2, 3)
    per_class = (2 * (probs * target).sum(dims) + DICE_EPS) / (probs.sum(dims) + target.sum(dims) + DICE_EPS)
    return 1 - per_class.mean()


def dice_ce_loss(logits: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """The reference codes' default ``JointLoss``: ``(CE + L_dice) / 2``, CE the mean over pixels."""
    _check(logits, masks)
    return (F.cross_entropy(logits, masks.long()) + dice_loss(logits, masks)) / 2


@torch.no_grad()
def dice_scores(logits: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """``s(n) = (1/K) sum_k 2 |P_k & G_k| / (|P_k| + |G_k| + eps)`` per image, P = argmax prediction; (N,) float64."""
    _check(logits, masks)
    classes = logits.shape[1]
    pred = _one_hot(F.softmax(logits.float(), dim=1).argmax(1), classes)
    target = _one_hot(masks, classes)
    dims = (2, 3)
    intersection = (pred & target).sum(dims, dtype=torch.float64)
    sizes = pred.sum(dims, dtype=torch.float64) + target.sum(dims, dtype=torch.float64)
    return (2 * intersection / (sizes + DICE_EPS)).mean(1)
