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

**ELCFS's form** (:func:`sigmoid_dice_loss`, ``--seg-loss sigmoid-dice``): ELCFS's code (Liu et al., CVPR 2021,
``liuquande/FedDG-ELCFS``: ``networks/unet2d.py`` ends in ``F.sigmoid`` over ``num_classes = 2`` channels, the
fundus optic disc and cup, no background channel; ``utils/losses.py`` ``dice_loss``) trains a multi-label head:
``logits`` (N, K - 1, H, W), one channel per foreground class, ``p_k = sigmoid(z_k)``, ``y_k = [mask == k]``
for k = 1..K-1, the same batch-sum soft Dice with the same ``eps`` (``smooth = 1e-5``, numerator and
denominator), averaged over the foreground channels only, and no CE::

    L_fg = 1 - (1/(K-1)) sum_{k>=1} (2 sum p_k y_k + eps) / (sum p_k + sum y_k + eps)

Its prediction (:func:`foreground_predictions`) thresholds the sigmoid at 0.75 (``train_ELCFS.py`` ``test``:
``pred_y[pred_y > 0.75] = 1``); a pixel above it in several channels takes the class of the largest logit
(mpifl's masks hold one class per pixel, where the fundus disc channel contains the cup), a pixel above it in
none is background.  :func:`sigmoid_dice_scores` then scores that class map exactly as :func:`dice_scores`
(every class, background included), so runs of either head report the one score.  Not reproduced: the code's
largest-connected-component post-processing and its per-class foreground-only report (disc and cup Dice).

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
SIGMOID_THRESHOLD = 0.75  # ELCFS's code, train_ELCFS.py test(): a foreground channel is predicted above 0.75


def _check(logits: torch.Tensor, masks: torch.Tensor) -> None:
    if logits.dim() != 4 or masks.shape != (logits.shape[0], *logits.shape[2:]):
        raise ValueError(f"logits must be (N, K, H, W) and masks (N, H, W), got {tuple(logits.shape)} "
                         f"and {tuple(masks.shape)}")
    if masks.is_floating_point():
        raise ValueError(f"masks must hold integer class indices, got {masks.dtype}")


def _one_hot(masks: torch.Tensor, classes: int) -> torch.Tensor:
    """``y[n, k] = [masks[n] == k]`` as a bool tensor (N, K, H, W)."""
    return masks.unsqueeze(1) == torch.arange(classes, device=masks.device).view(1, classes, 1, 1)


def _soft_dice_loss(probs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``1 - mean_k (2 sum p_k y_k + eps) / (sum p_k + sum y_k + eps)`` over the channels k of (N, K', H, W)."""
    dims = (0, 2, 3)
    per_class = (2 * (probs * target).sum(dims) + DICE_EPS) / (probs.sum(dims) + target.sum(dims) + DICE_EPS)
    return 1 - per_class.mean()


def dice_loss(logits: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """``1 - (1/K) sum_k (2 sum p_k y_k + eps) / (sum p_k + sum y_k + eps)``, sums over the batch (module docstring)."""
    _check(logits, masks)
    probs = F.softmax(logits, dim=1, dtype=torch.promote_types(logits.dtype, torch.float32))
    return _soft_dice_loss(probs, _one_hot(masks, logits.shape[1]).to(probs.dtype))


def sigmoid_dice_loss(logits: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """ELCFS's code: ``1 - (1/(K-1)) sum_{k>=1} (2 sum p_k y_k + eps) / (sum p_k + sum y_k + eps)``, ``p_k =
    sigmoid(z_k)`` of the (N, K - 1, H, W) foreground logits, sums over the batch, no CE (module docstring)."""
    _check(logits, masks)
    probs = torch.sigmoid(logits.to(torch.promote_types(logits.dtype, torch.float32)))
    return _soft_dice_loss(probs, _one_hot(masks, logits.shape[1] + 1)[:, 1:].to(probs.dtype))


def dice_ce_loss(logits: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """The reference codes' default ``JointLoss``: ``(CE + L_dice) / 2``, CE the mean over pixels."""
    _check(logits, masks)
    return (F.cross_entropy(logits, masks.long()) + dice_loss(logits, masks)) / 2


@torch.no_grad()
def dice_scores(logits: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """``s(n) = (1/K) sum_k 2 |P_k & G_k| / (|P_k| + |G_k| + eps)`` per image, P = argmax prediction; (N,) float64."""
    _check(logits, masks)
    return _class_map_dice(F.softmax(logits.float(), dim=1).argmax(1), masks, logits.shape[1])


@torch.no_grad()
def foreground_predictions(logits: torch.Tensor) -> torch.Tensor:
    """(N, H, W) class map of (N, K - 1, H, W) foreground logits: ``1 + argmax_k z_k`` where ``max_k sigmoid(z_k)
    > 0.75`` (ELCFS's code's threshold), else 0, background."""
    top, index = logits.float().max(1)
    return torch.where(torch.sigmoid(top) > SIGMOID_THRESHOLD, index + 1, torch.zeros_like(index))


@torch.no_grad()
def sigmoid_dice_scores(logits: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """:func:`dice_scores`' ``s(n)`` over all K classes of the :func:`foreground_predictions` of (N, K - 1, H, W)
    foreground logits; (N,) float64."""
    _check(logits, masks)
    return _class_map_dice(foreground_predictions(logits), masks, logits.shape[1] + 1)


def _class_map_dice(predicted: torch.Tensor, masks: torch.Tensor, classes: int) -> torch.Tensor:
    """``s(n)`` of a predicted class map (N, H, W) against the masks, K = ``classes``."""
    pred = _one_hot(predicted, classes)
    target = _one_hot(masks, classes)
    dims = (2, 3)
    intersection = (pred & target).sum(dims, dtype=torch.float64)
    sizes = pred.sum(dims, dtype=torch.float64) + target.sum(dims, dtype=torch.float64)
    return (2 * intersection / (sizes + DICE_EPS)).mean(1)
