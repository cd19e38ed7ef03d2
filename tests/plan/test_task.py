"""A run's task from its dataset: classification trains with cross-entropy and scores accuracy; segmentation
with the Dice loss (or (CE + Dice) / 2) and scores each image's Dice."""

import pytest
import torch
import torch.nn.functional as F

from mpifl.plan.segmentation import dice_loss, dice_scores
from mpifl.plan.task import CLASSIFICATION, SEGMENTATION, task_of


def test_classification_is_cross_entropy_and_the_number_correct():
    logits, labels = torch.tensor([[2.0, 0.0], [0.0, 1.0], [3.0, 0.0]]), torch.tensor([0, 0, 0])
    task = task_of("classification", "dice-ce")  # --seg-loss does not touch a classification run
    assert task is CLASSIFICATION and task.metric == "acc"
    assert task.score_sum(logits, labels).item() == 2
    assert torch.allclose(task.loss_sum(logits, labels), 3 * F.cross_entropy(logits, labels))


def test_segmentation_trains_with_the_chosen_loss_and_scores_dice_per_image():
    torch.manual_seed(0)
    logits, masks = torch.randn(2, 2, 4, 4), torch.randint(0, 2, (2, 4, 4))
    assert task_of("segmentation") is SEGMENTATION and SEGMENTATION.metric == "dice"
    assert torch.equal(SEGMENTATION.loss(logits, masks), dice_loss(logits, masks))
    joint = task_of("segmentation", "dice-ce")
    assert joint.loss(logits, masks).item() == pytest.approx(
        ((F.cross_entropy(logits, masks) + dice_loss(logits, masks)) / 2).item())
    assert SEGMENTATION.score_sum(logits, masks).item() == pytest.approx(dice_scores(logits, masks).sum().item())
    assert SEGMENTATION.loss_sum(logits, masks).item() == pytest.approx(2 * dice_loss(logits, masks).item())
