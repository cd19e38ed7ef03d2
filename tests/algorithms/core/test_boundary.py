"""ELCFS's boundary-oriented loss: contour and background band as scipy's morphology makes them, NT-Xent by
hand, and the meta-test objective of a segmentation task carrying gamma times it."""

import math

import numpy as np
import pytest
import torch
from scipy import ndimage

from mpifl.algorithms.core.boundary import boundary_loss, dilate, erode, nt_xent, region_means, regions
from mpifl.models.unet import UNet
from mpifl.plan.task import SEGMENTATION, SEGMENTATION_SIGMOID_DICE

from ..helpers import make_algo


def test_erosion_and_dilation_are_scipys_with_the_cross_and_the_outside_as_background():
    masks = torch.from_numpy(np.random.default_rng(0).random((3, 9, 11)) < 0.6)
    for mask, eroded, dilated in zip(masks.numpy(), erode(masks).numpy(), dilate(masks, 5).numpy()):
        assert np.array_equal(eroded, ndimage.binary_erosion(mask, iterations=1))
        assert np.array_equal(dilated, ndimage.binary_dilation(mask, iterations=5))
    square = torch.zeros(1, 12, 12, dtype=torch.uint8)
    square[0, 4:8, 4:8] = 1
    contour, band = regions(square, 1)
    assert contour.sum() == 12 and not contour[0, 5:7, 5:7].any()  # the ring of the 4 x 4 square
    assert band.sum() == int(ndimage.binary_dilation(square[0].numpy(), iterations=5).sum()) - 16


def test_nt_xent_by_hand():
    embeddings = torch.tensor([[1.0, 0.0], [0.6, 0.8], [0.0, 1.0], [0.0, 2.0]])
    labels = torch.tensor([1, 1, 0, 0])
    tau = 0.5
    cos = {(0, 1): 0.6, (0, 2): 0.0, (0, 3): 0.0, (1, 2): 0.8, (1, 3): 0.8, (2, 3): 1.0}
    s = lambda i, j: cos[(min(i, j), max(i, j))] / tau  # noqa: E731

    def pair(a, p, negatives):
        return -s(a, p) + math.log(math.exp(s(a, p)) + sum(math.exp(s(a, n)) for n in negatives))

    expected = (pair(0, 1, [2, 3]) + pair(1, 0, [2, 3]) + pair(2, 3, [0, 1]) + pair(3, 2, [0, 1])) / 4
    assert nt_xent(embeddings, labels, tau).item() == pytest.approx(expected, rel=1e-6)


def test_images_without_the_class_are_left_out_and_a_mask_without_foreground_adds_nothing():
    torch.manual_seed(0)
    inner, outer = torch.randn(2, 3, 10, 10), torch.randn(2, 3, 10, 10)
    masks = torch.zeros(2, 10, 10, dtype=torch.long)
    assert boundary_loss(inner, outer, masks, 2, 0.05).item() == 0
    masks[0, 3:7, 3:7] = 1
    alone = boundary_loss(inner[:1], outer[:1], masks[:1], 2, 0.05)
    assert torch.isfinite(alone) and boundary_loss(inner, outer, masks, 2, 0.05).item() == pytest.approx(alone.item())
    contour, band = regions(masks[:1], 1)
    embeddings = torch.cat([region_means(inner[:1], contour), region_means(outer[:1], contour),
                            region_means(inner[:1], band), region_means(outer[:1], band)])
    assert alone.item() == pytest.approx(nt_xent(embeddings, torch.tensor([1, 1, 0, 0]), 0.05).item(), rel=1e-6)


@pytest.mark.parametrize("task", [SEGMENTATION, SEGMENTATION_SIGMOID_DICE])
@pytest.mark.parametrize("gamma", [0.0, 0.1])
def test_the_meta_test_objective_of_a_segmentation_task_adds_gamma_times_the_boundary_loss(data_root, gamma, task):
    """Also with ELCFS's own sigmoid head, which has no background channel: the foreground class still counts."""
    algo, _ = make_algo("elcfs", {"data_root": str(data_root)}, elcfs_boundary_weight=gamma)
    algo.bind_task(task)
    torch.manual_seed(0)
    model = UNet(num_classes=task.outputs(2), width=4, depth=2).eval()
    x, x_moved = torch.randn(2, 3, 8, 8), torch.randn(2, 3, 8, 8)
    masks = torch.zeros(2, 8, 8, dtype=torch.long)
    masks[:, 2:6, 1:5] = 1
    weights = dict(model.named_parameters())
    features = model.encode(x)
    loss = algo.meta_test_loss(model, weights, x_moved, masks, features)
    plain = task.loss(model(x_moved), masks)
    extra = gamma * boundary_loss(features, model.encode(x_moved), masks, 2, 0.05)
    assert loss.item() == pytest.approx((plain + extra).item(), rel=1e-6)
    assert (loss.item() > plain.item()) == (gamma > 0)
