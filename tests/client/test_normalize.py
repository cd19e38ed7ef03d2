"""FedRDN and the normalization choices (Yan et al., 2023, arXiv, eqs. 5-8)."""

import numpy as np
import pytest
import torch

from mpifl.client.normalize import channel_stats, fixed, make_normalizer


def test_channel_stats_are_means_of_per_image_means_and_stds():
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(300, 3, 5, 7), dtype=np.uint8)  # more than one chunk of 256
    x = images.astype(np.float64) / 255
    expected = np.stack([x.mean(axis=(2, 3)).mean(axis=0), x.std(axis=(2, 3)).mean(axis=0)])
    chunks = torch.from_numpy(images).split(128)
    assert np.allclose(channel_stats(chunks, 3).numpy(), expected)


def _apply(affine, pixels):
    scale, shift = affine
    return torch.addcmul(shift, pixels.float(), scale)


def test_fixed_normalization_matches_the_formula():
    pixels = torch.randint(0, 256, (2, 3, 4, 4), dtype=torch.uint8)
    out = _apply(fixed([0.1, 0.2, 0.3], [0.5, 0.25, 0.2]).eval(), pixels)
    mean = torch.tensor([0.1, 0.2, 0.3]).view(1, 3, 1, 1)
    std = torch.tensor([0.5, 0.25, 0.2]).view(1, 3, 1, 1)
    assert torch.allclose(out, (pixels.float() / 255 - mean) / std, atol=1e-5)


POOL = np.array([[[0.1] * 3, [0.2] * 3], [[0.5] * 3, [0.4] * 3], [[0.9] * 3, [0.8] * 3]])


def test_fedrdn_batch_draws_mean_and_std_from_the_pool_and_tests_with_own_statistics():
    norm = make_normalizer("fedrdn", POOL[1], POOL, "batch", device="cpu")
    rng = np.random.default_rng(3)
    seen_means, seen_stds = set(), set()
    for _ in range(60):
        scale, shift = norm.train(8, rng)
        std = 1 / (255 * scale.flatten()[0].item())
        mean = -shift.flatten()[0].item() * std
        seen_means.add(round(mean, 4))
        seen_stds.add(round(std, 4))
        assert scale.shape == (1, 3, 1, 1)
    assert seen_means == {0.1, 0.5, 0.9} and seen_stds == {0.2, 0.4, 0.8}
    scale, shift = norm.eval()
    assert np.isclose(1 / (255 * scale.flatten()[0].item()), 0.4)


def test_fedrdn_sample_draws_one_clients_pair_per_image():
    norm = make_normalizer("fedrdn", POOL[0], POOL, "sample", device="cpu")
    scale, shift = norm.train(50, np.random.default_rng(1))
    assert scale.shape == (50, 3, 1, 1)
    std = 1 / (255 * scale[:, 0, 0, 0].double())
    mean = -shift[:, 0, 0, 0].double() * std
    pairs = {(round(m, 4), round(s, 4)) for m, s in zip(mean.tolist(), std.tolist())}
    assert pairs == {(0.1, 0.2), (0.5, 0.4), (0.9, 0.8)}


@pytest.mark.parametrize("aug,expected", [("norm", POOL[2]), ("fedrdn-v", POOL.mean(axis=0))])
def test_norm_and_fedrdn_v_are_fixed_in_training_and_test(aug, expected):
    norm = make_normalizer(aug, POOL[2], POOL, "batch", device="cpu")
    for affine in (norm.train(4, np.random.default_rng(0)), norm.eval()):
        std = 1 / (255 * affine[0].flatten().double())
        assert torch.allclose(std, torch.tensor(expected[1]))
        assert torch.allclose(-affine[1].flatten().double() * std, torch.tensor(expected[0]), atol=1e-6)
