"""A run's task from its dataset: classification trains with cross-entropy and scores accuracy; segmentation
with the Dice loss (or (CE + Dice) / 2) and scores each image's Dice."""

import pytest
import torch
import torch.nn.functional as F

from mpifl.errors import MpiflError
from mpifl.plan.segmentation import dice_loss, dice_scores, sigmoid_dice_loss, sigmoid_dice_scores
from mpifl.plan.task import CLASSIFICATION, SEGMENTATION, task_of


def test_classification_is_cross_entropy_and_the_number_correct():
    logits, labels = torch.tensor([[2.0, 0.0], [0.0, 1.0], [3.0, 0.0]]), torch.tensor([0, 0, 0])
    task = task_of("classification")
    assert task is CLASSIFICATION and task.metric == "acc"
    with pytest.raises(MpiflError, match="^--seg-loss dice-ce applies to segmentation datasets, .*drop --seg-loss$"):
        task_of("classification", "dice-ce")  # it would be recorded in config.json, and do nothing
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


def test_sigmoid_dice_trains_elcfss_foreground_head_and_scores_every_class():
    torch.manual_seed(0)
    logits, masks = torch.randn(2, 1, 4, 4), torch.randint(0, 2, (2, 4, 4))  # K = 2: one foreground channel
    task = task_of("segmentation", "sigmoid-dice")
    assert (task.outputs(2), task.classes(logits), task.metric) == (1, 2, "dice")
    assert (SEGMENTATION.outputs(2), SEGMENTATION.classes(torch.randn(2, 2, 4, 4))) == (2, 2)
    assert torch.equal(task.loss(logits, masks), sigmoid_dice_loss(logits, masks))
    assert task.score_sum(logits, masks).item() == pytest.approx(sigmoid_dice_scores(logits, masks).sum().item())


def test_a_sigmoid_dice_run_builds_its_network_without_a_background_output():
    from types import SimpleNamespace

    from mpifl.algorithms import get_algorithm
    from mpifl.plan.config import RunConfig
    from mpifl.session.session import _model

    manifest = SimpleNamespace(task="segmentation", num_classes=3, channels=3, image_size=(16, 16))
    for seg_loss, outputs in (("dice", 3), ("sigmoid-dice", 2)):
        cls = get_algorithm("elcfs")
        cfg = RunConfig(algo="elcfs", model="unet", seg_loss=seg_loss,
                        algo_options={o.name: o.default for o in cls.options})
        assert _model(cfg, manifest, cls).classifier.out_channels == outputs, seg_loss
