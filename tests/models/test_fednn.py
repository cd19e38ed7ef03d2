"""FedNN: WN conv (public-code form of eq. 4) and AGN (eqs. 5-10)."""

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from mpifl.models import AdaptiveGroupNorm, WNConv2d, build_model, set_agn_tau


def test_wn_conv_weight_and_forward():
    torch.manual_seed(0)
    conv = WNConv2d(3, 5, 3, padding=1)
    w = conv.weight.detach().double().flatten(1)
    centered = w - w.mean(1, keepdim=True)
    expected = centered / (centered.std(1, keepdim=True) + 1e-5)  # unbiased std + 1e-5
    w_hat = conv.effective_weight()
    torch.testing.assert_close(w_hat.double().flatten(1), expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w_hat.double().flatten(1).mean(1), torch.zeros(5, dtype=torch.float64),
                               atol=1e-6, rtol=0)  # fmt: skip
    x = torch.randn(2, 3, 6, 6)
    torch.testing.assert_close(conv(x), F.conv2d(x, w_hat, conv.bias, padding=1))
    assert list(conv.state_dict()) == ["weight", "bias"]


def make_agn(c=6, **kwargs):
    torch.manual_seed(0)
    layer = AdaptiveGroupNorm(c, **kwargs)
    with torch.no_grad():
        layer.weight.normal_()
        layer.bias.normal_()
    return layer


