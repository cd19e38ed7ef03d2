"""Dice loss and Dice score of the segmentation task, by hand (HarmoFL's / FedFA's definitions)."""

import math

import pytest
import torch

from mpifl.plan.segmentation import (DICE_EPS, dice_ce_loss, dice_loss, dice_scores, foreground_predictions,
                                     sigmoid_dice_loss, sigmoid_dice_scores)

EPS = DICE_EPS


def logits_for(pred: list[list[int]], classes: int = 2) -> torch.Tensor:
    """Logits (N, K, 1, W) whose arg-max is ``pred`` (one row per image)."""
    labels = torch.tensor(pred).unsqueeze(1)
    return torch.nn.functional.one_hot(labels, classes).permute(0, 3, 1, 2).float() * 5


def masks_of(rows: list[list[int]], dtype=torch.int64) -> torch.Tensor:
    return torch.tensor(rows, dtype=dtype).unsqueeze(1)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int64])
def test_dice_of_a_tiny_mask_by_hand(dtype):
    # mask 0 1 1 0, prediction 0 1 0 0: foreground 2*1/(1+2), background 2*2/(3+2), mean over both classes
    scores = dice_scores(logits_for([[0, 1, 0, 0]]), masks_of([[0, 1, 1, 0]], dtype))
    assert scores.dtype == torch.float64 and scores.shape == (1,)
    expected = (2 / (3 + EPS) + 4 / (5 + EPS)) / 2
    assert scores.item() == pytest.approx(expected, rel=1e-12)
    assert scores.item() == pytest.approx(11 / 15, abs=1e-5)


def test_scores_are_per_image():
    logits = logits_for([[0, 1, 0, 0], [1, 1, 1, 1]])
    masks = masks_of([[0, 1, 1, 0], [1, 1, 1, 1]])
    scores = dice_scores(logits, masks)
    assert scores.shape == (2,)
    assert scores[0].item() == pytest.approx(11 / 15, abs=1e-5)
    # image 2: foreground perfect (8 / (8 + eps)); background absent from both: 0 / eps = 0
    assert scores[1].item() == pytest.approx((8 / (8 + EPS) + 0) / 2, rel=1e-12)


def test_empty_mask_predicted_empty_scores_half():
    scores = dice_scores(logits_for([[0, 0, 0, 0]]), masks_of([[0, 0, 0, 0]]))
    assert scores.item() == pytest.approx((8 / (8 + EPS) + 0) / 2, rel=1e-12)


def test_every_class_counts_also_one_absent_everywhere():
    # three classes, class 2 neither in the mask nor predicted: it scores 0, so a perfect prediction scores 2/3
    scores = dice_scores(logits_for([[0, 1, 1, 0]], classes=3), masks_of([[0, 1, 1, 0]]))
    assert scores.item() == pytest.approx(2 / 3 * 4 / (4 + EPS), rel=1e-12)


def test_dice_loss_pools_the_batch_by_hand():
    # zero logits: p = 1/2 everywhere. Image 1 all foreground, image 2 all background (2 pixels each).
    # Over the batch, per class: 2 * (1/2 * 2) = 2 on top, sum p = 2 and sum y = 2 below.
    logits = torch.zeros(2, 2, 1, 2)
    masks = masks_of([[1, 1], [0, 0]])
    assert dice_loss(logits, masks).item() == pytest.approx(1 - (2 + EPS) / (4 + EPS), rel=1e-6)
    # the mean of per-image losses would be 1 - (eps / (1 + eps) + 2 / 3) / 2, about 2/3: not the rule
    per_image = sum(dice_loss(logits[i : i + 1], masks[i : i + 1]) for i in range(2)) / 2
    assert per_image.item() == pytest.approx(1 - (EPS / (1 + EPS) + (2 + EPS) / (3 + EPS)) / 2, rel=1e-6)


def test_dice_loss_gradient_pushes_towards_the_mask():
    logits = torch.zeros(1, 2, 1, 4, requires_grad=True)
    masks = masks_of([[0, 1, 1, 0]])
    dice_loss(logits, masks).backward()
    grad_fg = logits.grad[0, 1, 0]
    assert (grad_fg[[1, 2]] < 0).all()  # raising the foreground logit on foreground pixels lowers the loss
    assert (grad_fg[[0, 3]] > 0).all()
    assert torch.allclose(logits.grad.sum(1), torch.zeros(1, 1, 4), atol=1e-7)  # softmax: gradients sum to 0


