"""--train-transforms: batched flip, rotate, rot90-flip, crop, jitter and jitter-hue agree with their per-image
definitions; segmentation masks move with their images under the geometric ones."""

import numpy as np
import pytest
import torch

from mpifl.client.transforms import TrainTransforms, crop, flip, jitter, jitter_hue, rot90_flip, rotate
from mpifl.errors import MpiflError
from mpifl.plan.config import TRANSFORMS, parse_names


def _batch(n=6, c=3, size=16):
    return torch.from_numpy(np.random.default_rng(0).integers(0, 256, size=(n, c, size, size))).float()


def test_flip_mirrors_exactly_the_images_its_draws_pick():
    x = _batch()
    picked = np.random.default_rng(3).random(len(x)) < 0.5
    out = flip(x, np.random.default_rng(3))
    assert 0 < picked.sum() < len(x)
    for i in range(len(x)):
        assert torch.equal(out[i], x[i].flip(-1) if picked[i] else x[i])


def test_crop_is_a_window_of_the_reflect_padded_image():
    x = _batch(size=16)  # pad 2
    rng = np.random.default_rng(5)
    dy, dx = rng.integers(0, 5, size=len(x)), rng.integers(0, 5, size=len(x))
    out = crop(x, np.random.default_rng(5))
    padded = torch.nn.functional.pad(x, (2, 2, 2, 2), mode="reflect")
    assert out.shape == x.shape
    for i in range(len(x)):
        assert torch.equal(out[i], padded[i, :, dy[i]:dy[i] + 16, dx[i]:dx[i] + 16])
    assert not torch.equal(out, x)


def test_jitter_stays_in_range_and_changes_each_image_differently():
    x = _batch()
    out = jitter(x, np.random.default_rng(1))
    assert out.min() >= 0 and out.max() <= 255
    ratios = out.mean(dim=(1, 2, 3)) / x.mean(dim=(1, 2, 3))
    assert ratios.std() > 0.05
    gray = jitter(_batch(c=1), np.random.default_rng(1))  # single channel: no saturation step
    assert gray.shape == (6, 1, 16, 16)


def test_same_seed_same_batch_and_none_is_identity():
    x = _batch()
    both = TrainTransforms(parse_names("flip,crop,jitter"))
    assert torch.equal(both(x, np.random.default_rng(9)), both(x, np.random.default_rng(9)))
    assert not TrainTransforms(parse_names("none"))
    with pytest.raises(ValueError, match="unknown transform shear"):
        TrainTransforms(("shear",))


class Draws:
    """A stand-in generator returning given arrays in order and recording the ranges asked for."""

    def __init__(self, *arrays):
        self.arrays, self.asked = list(arrays), []

    def random(self, size):
        self.asked.append(("random", size))
        return np.asarray(self.arrays.pop(0), dtype=float)

    def uniform(self, low, high, size):
        self.asked.append((low, high))
        return np.asarray(self.arrays.pop(0), dtype=float)


def test_rotate_turns_counter_clockwise_by_the_drawn_angle_within_30_degrees():
    x = torch.arange(1.0, 10.0).reshape(1, 1, 3, 3)  # [[1 2 3] [4 5 6] [7 8 9]]
    draws = Draws([90.0])
    out = rotate(x, draws)
    assert draws.asked == [(-30.0, 30.0)]
    assert out[0, 0].tolist() == [[3, 6, 9], [2, 5, 8], [1, 4, 7]]
    assert torch.equal(rotate(x, Draws([0.0])), x)
    seeded = TrainTransforms(("rotate",))
    assert torch.equal(seeded(_batch(), np.random.default_rng(2)), seeded(_batch(), np.random.default_rng(2)))


def test_rot90_flip_is_harmofl_and_fedfas_prostate_loader():
    """Per image, as their ``__getitem__`` on the H x W x C slice: ``np.rot90(img, randint(0, 4))``, then with p
    0.75 ``cv2.flip(img, randint(-1, 1))`` (0: rows reversed, 1: columns, -1: both)."""
    x = torch.arange(64 * 3 * 5 * 5, dtype=torch.float32).reshape(64, 3, 5, 5)
    out = rot90_flip(x, np.random.default_rng(7))
    rng = np.random.default_rng(7)
    turns, flipped, codes = rng.integers(0, 5, 64), rng.random(64) < 0.75, rng.integers(-1, 2, 64)
    assert set(turns) == {0, 1, 2, 3, 4} and set(codes) == {-1, 0, 1} and 0.6 < flipped.mean() < 0.9
    for i in range(64):
        img = np.rot90(x[i].permute(1, 2, 0).numpy(), turns[i])
        if flipped[i]:
            img = {0: img[::-1], 1: img[:, ::-1], -1: img[::-1, ::-1]}[codes[i]]
        assert torch.equal(out[i], torch.from_numpy(img.copy()).permute(2, 0, 1)), i
    with pytest.raises(MpiflError, match="rot90-flip turns images by 90 degrees and needs square ones, got 4 x 6"):
        rot90_flip(torch.zeros(2, 1, 4, 6), np.random.default_rng(0))


