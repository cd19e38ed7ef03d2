"""--train-transforms: batched flip, crop and jitter agree with their per-image definitions."""

import numpy as np
import pytest
import torch

from mpifl.client.transforms import TrainTransforms, crop, flip, jitter, parse


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
    both = TrainTransforms(parse("flip,crop,jitter"))
    assert torch.equal(both(x, np.random.default_rng(9)), both(x, np.random.default_rng(9)))
    assert not TrainTransforms(parse("none"))
    with pytest.raises(ValueError, match="unknown transform rotate"):
        TrainTransforms(("rotate",))
