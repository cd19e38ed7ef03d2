"""ELCFS: amplitude spectra exchanged once, frequency-space interpolation of the low band, the episodic
meta-step; FedAvg otherwise."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mpifl.algorithms import get_algorithm
from mpifl.algorithms.elcfs import AMPLITUDES, band_mask, interpolate_amplitude, other_client, spectra_of
from mpifl.errors import MpiflError
from mpifl.models import state_entries
from mpifl.plan.clients import ClientSpec
from mpifl.plan.config import RunConfig
from mpifl.plan.seeding import client_rng
from mpifl.transport.exchange import exchange_all
from mpifl.transport.inprocess import run_threads

from ..conftest import read_metrics
from .helpers import local_round, make_algo, run_two_rounds


def _algo(data_root, cfg_kw=None, **options):
    return make_algo("elcfs", {"data_root": str(data_root), "data": "styledigits", **(cfg_kw or {})}, **options)


def _specs(sizes, held_out=()):
    return [ClientSpec(i, f"d{i}", {"train": np.arange(n), "val": np.arange(0), "test": np.arange(0)},
                       trains=i not in held_out) for i, n in enumerate(sizes)]


def code_reference(image, target_amp, band, lam):
    """The authors' recipe in numpy, full spectrum: fftshift, the (2b + 1)^2 square at floor(H / 2),
    floor(W / 2), interpolation there, own phase, real part of the inverse FFT, clip to [0, 255]."""
    spectrum = np.fft.fft2(image, axes=(-2, -1))
    amp, phase = np.abs(spectrum), np.angle(spectrum)
    a, t = np.fft.fftshift(amp, axes=(-2, -1)), np.fft.fftshift(target_amp, axes=(-2, -1))
    h, w = image.shape[-2:]
    b = int(np.floor(min(h, w) * band))
    ch, cw = h // 2, w // 2
    a[..., ch - b:ch + b + 1, cw - b:cw + b + 1] = ((1 - lam) * a[..., ch - b:ch + b + 1, cw - b:cw + b + 1]
                                                   + lam * t[..., ch - b:ch + b + 1, cw - b:cw + b + 1])
    mixed = np.fft.ifftshift(a, axes=(-2, -1)) * np.exp(1j * phase)
    return np.clip(np.real(np.fft.ifft2(mixed, axes=(-2, -1))), 0, 255)


def full_amplitude(image):
    return np.abs(np.fft.fft2(image, axes=(-2, -1)))


# ------------------------------------------------------------------ the band
@pytest.mark.parametrize("h, w, ratio, b", [(28, 28, 0.0, 0), (28, 28, 0.1, 2), (7, 9, 0.3, 2), (8, 6, 0.5, 3)])
def test_band_mask_is_the_square_of_side_2b_plus_1_around_the_shifted_centre(h, w, ratio, b):
    mask = band_mask(h, w, ratio)
    assert mask.shape == (h, w // 2 + 1)
    full = np.zeros((h, w), dtype=bool)
    full[h // 2 - b:h // 2 + b + 1, w // 2 - b:w // 2 + b + 1] = True
    full = np.fft.ifftshift(full)
    assert full.sum() == min(2 * b + 1, h) * min(2 * b + 1, w)
    assert np.array_equal(mask.numpy(), full[:, :w // 2 + 1])


def test_band_zero_is_the_zero_frequency_alone():
    mask = band_mask(28, 28, 0.0)
    assert mask.sum() == 1 and mask[0, 0]


# ------------------------------------------------------------ interpolation
def _images(seed, shape, low=0, high=255):
    return torch.from_numpy(np.random.default_rng(seed).uniform(low, high, shape)).float()


def test_lambda_zero_gives_the_image_back():
    p, q = _images(0, (2, 3, 6, 5)), _images(1, (2, 3, 6, 5))
    target = torch.fft.rfft2(q.double()).abs()
    out = interpolate_amplitude(p, target, torch.zeros(2), band_mask(6, 5, 0.5))
    assert torch.allclose(out, p, atol=1e-4)


def test_lambda_one_on_every_frequency_is_the_others_amplitude_with_own_phase():
    p, q = _images(2, (1, 2, 4, 4), 100, 150), _images(3, (1, 2, 4, 4), 120, 130)
    target = torch.fft.rfft2(q.double()).abs()
    out = interpolate_amplitude(p, target, torch.ones(1), band_mask(4, 4, 0.5))
    assert 0 < out.min() and out.max() < 255  # no clipping here, so the spectrum is exactly the mix
    spectrum = np.fft.fft2(out.double().numpy(), axes=(-2, -1))
    assert np.allclose(np.abs(spectrum), full_amplitude(q.double().numpy()), atol=1e-3)
    own = np.fft.fft2(p.double().numpy(), axes=(-2, -1))
    assert np.allclose(np.exp(1j * np.angle(spectrum)), np.exp(1j * np.angle(own)), atol=1e-5)


@pytest.mark.parametrize("shape, band, lam", [((2, 3, 8, 8), 0.25, 0.3), ((1, 3, 7, 9), 0.3, 0.8),
                                              ((1, 1, 6, 10), 0.0, 1.0)])
def test_interpolation_matches_the_authors_full_spectrum_recipe(shape, band, lam):
    p, q = _images(4, shape), _images(5, shape)
    target = torch.fft.rfft2(q.double()).abs()
    out = interpolate_amplitude(p, target, torch.full((shape[0],), lam), band_mask(*shape[-2:], band))
    expected = code_reference(p.double().numpy(), full_amplitude(q.double().numpy()), band, lam)
    assert np.allclose(out.numpy(), expected, atol=1e-3)
    assert (out == 0).any() or (out == 255).any() or band == 0  # the clip acts


def test_band_zero_lambda_one_moves_each_channel_mean_to_the_others():
    """The default: only the zero frequency changes, so each channel is shifted to the other's mean."""
    p, q = _images(6, (1, 3, 5, 5), 80, 120), _images(7, (1, 3, 5, 5), 60, 200)
    target = torch.fft.rfft2(q.double()).abs()
    out = interpolate_amplitude(p, target, torch.ones(1), band_mask(5, 5, 0.0))
    expected = p - p.mean((2, 3), keepdim=True) + q.mean((2, 3), keepdim=True)
    assert torch.allclose(out, expected, atol=1e-3)