def stats(x, groups=2):
    n, c = x.shape[:2]
    dims = (0,) + tuple(range(2, x.dim()))
    mean_bn = x.mean(dims, keepdim=True)
    var_bn = x.var(dims, unbiased=False, keepdim=True)
    g = x.reshape(n, groups, -1)
    shape = (n, c) + (1,) * (x.dim() - 2)
    mean_gn = g.mean(2).repeat_interleave(c // groups, 1).view(shape)
    var_gn = g.var(2, unbiased=False).repeat_interleave(c // groups, 1).view(shape)
    return mean_bn, var_bn, mean_gn, var_gn


def test_defaults_and_state():
    layer = AdaptiveGroupNorm(8)
    assert layer.num_groups == 2 and layer.eps == 1e-5 and layer.tau == 5.0
    assert layer.decay == 0.997
    assert torch.equal(layer.select_logits, torch.ones(2))
    assert list(layer.state_dict()) == [
        "weight", "bias", "select_logits", "running_mean", "running_var", "choice",
    ]  # fmt: skip
    assert int(layer.choice) == -1 and not layer.is_frozen
    assert layer.mix == "var" and not layer.eval_noise


def test_norm_agn_mixes_variances_by_default_the_authors_code_not_eq_10():
    """x (1, 2, 1, 2): channel 0 = [0, 2] (GN mean 1, var 1), channel 1 = [1, 1] (mean 1, var 0); running BN
    mean 0, var 4; s = (1/2, 1/2).  var: sigma = sqrt(2 + var_GN / 2); eq. 10 (std): sigma = 1 + sd_GN / 2."""
    built = [m for m in build_model("smallcnn", num_classes=10, norm="agn", conv="wn").modules()
             if isinstance(m, AdaptiveGroupNorm)]
    assert built and all(m.mix == "var" for m in built)
    x = torch.tensor([[[[0.0, 2.0]], [[1.0, 1.0]]]])
    expected = {"var": [[-0.5 / 2.5 ** 0.5, 1.5 / 2.5 ** 0.5], [0.5 / 2 ** 0.5] * 2],
                "std": [[-0.5 / 1.5, 1.5 / 1.5], [0.5 / (1 + 0.5 * 1e-5 ** 0.5)] * 2]}
    for mix in ("default", "std"):
        layer = AdaptiveGroupNorm(2) if mix == "default" else AdaptiveGroupNorm(2, mix="std")
        layer.running_var.fill_(4.0)
        layer.eval()
        rule = "var" if mix == "default" else "std"
        torch.testing.assert_close(layer(x)[0, :, 0], torch.tensor(expected[rule]), rtol=0, atol=1e-5)


def test_one_hot_on_bn_is_batch_norm_with_momentum_0_003():
    layer = make_agn()
    layer.freeze(0)
    bn = nn.BatchNorm2d(6, momentum=0.003)
    bn.load_state_dict({"weight": layer.weight, "bias": layer.bias}, strict=False)
    x = torch.randn(4, 6, 5, 5) * 3 + 1
    torch.testing.assert_close(layer(x), bn(x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer.running_mean, bn.running_mean)
    torch.testing.assert_close(layer.running_var, bn.running_var)
    # decay 0.997 written out: running = 0.997 * running + 0.003 * batch (unbiased var)
    torch.testing.assert_close(layer.running_mean, 0.003 * x.mean((0, 2, 3)))
    torch.testing.assert_close(layer.running_var, 0.997 + 0.003 * x.var((0, 2, 3)))
    layer.eval(), bn.eval()
    torch.testing.assert_close(layer(x), bn(x), rtol=1e-5, atol=1e-5)


def test_one_hot_on_gn_is_group_norm_with_two_groups():
    layer = make_agn()
    layer.freeze(1)
    x = torch.randn(4, 6, 5, 5) * 2 - 1
    expected = F.group_norm(x, 2, layer.weight, layer.bias, eps=1e-5)
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)
    layer.eval()
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)


def test_one_hot_on_vectors():
    layer = make_agn(c=8)
    x = torch.randn(5, 8)
    layer.freeze(0)
    bn = F.batch_norm(x, None, None, layer.weight, layer.bias, training=True, eps=1e-5)
    torch.testing.assert_close(layer(x), bn, rtol=1e-5, atol=1e-5)
    layer.freeze(1)
    gn = F.group_norm(x, 2, layer.weight, layer.bias, eps=1e-5)
    torch.testing.assert_close(layer(x), gn, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mix", ["std", "var"])
def test_training_mixes_with_a_gumbel_softmax_draw(mix):
    layer = make_agn(mix=mix, tau=2.0)
    with torch.no_grad():
        layer.select_logits.copy_(torch.tensor([0.3, -0.2]))
    x = torch.randn(3, 6, 4, 4) * 2 + 0.5
    torch.manual_seed(7)
    s = F.gumbel_softmax(layer.select_logits.detach(), tau=2.0, hard=False)
    torch.manual_seed(7)
    out = layer(x)
    torch.testing.assert_close(layer.last_selection, s)
    mean_bn, var_bn, mean_gn, var_gn = stats(x)
    mean = s[0] * mean_bn + s[1] * mean_gn
    if mix == "std":  # paper eq. (10): mix the standard deviations
        sigma = s[0] * (var_bn + 1e-5).sqrt() + s[1] * (var_gn + 1e-5).sqrt()
    else:  # public code: mix the variances
        sigma = (s[0] * var_bn + s[1] * var_gn + 1e-5).sqrt()
    expected = (x - mean) / sigma * layer.weight.view(1, 6, 1, 1) + layer.bias.view(1, 6, 1, 1)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    out.sum().backward()
    assert layer.select_logits.grad.abs().sum() > 0


def test_eval_is_noise_free_softmax_over_tau_with_running_bn_stats():
    layer = make_agn(tau=0.5, mix="std")
    with torch.no_grad():
        layer.select_logits.copy_(torch.tensor([1.0, 0.4]))
        layer.running_mean.normal_()
        layer.running_var.uniform_(0.5, 2.0)
    layer.eval()
    x = torch.randn(2, 6, 3, 3)
    s = torch.softmax(torch.tensor([1.0, 0.4]) / 0.5, 0)
    _, _, mean_gn, var_gn = stats(x)
    mean = s[0] * layer.running_mean.view(1, 6, 1, 1) + s[1] * mean_gn
    sigma = s[0] * (layer.running_var.view(1, 6, 1, 1) + 1e-5).sqrt() + s[1] * (var_gn + 1e-5).sqrt()
    expected = (x - mean) / sigma * layer.weight.view(1, 6, 1, 1) + layer.bias.view(1, 6, 1, 1)
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)
    before = layer.running_mean.clone()
    assert torch.equal(layer(x), layer(x)) and torch.equal(layer.running_mean, before)


def test_eval_noise_draws_a_gumbel_softmax_at_every_forward():
    layer = make_agn(tau=0.5, eval_noise=True)
    with torch.no_grad():
        layer.select_logits.copy_(torch.tensor([1.0, 0.4]))
        layer.running_var.fill_(2.0)
    layer.eval()
    x = torch.randn(2, 6, 3, 3)
    torch.manual_seed(11)
    s = F.gumbel_softmax(torch.tensor([1.0, 0.4]), tau=0.5, hard=False)
    torch.manual_seed(11)
    out = layer(x)
    _, _, mean_gn, var_gn = stats(x)
    sigma = (s[0] * 2.0 + s[1] * var_gn + 1e-5).sqrt()
    expected = (x - s[1] * mean_gn) / sigma * layer.weight.view(1, 6, 1, 1) + layer.bias.view(1, 6, 1, 1)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert not torch.equal(layer(x), out)  # a new draw
    assert not layer.is_frozen and layer.last_selection is None


def test_freezes_once_a_draw_is_one_hot():
    layer = make_agn(tau=1e-4)  # this small a temperature gives an exactly one-hot draw
    x = torch.randn(4, 6, 3, 3)
    layer(x)
    s = layer.last_selection
    assert float(s.max() - s.min()) >= 1
    assert layer.is_frozen and int(layer.choice) == int(s.argmax())
    frozen = copy.deepcopy(layer)
    frozen.freeze_on_one_hot = False
    layer.tau = 5.0  # soft draws from now on, but the frozen choice wins
    layer.zero_grad()
    out = layer(x)
    out.sum().backward()
    assert torch.equal(layer.select_logits.grad, torch.zeros(2))
    reference = make_agn(tau=5.0)
    reference.freeze(int(layer.choice))
    reference.running_mean.copy_(frozen.running_mean)
    reference.running_var.copy_(frozen.running_var)
    torch.testing.assert_close(out, reference(x))


def test_manual_freeze_if_one_hot():
    layer = make_agn(tau=1e-4, freeze_on_one_hot=False)
    x = torch.randn(4, 6, 3, 3)
    layer(x)
    assert not layer.is_frozen
    assert layer.freeze_if_one_hot()
    assert int(layer.choice) == int(layer.last_selection.argmax())
    soft = make_agn(tau=5.0, freeze_on_one_hot=False)
    soft(x)
    assert not soft.freeze_if_one_hot()
    assert not soft.freeze_if_one_hot(torch.tensor([0.9, 0.1]))
    assert soft.freeze_if_one_hot(torch.tensor([0.0, 1.0])) and int(soft.choice) == 1


def test_tau_setter_and_model_helper():
    model = build_model("smallcnn", num_classes=3, norm="agn", conv="wn")
    assert set_agn_tau(model, 0.25) == 3
    assert {m.tau for m in model.modules() if isinstance(m, AdaptiveGroupNorm)} == {0.25}
    layer = AdaptiveGroupNorm(4)
    for bad in (0.0, -1.0):
        with pytest.raises(ValueError, match="positive"):
            layer.tau = bad
    with pytest.raises(ValueError):
        AdaptiveGroupNorm(5, num_groups=2)
    with pytest.raises(ValueError):
        AdaptiveGroupNorm(4, mix="mean")
