"""James-Stein shrinkage against FedStein eq. (9)."""

import pytest
import torch

from mpifl.models import james_stein, james_stein_factor
from mpifl.models.jsbn import JSBatchNorm1d, JSBatchNorm2d


def test_factor_by_hand():
    theta = torch.tensor([1.0, 2.0, 3.0, 4.0])
    # c = 4, biased variance across channels 1.25, ||theta||^2 = 30
    assert james_stein_factor(theta).item() == pytest.approx(1 - 2 * 1.25 / 30)
    torch.testing.assert_close(james_stein(theta), theta * (11 / 12))
    # JSNorm's variant with c/(c+1): 1 - 2 * 1.25 * 4/5 / 30
    assert james_stein_factor(theta, jsnorm_scale=True).item() == pytest.approx(14 / 15)
    torch.testing.assert_close(james_stein(theta, jsnorm_scale=True), theta * (14 / 15))


def test_matches_the_formula_on_random_vectors():
    torch.manual_seed(0)
    for c in (3, 16, 128):
        theta = torch.randn(c, dtype=torch.float64) * 0.3 + 0.1
        sigma2 = ((theta - theta.mean()) ** 2).mean()
        factor = 1 - (c - 2) * sigma2 / (theta**2).sum()
        torch.testing.assert_close(james_stein(theta), factor * theta)
        assert james_stein(theta.float()).dtype == torch.float32


def test_never_flips_sign():
    torch.manual_seed(1)
    for c in (3, 8, 64):
        for scale in (1e-20, 1e-3, 1.0, 1e6):
            theta = torch.randn(c) * scale  # zero-mean: the strongest shrinkage
            factor = james_stein_factor(theta).item()
            assert 2 / c - 1e-9 <= factor <= 1  # c * sigma^2 <= ||theta||^2
            shrunk = james_stein(theta)
            assert torch.all(shrunk * theta >= 0) and torch.isfinite(shrunk).all()
    # an explicit sigma^2 larger than ||theta||^2 / (c - 2) clamps the factor to 0
    theta = torch.tensor([1e-3, -1e-3, 2e-3, 0.5e-3])
    assert james_stein_factor(theta, sigma2=1.0).item() == 0.0
    assert torch.equal(james_stein(theta, sigma2=1.0), torch.zeros(4))


def test_degenerate_vectors():
    assert torch.equal(james_stein(torch.zeros(5)), torch.zeros(5))
    for theta in (torch.tensor([3.0]), torch.tensor([1.0, -2.0])):  # c <= 2: unchanged
        assert torch.equal(james_stein(theta), theta)
    for bad in (torch.zeros(0), torch.ones(2, 3)):
        with pytest.raises(ValueError):
            james_stein(bad)


def _js_layer(rule):
    torch.manual_seed(0)
    layer = JSBatchNorm2d(6)
    layer.sigma2_rule = rule
    with torch.no_grad():
        layer.weight.uniform_(0.5, 1.5)
        layer.bias.uniform_(-0.5, 0.5)
    return layer


@pytest.mark.parametrize("rule", ["channels", "sampling"])
def test_jsnorm_training_forward_uses_shrunk_batch_stats_and_tracks_them(rule):
    layer = _js_layer(rule)
    x = torch.randn(8, 6, 5, 5) * 2 + torch.linspace(-1, 3, 6).view(1, 6, 1, 1)
    out = layer(x)
    n = 8 * 5 * 5
    mean, var = x.double().mean((0, 2, 3)), x.double().var((0, 2, 3), correction=0)
    if rule == "channels":  # across the 6 channels
        js_mean, js_var = james_stein(mean), james_stein(var)
    else:  # each estimate's sampling variance, averaged over channels
        js_mean = james_stein(mean, sigma2=(var / n).mean())
        js_var = james_stein(var, sigma2=(2 * var**2 / (n - 1)).mean())
    assert not torch.allclose(js_mean, mean, rtol=0, atol=1e-6)  # the shrinkage is real
    expected = (x.double() - js_mean.view(1, 6, 1, 1)) / torch.sqrt(js_var.view(1, 6, 1, 1) + 1e-5) \
        * layer.weight.double().view(1, 6, 1, 1) + layer.bias.double().view(1, 6, 1, 1)
    torch.testing.assert_close(out, expected.float(), rtol=1e-5, atol=1e-5)
    # torch's running-statistics rule (momentum 0.1, variance * n/(n-1)) on the shrunk statistics
    torch.testing.assert_close(layer.running_mean, (0.1 * js_mean).float())
    torch.testing.assert_close(layer.running_var, (0.9 + 0.1 * js_var * n / (n - 1)).float())
    assert int(layer.num_batches_tracked) == 1
    out.sum().backward()
    assert layer.weight.grad is not None and torch.isfinite(layer.weight.grad).all()
    layer.eval()  # inference: BatchNorm with the (downloaded) running statistics
    torch.testing.assert_close(layer(x), torch.nn.functional.batch_norm(
        x, layer.running_mean, layer.running_var, layer.weight, layer.bias, False, 0.0, 1e-5))


@pytest.mark.parametrize("rule", ["channels", "sampling"])
def test_a_trained_jsnorm_model_evaluates_as_it_trained_on_its_own_data(rule):
    """Evaluation mode normalizes with the running statistics; on the training data it must give what
    training mode gives (the running statistics estimate the statistics training normalized with)."""
    torch.manual_seed(0)
    nn = torch.nn
    model = nn.Sequential(nn.Conv2d(3, 8, 3), JSBatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 16, 3), JSBatchNorm2d(16),
                          nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(64, 32), JSBatchNorm1d(32),
                          nn.ReLU(), nn.Linear(32, 4))
    for module in model.modules():
        if isinstance(module, JSBatchNorm2d | JSBatchNorm1d):
            module.sigma2_rule = rule
    x = torch.randn(64, 3, 12, 12) + torch.tensor([0.5, -0.3, 0.2]).view(1, 3, 1, 1)
    y = torch.randint(0, 4, (64,))
    batches = [(x[i:i + 16], y[i:i + 16]) for i in range(0, 64, 16)]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(5):
        for xb, yb in batches:
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(xb), yb).backward()
            optimizer.step()
    with torch.no_grad():  # the running statistics settle on the trained weights and the whole training set
        for _ in range(60):
            model(x)
        trained = model(x)
        model.eval()
        evaluated = model(x)
    gap = (evaluated - trained).norm() / trained.norm()
    assert gap < 0.05, f"evaluation departs from training by {gap:.1%} of the logits"
