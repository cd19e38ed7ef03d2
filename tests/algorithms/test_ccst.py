"""CCST: the styles shared (pooled or per image, by hand), the augmented training set (K versions per image:
the image itself or its stylization with another client's style), and one-line refusals."""

import numpy as np
import pytest
import torch
from torch import nn

from mpifl.algorithms import ClientState
from mpifl.algorithms.ccst import augmentation_plan, to_pixels
from mpifl.client.client_data import ClientData, ResidentImages
from mpifl.errors import MpiflError
from mpifl.models.adain import StyleModel, load_style_model
from mpifl.plan.clients import ClientSpec
from mpifl.plan.normalize import fixed
from mpifl.plan.seeding import setup_rng

from ..conftest import run_here
from .helpers import make_algo

SPLITS = ("train", "val", "test")


def _ccst(data_root, style_model, **options):
    return make_algo("ccst", {"data_root": str(data_root), "seed": 3}, style_model=str(style_model), **options)[0]


def _clients(sizes):
    return [ClientSpec(i, f"d{i}", {s: np.arange(n) for s in SPLITS}) for i, n in enumerate(sizes)]


def _data(pixels):
    """A client's data holding ``pixels`` (uint8, N x 3 x H x W) in every split, labels 0 .. N-1."""
    labels = torch.arange(len(pixels))
    return ClientData({s: ResidentImages(pixels) for s in SPLITS}, {s: labels for s in SPLITS},
                      fixed([0.5] * 3, [0.25] * 3))


def _pixels(n, seed, size=28, low=0, high=256):
    return torch.randint(low, high, (n, 3, size, size), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(seed))


def test_the_overall_style_pools_every_position_of_every_image(data_root, style_model):
    algo = _ccst(data_root, style_model)
    algo._model = StyleModel(nn.Sequential(), nn.Sequential())  # the encoder is the identity: features = p / 255
    dark, light = torch.full((1, 3, 2, 2), 51, dtype=torch.uint8), torch.full((1, 3, 2, 2), 153, dtype=torch.uint8)
    dark[0, 0, 0, 0] = 0
    style = algo.setup_contribution(_clients([2])[0], _data(torch.cat([dark, light])))
    values = torch.cat([dark, light])[:, 0].double().flatten() / 255
    assert style.shape == (2, 3)
    assert style[0, 0].item() == pytest.approx(values.mean().item(), abs=1e-7)
    assert style[1, 0].item() == pytest.approx((values.var(unbiased=False) + 1e-5).sqrt().item(), abs=1e-6)
    # channel 1 is constant within each image: the pooled std is the spread between the two images
    assert style[1, 1].item() == pytest.approx((0.04 + 1e-5) ** 0.5, abs=1e-6)


def test_single_styles_are_the_statistics_of_single_images_in_a_seeded_order(data_root, style_model):
    algo = _ccst(data_root, style_model, ccst_style="single", ccst_styles=3)
    algo.bind_clients(_clients([5, 4]))
    algo._model = StyleModel(nn.Sequential(), nn.Sequential())
    pixels = _pixels(5, 0, size=4)
    styles = algo.setup_contribution(_clients([5, 4])[0], _data(pixels))
    chosen = setup_rng(3, 0, 0).permutation(5)[:3]
    features = pixels[chosen].double().flatten(2) / 255
    assert styles.shape == (3, 2, 3) == tuple(algo.setup_exchange().shape)[:2] + (3,)
    assert torch.allclose(styles[:, 0], features.mean(2).float(), atol=1e-6)
    assert torch.allclose(styles[:, 1], (features.var(2, unbiased=False) + 1e-5).sqrt().float(), atol=1e-6)


def test_the_plan_draws_k_different_clients_per_image_and_leaves_the_own_version_unstyled():
    chosen, styles = augmentation_plan(np.random.default_rng(0), 3000, 3, 2, own=1, bank=5)
    assert chosen.shape == styles.shape == (3000, 2)
    assert (chosen[:, 0] != chosen[:, 1]).all() and set(np.unique(chosen)) == {0, 1, 2}
    assert ((styles == -1) == (chosen == 1)).all() and set(np.unique(styles[chosen != 1])) == set(range(5))
    assert np.allclose(np.bincount(chosen.ravel()) / 3000, 2 / 3, atol=0.03)  # each client in K/N of the images
    every, _ = augmentation_plan(np.random.default_rng(1), 50, 3, 3, own=0, bank=1)
    assert (np.sort(every, axis=1) == [0, 1, 2]).all()  # K = N: every client's version of every image


