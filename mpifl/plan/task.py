"""What a run learns, from its dataset's manifest (``task``): the loss clients train with and the score they
report.

* **classification**: a class per image; loss cross-entropy; score accuracy (``acc``), the fraction of images
  whose arg-max logit is their class.
* **segmentation**: a class per pixel (labels are masks, :mod:`mpifl.data.shard`); loss the Dice loss
  (``--seg-loss dice``, FedRDN's paper) or ``(CE + Dice) / 2`` (``dice-ce``, the HarmoFL and FedFA prostate
  code), both on a softmax over K channels, background included; or ELCFS's code's sigmoid Dice over K - 1
  foreground channels (``sigmoid-dice``: the network has no background channel, and a pixel is predicted by
  the 0.75 threshold); score ``dice``, the mean over images of each image's Dice coefficient over all K
  classes, the same for every loss (:mod:`mpifl.plan.segmentation`).  Every method of a run trains with the
  one ``--seg-loss``.

A score travels as a sum over images with the image count (``correct`` and ``seen`` of a client's report,
:mod:`mpifl.transport.messages`), so splits and domains pool it as they pool correct classifications.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from ..errors import MpiflError
from .config import SEG_LOSSES
from .segmentation import dice_ce_loss, dice_loss, dice_scores, sigmoid_dice_loss, sigmoid_dice_scores


def _correct(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return (logits.argmax(1) == labels).sum()


def _dice_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return dice_scores(logits, labels).sum()


def _sigmoid_dice_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return sigmoid_dice_scores(logits, labels).sum()


def _summed_ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, labels, reduction="sum")


@dataclass(frozen=True)
class Task:
    """A learning task: its training loss (mean over a mini-batch), the loss evaluation sums over a batch (a
    Dice loss, which is not a mean over images, counts as the batch's value times its images) and its score
    summed over the batch's images."""

    name: str
    metric: str  # the score's key in metrics.jsonl and the summaries
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    loss_sum: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    score_sum: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    background_output: bool = True  # False: the network outputs the K - 1 foreground classes only

    def outputs(self, classes: int) -> int:
        """The network's output channels (or logits) for a dataset of ``classes`` classes."""
        return classes if self.background_output else classes - 1

    def classes(self, logits: torch.Tensor) -> int:
        """K, the dataset's classes, from the network's (N, outputs, ...) ``logits``."""
        return logits.shape[1] if self.background_output else logits.shape[1] + 1


def _batch_times_images(loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
    return lambda logits, labels: loss(logits, labels) * len(labels)


CLASSIFICATION = Task("classification", "acc", F.cross_entropy, _summed_ce, _correct)
SEGMENTATION = Task("segmentation", "dice", dice_loss, _batch_times_images(dice_loss), _dice_sum)
SEGMENTATION_DICE_CE = Task("segmentation", "dice", dice_ce_loss, _batch_times_images(dice_ce_loss), _dice_sum)
SEGMENTATION_SIGMOID_DICE = Task("segmentation", "dice", sigmoid_dice_loss,
                                 _batch_times_images(sigmoid_dice_loss), _sigmoid_dice_sum, background_output=False)
#: --seg-loss -> the segmentation task it trains
SEGMENTATION_BY_LOSS = dict(zip(SEG_LOSSES, (SEGMENTATION, SEGMENTATION_DICE_CE, SEGMENTATION_SIGMOID_DICE),
                                strict=True))


def task_of(dataset_task: str, seg_loss: str = SEG_LOSSES[0]) -> Task:
    """The run's task: its dataset's (``classification`` or ``segmentation``), with ``--seg-loss``; another loss
    than the default on a classification dataset is refused (it would be recorded, and do nothing)."""
    if dataset_task == "classification":
        if seg_loss != SEG_LOSSES[0]:
            raise MpiflError(f"--seg-loss {seg_loss} applies to segmentation datasets, and this one is a "
                             "classification dataset, trained with cross-entropy; drop --seg-loss")
        return CLASSIFICATION
    return SEGMENTATION_BY_LOSS[seg_loss]
