"""FedMix: mean images exchanged once; the Taylor-approximated Mixup loss; FedAvg otherwise."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mpifl.algorithms.fedmix import MEANS, mean_rows
from mpifl.errors import MpiflError
from mpifl.plan.seeding import client_rng

from .helpers import make_algo


def _algo(data_root, **options):
    return make_algo("fedmix", {"data_root": str(data_root), "data": "styledigits"}, **options)


class FakeData:
    """``eval_batches`` over fixed (x, y) in order, as ClientData yields normalized inputs."""

    def __init__(self, x, y, batch=3):
        self.x, self.y, self.batch = x, y, batch

    def size(self, split):
        return len(self.y)

    def eval_batches(self, split, batch_size):
        for s in range(0, len(self.y), self.batch):
            yield self.x[s:s + self.batch], self.y[s:s + self.batch]


def test_mean_rows_average_groups_of_a_permutation_and_wrap_around():
    x = torch.arange(7, dtype=torch.float32)[:, None, None, None].expand(7, 1, 2, 1).contiguous()
    y = torch.tensor([0, 1, 2, 0, 1, 2, 0])
    order = torch.tensor([6, 2, 0, 5, 1, 3, 4])
    rows = mean_rows(FakeData(x, y).eval_batches("train", 0), 7, groups=3, per_group=2, num_classes=3, order=order)
    assert rows.shape == (3, 2 + 3)
    groups = [[6, 2], [0, 5], [1, 3]]
    for g, members in enumerate(groups):
        assert torch.allclose(rows[g, :2], torch.full((2,), sum(members) / 2))
        assert torch.allclose(rows[g, 2:], F.one_hot(y[members], 3).float().mean(0))
    wrapped = mean_rows(FakeData(x, y).eval_batches("train", 0), 7, groups=5, per_group=2, num_classes=3,
                        order=order)
    assert torch.allclose(wrapped[3, :2], torch.full((2,), (4 + 6) / 2))  # positions 6, 7 -> images 4, then 6 again
    assert torch.allclose(wrapped[4, :2], torch.full((2,), (2 + 0) / 2))


def test_setup_exchange_is_m_mean_images_with_soft_labels_and_policy_is_fedavgs(data_root):
    algo, _ = _algo(data_root, fedmix_means=8)
    spec = algo.setup_exchange()
    assert (spec.name, spec.shape, spec.dtype) == (MEANS, (8, 3 * 28 * 28 + 10), torch.float32)
    assert algo.policy() == make_algo("fedavg")[0].policy() and algo.evaluates == ("global",)
    torch.manual_seed(0)
    x, y = torch.randn(50, 3, 28, 28), torch.randint(0, 10, (50,))
    client = type("C", (), {"id": 4})()
    rows = algo.setup_contribution(client, FakeData(x, y, batch=16))
    order = torch.from_numpy(client_rng(0, 4, 0).permutation(50))
    first = order[:5]  # default --fedmix-batch 5
    assert torch.allclose(rows[0, :3 * 28 * 28], x[first].mean(0).flatten(), atol=1e-6)
    assert torch.allclose(rows[0, 3 * 28 * 28:], F.one_hot(y[first], 10).float().mean(0))
    algo.setup_received(torch.stack([rows, rows + 1]))
    assert algo._images.shape == (16, 3, 28, 28) and algo._labels.shape == (16, 10)
    assert torch.equal(algo._images[9], (rows[1, :3 * 28 * 28] + 1).reshape(3, 28, 28))


class Linear(nn.Module):
    """f(x) = W flatten(x) + b: the input gradient of CE is W^T (softmax - onehot), known in closed form."""

    def __init__(self):
        super().__init__()
        self.classifier = nn.Linear(4, 3)

    def encode(self, x):
        return x.flatten(1)


@pytest.mark.parametrize("scale", ["sample", "batch"])
def test_loss_matches_the_taylor_formula_and_trains_through_the_input_gradient(data_root, scale):
    options = {} if scale == "sample" else {"fedmix_taylor": "batch"}
    algo, _ = _algo(data_root, fedmix_lambda=0.2, **options)
    assert algo.cfg.opt("fedmix_taylor") == scale
    torch.manual_seed(0)
    model = Linear()
    x, y = torch.randn(5, 1, 2, 2), torch.tensor([0, 1, 2, 1, 0])
    x_bar, y_bar = torch.randn(5, 1, 2, 2), F.softmax(torch.randn(5, 3), 1)
    loss, logits = algo.fedmix_loss(model, x, y, x_bar, y_bar)
    lam, W, b = 0.2, model.classifier.weight, model.classifier.bias
    z = (1 - lam) * x.flatten(1) @ W.T + b
    p = F.softmax(z, 1)
    ce = -torch.log(p[torch.arange(5), y])
    soft = -(y_bar * torch.log(p)).sum(1)
    input_grad = (1 - lam) * (p - F.one_hot(y, 3)) @ W  # d/dx of (1 - lam) CE at (1 - lam) x
    if scale == "batch":
        input_grad = input_grad / 5  # d/dx of the batch mean (1 - lam) mean_i CE_i
    taylor = (input_grad * x_bar.flatten(1)).sum(1)
    expected = ((1 - lam) * ce + lam * soft + lam * taylor).mean()
    assert torch.allclose(logits, z) and torch.allclose(loss, expected, atol=1e-6)
    grads = torch.autograd.grad(loss, [W, b])
    expected_grads = torch.autograd.grad(expected, [W, b], retain_graph=True)
    assert all(torch.allclose(g, e, atol=1e-6) for g, e in zip(grads, expected_grads))
    plain = torch.autograd.grad(((1 - lam) * ce + lam * soft).mean(), [W])[0]
    assert not torch.allclose(grads[0], plain, atol=1e-4)  # the derivative term trains the weights


def test_lambda_zero_is_fedavgs_cross_entropy(data_root):
    algo, model = _algo(data_root, fedmix_lambda=0.0)
    x, y = torch.randn(6, 3, 28, 28), torch.arange(6)
    loss, logits = algo.fedmix_loss(model, x, y, torch.randn(6, 3, 28, 28), torch.full((6, 10), 0.1))
    assert torch.equal(logits, model(x)) and torch.equal(loss, F.cross_entropy(model(x), y))


def test_batch_loss_draws_mean_images_with_torchs_generator(data_root):
    algo, model = _algo(data_root)
    algo.setup_exchange()
    algo.setup_received(torch.randn(3, 64, 3 * 28 * 28 + 10))
    x, y = torch.randn(4, 3, 28, 28), torch.arange(4)
    torch.manual_seed(1)
    first, _ = algo.batch_loss(None, model, x, y)
    torch.manual_seed(1)
    pick = torch.randint(3 * 64, (4,))
    torch.manual_seed(1)
    again, _ = algo.batch_loss(None, model, x, y)
    expected, _ = algo.fedmix_loss(model, x, y, algo._images[pick], algo._labels[pick])
    assert torch.allclose(first, again) and torch.allclose(first, expected)


@pytest.mark.parametrize("bad", [{"fedmix_lambda": 1.0}, {"fedmix_batch": 0}, {"fedmix_means": 0},
                                 {"fedmix_taylor": "mean"}])
def test_bad_options(data_root, bad):
    with pytest.raises(MpiflError):
        _algo(data_root, **bad)