def test_each_training_image_comes_in_k_versions_itself_or_in_another_clients_style(data_root, style_model):
    algo = _ccst(data_root, style_model, ccst_k=2)
    specs = _clients([12, 12, 12])
    algo.bind_clients(specs)
    data = {c.id: _data(_pixels(12, c.id, low=80 * c.id, high=80 * c.id + 96)) for c in specs}  # 3 styles
    clients = {c.id: ClientState(spec=c, private={}) for c in specs}
    styles = torch.stack([algo.setup_contribution(clients[c], data[c]) for c in sorted(data)])
    assert styles.shape == (3, 2, 512)
    algo.setup_received(styles)
    out = algo.training_data({1: clients[1]}, {1: data[1]})[1]
    assert algo._model is None  # the style network is released once the sets are built
    original = data[1].images["train"].pixels
    augmented, labels = out.images["train"].pixels, out.labels["train"]
    assert augmented.shape == (24, 3, 28, 28) and torch.equal(labels, torch.arange(12).repeat_interleave(2))
    model = load_style_model(style_model)
    versions = {c: to_pixels(model.stylize(original.float() / 255, styles[c, 0].expand(12, -1),
                                           styles[c, 1].expand(12, -1))) for c in (0, 2)}
    versions[1] = original
    sources = [[next(c for c, v in versions.items() if torch.equal(augmented[2 * i + j], v[i])) for j in (0, 1)]
               for i in range(12)]
    assert not any(torch.equal(versions[0], v) for v in (versions[1], versions[2]))
    assert all(a != b for a, b in sources)  # two different clients' versions of each image
    assert 0 < sum(1 in s for s in sources) < 12 and {c for s in sources for c in s} == {0, 1, 2}
    assert torch.equal(out.images["val"].pixels, original) and out.own == ("own", 12)
    assert torch.equal(torch.cat(list(out.own_chunks())), original)  # its own statistics still read its images
    again = _ccst(data_root, style_model, ccst_k=2)
    again.bind_clients(specs)
    again.setup_received(styles)
    assert torch.equal(again.training_data({1: clients[1]}, {1: data[1]})[1].images["train"].pixels, augmented)


def test_k_defaults_to_every_training_client_and_is_refused_above_it(data_root, style_model):
    algo = _ccst(data_root, style_model)
    algo.bind_clients(_clients([4, 4, 4]))
    assert algo.k == 3 and tuple(algo.setup_exchange().shape) == (2, 512)
    with pytest.raises(MpiflError, match=r"^--ccst-k 4 exceeds the 3 training clients, .*use at most 3 \(0: all\)$"):
        _ccst(data_root, style_model, ccst_k=4).bind_clients(_clients([4, 4, 4]))
    with pytest.raises(MpiflError, match="^ccst transfers the styles of \\*other\\* clients; it needs at least 2"):
        _ccst(data_root, style_model).bind_clients(_clients([4]))
    single = _ccst(data_root, style_model, ccst_style="single")
    single.bind_clients(_clients([7, 5]))
    assert tuple(single.setup_exchange().shape) == (5, 2, 512)  # the smallest client's images
    with pytest.raises(MpiflError, match=r"^--ccst-styles 6 exceeds client 1's 5 training images"):
        _ccst(data_root, style_model, ccst_style="single", ccst_styles=6).bind_clients(_clients([7, 5]))


@pytest.mark.slow
def test_a_missing_style_model_is_one_line_before_anything_runs(data_root, tmp_path, style_model):
    with pytest.raises(MpiflError, match=r"^ccst stylizes with the AdaIN network, .*give --style-model DIR"):
        make_algo("ccst", {"data_root": str(data_root)})
    with pytest.raises(MpiflError, match=rf"^--style-model {tmp_path}: vgg_normalised.pth and decoder.pth must both"):
        _ccst(data_root, tmp_path)
    with pytest.raises(MpiflError, match=r"^--ccst-alpha must be in \[0, 1\], got 1.5$"):
        _ccst(data_root, style_model, ccst_alpha=1.5)
    job = run_here("--data-root", str(data_root), "--algo", "ccst", "--out", str(tmp_path / "run"), "--rounds", "1")
    assert job.returncode == 2 and len(job.stderr.splitlines()) == 1 and "--style-model DIR" in job.stderr
    assert not (tmp_path / "run").exists()
    wrong = tmp_path / "wrong"  # the right names, other weights (a pickle carrying code fails torch's weights_only)
    wrong.mkdir()
    torch.save({"0.weight": torch.zeros(3, 3, 1, 1)}, wrong / "vgg_normalised.pth")
    (wrong / "decoder.pth").write_bytes((style_model / "decoder.pth").read_bytes())
    job = run_here("--data-root", str(data_root), "--algo", "ccst", "--style-model", str(wrong),
                   "--out", str(tmp_path / "run"), "--rounds", "1")
    assert job.returncode == 2 and len(job.stderr.splitlines()) == 1, job.stderr
    assert f"{wrong / 'vgg_normalised.pth'} is not the AdaIN vgg_normalised" in job.stderr
    assert not (tmp_path / "run").exists()  # found at set-up: the same command, corrected, can run


@pytest.mark.slow
def test_the_styles_show_in_the_manifest_as_data_derived(data_root, style_model):
    job = run_here("--data-root", str(data_root), "--algo", "ccst", "--style-model", str(style_model),
                   "--show-manifest")
    assert job.returncode == 0, job.stderr
    setup = [l for l in job.stdout.splitlines() if l.startswith("setup exchange")]
    assert len(setup) == 1 and "ccst.styles [2, 512] float32 (4,096 bytes)" in setup[0]
    assert setup[0].endswith("data-derived: styles (VGG relu4_1 channel mean and std) of the client's training images")