# ------------------------------------------------------------------ the bank
class FakeData:
    """A client's stored training images in chunks, and its normalization."""

    def __init__(self, pixels, scale, shift, chunk=7):
        self.pixels, self.chunk = pixels, chunk
        self.own = ("train", len(pixels))
        self.normalizer = type("N", (), {"eval": staticmethod(lambda: (scale, shift))})()

    def pixel_chunks(self, split):
        for s in range(0, len(self.pixels), self.chunk):
            yield self.pixels[s:s + self.chunk]


def test_bank_default_is_an_eighth_of_the_smallest_training_client_and_bad_sizes_are_refused(data_root):
    algo, _ = _algo(data_root)
    algo.bind_clients(_specs([80, 45, 200, 9], held_out=(3,)))
    assert algo.bank_size == 45 // 8 and algo.training_ids == [0, 1, 2]
    assert algo.setup_exchange().shape == (5, 3, 28, 15)
    algo, _ = _algo(data_root, elcfs_bank=46)
    with pytest.raises(MpiflError, match="exceeds client 1's 45"):
        algo.bind_clients(_specs([80, 45, 200]))
    algo, _ = _algo(data_root)
    with pytest.raises(MpiflError, match="at least 2 training clients"):
        algo.bind_clients(_specs([80, 45], held_out=(1,)))


def test_contribution_is_the_amplitudes_of_seeded_training_images(data_root):
    algo, _ = _algo(data_root, elcfs_bank=6)
    algo.bind_clients(_specs([30, 30]))
    spec = algo.setup_exchange()
    assert (spec.name, spec.shape, spec.dtype) == (AMPLITUDES, (6, 3, 28, 15), torch.float32)
    assert spec.derived == "amplitude spectra of the client's training images"
    pixels = torch.randint(0, 256, (30, 3, 28, 28), dtype=torch.uint8)
    client = type("C", (), {"id": 1})()
    rows = algo.setup_contribution(client, FakeData(pixels, torch.ones(1, 3, 1, 1), torch.zeros(1, 3, 1, 1)))
    chosen = client_rng(0, 1, 0).permutation(30)[:6]
    assert rows.shape == spec.shape
    for i, image in enumerate(chosen):
        assert np.allclose(rows[i].numpy(), full_amplitude(pixels[image].double().numpy())[..., :15], rtol=1e-6)


