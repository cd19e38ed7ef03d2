"""James-Stein shrinkage against FedStein eq. (9)."""

import pytest
import torch

from mpifl.models import james_stein, james_stein_factor
from mpifl.models.jsbn import JSBatchNorm2d


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


def test_jsnorm_training_forward_uses_shrunk_batch_stats_and_tracks_plain_ones():
    torch.manual_seed(0)
    bn = torch.nn.BatchNorm2d(6)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.5, 0.5)
    reference = torch.nn.BatchNorm2d(6)
    reference.load_state_dict(bn.state_dict())
    model = JSBatchNorm2d(6)
    model.load_state_dict(bn.state_dict())
    bn = model
    x = torch.randn(8, 6, 5, 5) * 2 + torch.linspace(-1, 3, 6).view(1, 6, 1, 1)
    out = model(x)
    mean, var = x.mean((0, 2, 3)), x.var((0, 2, 3), correction=0)
    js_mean = james_stein(mean.double()).float()
    js_var = james_stein(var.double()).float()
    expected = (x - js_mean.view(1, 6, 1, 1)) / torch.sqrt(js_var.view(1, 6, 1, 1) + 1e-5) \
        * bn.weight.view(1, 6, 1, 1) + bn.bias.view(1, 6, 1, 1)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(js_mean, mean)  # the shrinkage is real
    reference(x)  # torch's running-statistics rule on the plain batch statistics
    for key in ("running_mean", "running_var", "num_batches_tracked"):
        torch.testing.assert_close(bn.state_dict()[key], reference.state_dict()[key])
    out.sum().backward()
    assert bn.weight.grad is not None and torch.isfinite(bn.weight.grad).all()
    bn.eval()
    reference.eval()
    torch.testing.assert_close(bn(x), reference(x))  # inference: the (downloaded) running statistics