def test_perfect_prediction_has_loss_near_zero():
    masks = masks_of([[0, 1, 1, 0]])
    assert dice_loss(logits_for([[0, 1, 1, 0]]) * 10, masks).item() == pytest.approx(0, abs=1e-6)


def test_dice_ce_loss_is_the_mean_of_both():
    logits = torch.zeros(1, 2, 1, 4)
    masks = masks_of([[0, 1, 1, 0]], torch.uint8)
    dice = 1 - (2 + EPS) / (4 + EPS)
    assert dice_ce_loss(logits, masks).item() == pytest.approx((math.log(2) + dice) / 2, rel=1e-6)


def test_shapes_are_checked():
    with pytest.raises(ValueError, match="masks"):
        dice_scores(torch.zeros(2, 2, 4, 4), torch.zeros(2, 4, 5, dtype=torch.int64))
    with pytest.raises(ValueError, match="integer"):
        dice_loss(torch.zeros(2, 2, 4, 4), torch.zeros(2, 4, 4))


def _authors_dice_loss(score, target):
    """ELCFS's utils/losses.py dice_loss, spelled out: per channel, sums over the whole batch, smooth 1e-5."""
    total = 0
    for i in range(target.shape[1]):
        intersect = torch.sum(score[:, i] * target[:, i])
        total += (2 * intersect + 1e-5) / (torch.sum(score[:, i]) + torch.sum(target[:, i]) + 1e-5)
    return 1 - total / target.shape[1]


@pytest.mark.parametrize("classes", [2, 3])
def test_sigmoid_dice_loss_is_elcfss_per_channel_dice_of_the_foreground_sigmoids(classes):
    torch.manual_seed(0)
    logits = torch.randn(3, classes - 1, 5, 6, dtype=torch.float64)
    masks = torch.randint(0, classes, (3, 5, 6))
    target = torch.stack([masks == k for k in range(1, classes)], 1).double()  # no background channel
    expected = _authors_dice_loss(torch.sigmoid(logits), target)
    assert sigmoid_dice_loss(logits, masks).item() == pytest.approx(expected.item(), rel=1e-12)


def test_sigmoid_dice_loss_has_no_ce_and_no_background_term():
    masks = masks_of([[0, 1, 1, 0]])
    logits = torch.tensor([[[[-20.0, 20.0, 20.0, -20.0]]]])  # sigmoid 0 / 1: a perfect foreground
    assert sigmoid_dice_loss(logits, masks).item() == pytest.approx(0, abs=1e-6)
    half = torch.zeros(1, 1, 1, 4)  # p = 1/2 everywhere: (2 * 1 + eps) / (2 + 2 + eps)
    assert sigmoid_dice_loss(half, masks).item() == pytest.approx(1 - (2 + EPS) / (4 + EPS), rel=1e-6)


def test_foreground_predictions_threshold_the_sigmoid_at_elcfss_0_75():
    z = math.log(0.75 / 0.25)  # sigmoid(z) = 0.75
    logits = torch.tensor([[[[z - 0.01, z + 0.01, 5.0, -5.0]], [[-5.0, -5.0, 6.0, 0.5]]]])  # (1, 2, 1, 4)
    assert foreground_predictions(logits).tolist() == [[[0, 1, 2, 0]]]  # 0.5 -> sigmoid 0.62: background


def test_sigmoid_dice_scores_count_every_class_of_the_thresholded_map_as_dice_scores():
    logits = torch.tensor([[[[-5.0, 5.0, 0.5, 5.0]]]])  # predicted 0 1 0 1 (0.5 is below 0.75)
    masks = masks_of([[0, 1, 1, 0]])
    same = dice_scores(logits_for([[0, 1, 0, 1]]), masks)
    assert torch.equal(sigmoid_dice_scores(logits, masks), same)
    assert same.item() == pytest.approx((2 * 1 / (4 + EPS) + 2 * 1 / (4 + EPS)) / 2, rel=1e-12)
