"""FedRDN and the normalization choices (Yan et al., 2023, arXiv, eqs. 5-8)."""

import numpy as np
import pytest
import torch

from mpifl.client.client_data import ClientData, ResidentImages, load_client_data
from mpifl.client.transforms import TrainTransforms
from mpifl.data import ensure_dataset, open_shard
from mpifl.plan.clients import make_clients
from mpifl.plan.normalize import InputNormalization, channel_stats, fixed, make_normalizer
from mpifl.plan.seeding import statistics_rng


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


# three clients' (mean, std), every value distinct: a draw is traced back to the client of its mean and of its std,
# and a channel mix-up matches no client
POOL = np.array([[[0.10, 0.12, 0.14], [0.20, 0.22, 0.24]],
                 [[0.50, 0.52, 0.54], [0.40, 0.42, 0.44]],
                 [[0.90, 0.92, 0.94], [0.80, 0.82, 0.84]]])


def _clients(scale, shift) -> list[tuple[int, int]]:
    """Per image (or the batch): (client whose mean, client whose std) the affine map uses, all channels."""
    std = 1 / (255 * scale.double().reshape(-1, 3))
    mean = -shift.double().reshape(-1, 3) * std
    out = []
    for m, s in zip(mean.numpy(), std.numpy()):
        mean_of = [k for k in range(3) if np.allclose(m, POOL[k, 0], atol=1e-6)]
        std_of = [k for k in range(3) if np.allclose(s, POOL[k, 1], atol=1e-6)]
        assert len(mean_of) == len(std_of) == 1, (m, s)  # exactly one client's row, channels in order
        out.append((mean_of[0], std_of[0]))
    return out


def test_fedrdn_batch_draws_mean_and_std_independently_per_batch_and_tests_with_own_statistics():
    norm = make_normalizer("fedrdn", POOL[1], POOL, "batch", device="cpu")
    rng = np.random.default_rng(3)
    drawn = []
    for _ in range(100):
        scale, shift = norm.train(8, rng)
        assert scale.shape == shift.shape == (1, 3, 1, 1)  # one draw for the whole batch
        drawn += _clients(scale, shift)
    # independent draws: every (mean client, std client) combination occurs; paired draws give the diagonal only
    assert set(drawn) == {(i, j) for i in range(3) for j in range(3)}
    assert _clients(*norm.eval()) == [(1, 1)]


def test_fedrdn_sample_draws_one_clients_pair_per_image():
    norm = make_normalizer("fedrdn", POOL[0], POOL, "sample", device="cpu")
    scale, shift = norm.train(60, np.random.default_rng(1))
    assert scale.shape == (60, 3, 1, 1)
    drawn = _clients(scale, shift)
    assert all(i == j for i, j in drawn)  # the mean and std of the same client
    assert {i for i, _ in drawn} == {0, 1, 2}
    assert _clients(*norm.eval()) == [(0, 0)]


@pytest.mark.parametrize("aug,expected", [("norm", POOL[2]), ("fedrdn-v", POOL.mean(axis=0))])
def test_norm_and_fedrdn_v_are_fixed_in_training_and_test(aug, expected):
    norm = make_normalizer(aug, POOL[2], POOL, "batch", device="cpu")
    for affine in (norm.train(4, np.random.default_rng(0)), norm.eval()):
        std = 1 / (255 * affine[0].flatten().double())
        assert torch.allclose(std, torch.tensor(expected[1]))
        assert torch.allclose(-affine[1].flatten().double() * std, torch.tensor(expected[0]), atol=1e-6)


def _client(pixels: np.ndarray, transforms=(), own=None) -> ClientData:
    images = {s: ResidentImages(torch.from_numpy(pixels)) for s in ("train", "val", "test")}
    labels = {s: torch.zeros(len(pixels), dtype=torch.int64) for s in images}
    return ClientData(images, labels, fixed([0.0] * 3, [1.0] * 3), TrainTransforms(transforms), own)


def _own_statistics(data: ClientData, stats: str, seed=7, client=0) -> np.ndarray:
    spec = type("Spec", (), {"id": client, "trains": True})()
    inputs = InputNormalization("norm", "batch", 3, stats, seed)
    inputs.attach([spec], {client: data}, "cpu")
    return inputs._own[client]


def test_own_statistics_are_computed_on_augmented_images_by_default_as_the_authors_code():
    pixels = np.random.default_rng(0).integers(0, 256, (6, 3, 4, 4), dtype=np.uint8)
    data = _client(pixels, ("jitter",))
    augmented = TrainTransforms(("jitter",))(torch.from_numpy(pixels).float(), statistics_rng(7, 0))
    assert np.allclose(_own_statistics(data, "augmented"), channel_stats([augmented], 3).numpy())
    raw = channel_stats([torch.from_numpy(pixels)], 3).numpy()
    assert np.allclose(_own_statistics(data, "raw"), raw)
    assert not np.allclose(_own_statistics(data, "augmented"), raw)  # jitter moves the statistics
    assert np.allclose(_own_statistics(_client(pixels), "augmented"), raw)  # no --train-transforms: the same


def test_a_held_out_domain_computes_its_statistics_on_its_training_split(data_root):
    manifest = ensure_dataset(data_root, "styledigits")
    spec = [c for c in make_clients(manifest, 1, seed=0, holdout="street") if c.domain == "street"]
    data = load_client_data(data_root, manifest, spec, torch.device("cpu"))
    inputs = InputNormalization("norm", "batch", 3, "raw")
    inputs.attach(spec, data, "cpu")
    with open_shard(data_root, manifest, "street") as shard:
        train = shard.load("train")[0].transpose(0, 3, 1, 2)
        everything = np.concatenate([shard.load(s)[0] for s in ("train", "val", "test")]).transpose(0, 3, 1, 2)
    assert np.allclose(inputs._own[spec[0].id], channel_stats([torch.from_numpy(train)], 3).numpy())
    assert not np.allclose(inputs._own[spec[0].id], channel_stats([torch.from_numpy(everything)], 3).numpy())