def test_jitter_hue_is_gperxans_colour_jitter_on_half_the_images():
    red = torch.tensor([255.0, 0, 0])[None, :, None, None].expand(3, 3, 2, 2).clone()
    red[2] = 100.0  # a gray image: only brightness changes it
    draws = Draws([0.1, 0.9, 0.2], [[1, 1, 1.2], [1, 1, 1], [1, 1, 1]], [1 / 3, 1 / 3, 0.1])
    out = jitter_hue(red, draws)
    assert draws.asked == [("random", 3), (0.8, 1.2), (-0.2, 0.2)]
    assert torch.allclose(out[0, :, 0, 0], torch.tensor([0.0, 255, 0]), atol=1e-3)  # hue + 1/3 turn: green
    assert torch.equal(out[1], red[1])  # draw 0.9 >= 0.5: left alone
    assert torch.allclose(out[2], torch.full((3, 2, 2), 120.0))


# ------------------------------------------------------------------ segmentation masks move with their images

GEOMETRIC, PHOTOMETRIC = ("flip", "rotate", "rot90-flip", "crop"), ("jitter", "jitter-hue")
LABELS = {1, 2}  # the masks' label set: 0 (background) appears only where a transform pads


def _masked(n=32, size=24, dtype=torch.uint8):
    """Masks of 1 with an off-centre L of 2 (a different place per image, so a flip or turn shows), and images
    equal to them on all three channels."""
    masks = torch.ones(n, size, size, dtype=dtype)
    for i in range(n):
        top, left = 2 + i % 5, 2 + i % 3
        masks[i, top:top + 12, left:left + 3] = 2
        masks[i, top + 9:top + 12, left:left + 8] = 2
    return masks[:, None].expand(n, 3, size, size).float(), masks


@pytest.mark.parametrize("name", GEOMETRIC)
def test_a_geometric_transform_moves_each_mask_exactly_as_its_image(name):
    x, masks = _masked()
    steps = TrainTransforms((name,))
    out, moved = steps.with_masks(x, masks, np.random.default_rng(4))
    assert torch.equal(out, steps(x, np.random.default_rng(4)))  # the image as without a mask
    assert moved.dtype == masks.dtype and moved.shape == masks.shape
    assert set(moved.unique().tolist()) <= LABELS | {0}
    for i in range(len(x)):  # every image's own draw, nearest pixel: the mask lies on the image's shape
        assert torch.equal(out[i], moved[i][None].expand(3, -1, -1).float()), i
    changed = [not torch.equal(moved[i], masks[i]) for i in range(len(x))]
    assert 0 < sum(changed) and (name != "flip" or sum(changed) < len(x))  # several draws, flip both ways
    if name == "flip":
        assert all(torch.equal(moved[i], masks[i].flip(-1) if c else masks[i]) for i, c in enumerate(changed))


def test_rotate_fills_the_mask_outside_the_turned_image_with_background():
    x, masks = _masked()
    angles = np.random.default_rng(4).uniform(-30, 30, size=len(x))
    _, moved = TrainTransforms(("rotate",)).with_masks(x, masks, np.random.default_rng(4))
    turned = np.abs(angles) > 10
    assert turned.sum() > 5
    for i in np.flatnonzero(turned):  # the corners come from outside the image: label 0
        assert moved[i, 0, 0] == moved[i, 0, -1] == moved[i, -1, 0] == moved[i, -1, -1] == 0
    assert (moved == 0).any(dim=(1, 2)).sum() >= turned.sum()


def test_crop_reflects_the_mask_where_it_reflects_the_image():
    x, masks = _masked()
    out, moved = TrainTransforms(("crop",)).with_masks(x, masks, np.random.default_rng(6))
    rng = np.random.default_rng(6)
    dy, dx = rng.integers(0, 7, size=len(x)), rng.integers(0, 7, size=len(x))  # 24 px: pad 3
    padded = torch.nn.functional.pad(masks[:, None].float(), (3, 3, 3, 3), mode="reflect")[:, 0].to(masks.dtype)
    for i in range(len(x)):
        assert torch.equal(moved[i], padded[i, dy[i]:dy[i] + 24, dx[i]:dx[i] + 24])
    assert not (moved == 0).any()  # no padding value: the image is not zero-padded either


@pytest.mark.parametrize("name", PHOTOMETRIC)
def test_a_colour_transform_leaves_the_mask_alone(name):
    x, masks = _masked()
    x = x * torch.linspace(40, 100, 3)[None, :, None, None]  # colours, so that hue and saturation act
    out, kept = TrainTransforms((name,)).with_masks(x, masks, np.random.default_rng(2))
    assert torch.equal(out, TrainTransforms((name,))(x, np.random.default_rng(2)))
    assert not torch.equal(out, x) and torch.equal(kept, masks) and kept.dtype == masks.dtype


def test_the_whole_chain_moves_masks_by_its_geometric_draws_only():
    x, masks = _masked(dtype=torch.int64)
    _, moved = TrainTransforms(TRANSFORMS).with_masks(x * 100, masks, np.random.default_rng(8))
    # the geometric steps come first and draw first: the same draws without the colour steps
    out, alone = TrainTransforms(GEOMETRIC).with_masks(x, masks, np.random.default_rng(8))
    assert torch.equal(moved, alone) and moved.dtype == torch.int64
    assert torch.equal(out[:, 0], alone.float()) and not torch.equal(alone, masks)