def test_spectra_of_reports_images_it_never_read():
    with pytest.raises(MpiflError, match="1 chosen training images were not read"):
        spectra_of(iter([torch.zeros(3, 1, 2, 2)]), torch.tensor([1, 5]), (2, 1, 2, 2))


def test_every_rank_receives_every_training_clients_bank_in_client_id_order(data_root):
    """Ranks 1 and 2 host clients {0, 2} and {1}: all three banks arrive everywhere, in id order."""
    images = {c: torch.randint(0, 256, (16, 3, 28, 28), dtype=torch.uint8) for c in range(3)}
    hosted = {0: [], 1: [0, 2], 2: [1]}
    received = {}

    def rank_main(comm):
        algo, _ = _algo(data_root, elcfs_bank=2)
        algo.bind_clients(_specs([16, 16, 16]))
        affine = (torch.ones(1, 3, 1, 1), torch.zeros(1, 3, 1, 1))
        exchange_all(comm, [algo], [hosted[1], hosted[2]], lambda ex: [
            ex.setup_contribution(type("C", (), {"id": c})(), FakeData(images[c], *affine)) for c in hosted[comm.rank]])
        received[comm.rank] = algo._amplitudes

    run_threads(3, rank_main)
    for c in range(3):
        first = client_rng(0, c, 0).permutation(16)[0]
        expected = full_amplitude(images[c][first].double().numpy())[..., :15]
        for rank in range(3):
            assert received[rank].shape == (3, 2, 3, 28, 15)
            assert np.allclose(received[rank][c, 0].numpy(), expected, rtol=1e-6)


# ------------------------------------------------------------ training inputs
def test_other_client_never_draws_the_own_row_and_reaches_every_other():
    torch.manual_seed(0)
    rows = other_client(1, 4, 2000)
    assert set(rows.tolist()) == {0, 2, 3}


def test_interpolated_inputs_undo_the_normalization_and_use_the_drawn_amplitudes(data_root):
    algo, _ = _algo(data_root, elcfs_bank=3, elcfs_band=0.1, elcfs_lambda="uniform")
    algo.bind_clients(_specs([8, 8, 8]))
    scale = torch.tensor([0.02, 0.03, 0.01]).reshape(1, 3, 1, 1)
    shift = torch.tensor([-1.0, -2.0, 0.5]).reshape(1, 3, 1, 1)
    algo._pixel_affine[2] = (scale, shift)
    algo.setup_received(_images(8, (3, 3, 3, 28, 15), 0, 2000))
    pixels = _images(9, (4, 3, 28, 28))
    x = pixels * scale + shift
    torch.manual_seed(3)
    moved = algo.interpolated_inputs(2, x)
    torch.manual_seed(3)
    rows, picks, lam = other_client(2, 3, 4), torch.randint(3, (4,)), torch.rand(4)
    assert set(rows.tolist()) <= {0, 1}
    expected = torch.stack([torch.from_numpy(code_reference(
        pixels[i].double().numpy(), _hermitian(algo._amplitudes[rows[i], picks[i]].double(), 28).numpy(),
        0.1, float(lam[i]))) for i in range(4)]).float()
    assert torch.allclose((moved - shift) / scale, expected, atol=2e-2)


def _hermitian(half, width):
    """The full (H, W) amplitude whose rfft2 half is ``half`` (|X(-u, -v)| = |X(u, v)|)."""
    h = half.shape[-2]
    full = torch.zeros(*half.shape[:-1], width, dtype=half.dtype)
    full[..., :half.shape[-1]] = half
    for v in range(half.shape[-1], width):
        full[..., v] = half[..., (-torch.arange(h)) % h, width - v]
    return full


# ------------------------------------------------------------------ meta-step
class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.classifier = nn.Linear(4, 3)

    def encode(self, x):
        return x.flatten(1)

    def forward(self, x):
        return self.classifier(self.encode(x))


@pytest.mark.parametrize("order", ["first", "second"])
def test_meta_step_gradient_matches_the_reference(data_root, order):
    algo, _ = _algo(data_root, elcfs_inner_lr=0.5, elcfs_clip=0.05, elcfs_order=order)
    torch.manual_seed(0)
    model = Tiny()
    x, x_moved, y = torch.randn(5, 1, 2, 2), torch.randn(5, 1, 2, 2), torch.tensor([0, 1, 2, 1, 0])
    loss, logits = algo.episodic_loss(None, model, x, x_moved, y)
    W, b = model.classifier.weight, model.classifier.bias
    grads = torch.autograd.grad(loss, [W, b])

    def ce(weight, bias, inputs):
        return F.cross_entropy(inputs.flatten(1) @ weight.T + bias, y)

    inner_grads = torch.autograd.grad(ce(W, b, x), [W, b], create_graph=order == "second")
    assert any((g.abs() > 0.05).any() for g in inner_grads)  # the clamp acts
    W2, b2 = (p - 0.5 * g.clamp(-0.05, 0.05) for p, g in zip((W, b), inner_grads))
    expected_loss = ce(W, b, x) + ce(W2, b2, x_moved)
    assert torch.allclose(loss, expected_loss) and torch.allclose(logits, x.flatten(1) @ W.T + b)
    W2d, b2d = W2.detach().requires_grad_(), b2.detach().requires_grad_()
    at_adapted = torch.autograd.grad(ce(W2d, b2d, x_moved), [W2d, b2d])
    first_order = [gi.detach() + go for gi, go in zip(inner_grads, at_adapted)]  # d theta' / d theta = I
    full = torch.autograd.grad(expected_loss, [W, b]) if order == "second" else None
    expected = first_order if order == "first" else full
    assert all(torch.allclose(g, e, atol=1e-6) for g, e in zip(grads, expected))
    if order == "second":  # differentiating through the clamped inner step changes the gradient
        assert not torch.allclose(grads[0], first_order[0], atol=1e-5)


def test_frozen_parameters_take_no_inner_step(data_root):
    algo, _ = _algo(data_root, elcfs_inner_lr=0.5)
    torch.manual_seed(0)
    model = Tiny()
    model.classifier.bias.requires_grad_(False)
    x, y = torch.randn(3, 1, 2, 2), torch.tensor([0, 1, 2])
    loss, _ = algo.episodic_loss(None, model, x, x, y)
    loss.backward()
    assert model.classifier.bias.grad is None and model.classifier.weight.grad is not None


class Linear28(nn.Module):
    """logits = W flatten(x) + b on the dataset's 3 x 28 x 28 images (the exchange's shape), 3 classes."""

    def __init__(self):
        super().__init__()
        self.classifier = nn.Linear(3 * 28 * 28, 3)

    def encode(self, x):
        return x.flatten(1)

    def forward(self, x):
        return self.classifier(self.encode(x))


def _softmax_ce_grads(W, b, X, Y):
    """(dW, db) of the mean cross-entropy of softmax(X W^T + b) against one-hot Y, by hand: (P - Y)^T X / N."""
    z = X @ W.T + b
    P = np.exp(z - z.max(1, keepdims=True))
    P /= P.sum(1, keepdims=True)
    return (P - Y).T @ X / len(X), (P - Y).mean(0)


def test_one_client_round_is_the_episodic_step_on_images_carrying_the_other_clients_mean_by_hand(data_root):
    """One round of client 0 through the runtime (load_state, client_round, one SGD step at lr 0.1) under the
    defaults lambda = 1, band 0: the zero frequency alone becomes the other client's, i.e. each channel of
    each image is moved to the mean of client 1's banked image, then clipped to [0, 255].  The update is
    -lr (grad L(x; theta) + grad L(x'; theta')), theta' = theta - beta clamp(grad L(x; theta), +-g_max)."""
    cls = get_algorithm("elcfs")
    beta, g_max, lr = 0.005, 0.2, 0.1  # a step that moves the logits by about 1, short of saturating them
    cfg = RunConfig(algo="elcfs", data_root=str(data_root), data="styledigits", lr=lr,
                    algo_options={**{o.name: o.default for o in cls.options}, "elcfs_bank": 1,
                                  "elcfs_inner_lr": beta, "elcfs_clip": g_max})
    torch.manual_seed(0)
    model = Linear28()
    algo = cls(cfg, state_entries(model))
    specs = _specs([4, 1])  # client 1 holds one image: its bank, and so the drawn amplitude, is that image's
    algo.bind_clients(specs)
    algo.setup_exchange()
    own, other = _images(10, (4, 3, 28, 28), 60, 200).round(), _images(11, (1, 3, 28, 28), 0, 120).round()
    scale = torch.tensor([0.02, 0.03, 0.01]).reshape(1, 3, 1, 1)
    shift = torch.tensor([-1.0, -2.0, 0.5]).reshape(1, 3, 1, 1)
    identity = (torch.ones(1, 3, 1, 1), torch.zeros(1, 3, 1, 1))
    algo.setup_received(torch.stack([algo.setup_contribution(specs[0], FakeData(own, scale, shift)),
                                     algo.setup_contribution(specs[1], FakeData(other, *identity))]))
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    client = algo.init_client(specs[0], initial)
    x, y = own * scale + shift, torch.tensor([0, 1, 2, 1])
    upload = local_round(algo, model, client, algo.download(algo.init_server(initial)), 1, batch=(x, y))

    pixels, target = own.double().numpy(), other.double().numpy()
    moved = np.clip(pixels - pixels.mean((2, 3), keepdims=True) + target.mean((2, 3), keepdims=True), 0, 255)
    assert (moved == 0).any()  # the clip acts
    X = x.double().flatten(1).numpy()
    X_moved = (moved * scale.double().numpy() + shift.double().numpy()).reshape(4, -1)
    Y = np.eye(3)[y.numpy()]
    W, b = initial["classifier.weight"].double().numpy(), initial["classifier.bias"].double().numpy()
    gW, gb = _softmax_ce_grads(W, b, X, Y)
    assert (np.abs(gW) > g_max).any() and (np.abs(gW) < g_max).any()  # the clamp acts, on some entries only
    W_in, b_in = W - beta * np.clip(gW, -g_max, g_max), b - beta * np.clip(gb, -g_max, g_max)
    gW_out, gb_out = _softmax_ce_grads(W_in, b_in, X_moved, Y)
    assert np.allclose(upload["classifier.weight"], W - lr * (gW + gW_out), rtol=0, atol=2e-6)
    assert np.allclose(upload["classifier.bias"], b - lr * (gb + gb_out), rtol=0, atol=2e-6)


# ------------------------------------------------------------------ options, run
@pytest.mark.parametrize("bad", [{"elcfs_bank": -1}, {"elcfs_band": 0.6}, {"elcfs_lambda": "half"},
                                 {"elcfs_inner_lr": -1.0}, {"elcfs_clip": 0.0}, {"elcfs_order": "third"}])
def test_bad_options(data_root, bad):
    with pytest.raises(MpiflError):
        _algo(data_root, **bad)


def test_fedrdn_normalization_is_refused(data_root):
    with pytest.raises(MpiflError, match="--aug fedrdn"):
        _algo(data_root, {"aug": "fedrdn"})


@pytest.mark.slow
def test_two_rounds_send_fedavgs_model_and_train_on_the_two_pass_episodic_objective(data_root, tmp_path):
    """The wire is FedAvg's; the training loss a round reports is the episodic objective L(x) + L_out(x'), two
    task losses, each near ln 10 for the barely trained 10-class model of round 1 (FedAvg's one pass reports
    about ln 10; the exact rule is pinned by the one-round hand computation above), and it falls."""
    run = tmp_path / "elcfs"
    run_two_rounds(data_root, run, "elcfs")
    fedavg = make_algo("fedavg")[0].policy()
    model_bytes = sum(s.nbytes for s in fedavg.download)
    records = read_metrics(run)
    for record in records:
        assert record["bytes"]["down"] == record["bytes"]["up"] == 5 * model_bytes
        assert set(record["eval"]) == {"global"} and math.isfinite(record["train"]["loss"])
    assert 1.7 * math.log(10) < records[0]["train"]["loss"] < 2.1 * math.log(10)
    assert records[1]["train"]["loss"] < records[0]["train"]["loss"]
