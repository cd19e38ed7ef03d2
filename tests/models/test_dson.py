"""DSON: softmax-mixed IN and BN statistics, one affine, every entry domain-specific."""

import math

import torch

from mpifl.models import DSON, build_model, make_norm, state_entries

# one image per row below: N = 2, C = 1, H x W = 1 x 2
X = torch.tensor([[[[1.0, 3.0]]], [[[5.0, 11.0]]]])
# instance means 2, 8; instance (biased) variances 1, 9; batch mean 5, batch (biased) variance 14


def _layer(mean_logits, var_logits, weight=2.0, bias=0.5):
    layer = make_norm("dson", 1)
    assert isinstance(layer, DSON)
    with torch.no_grad():
        layer.mean_weight.copy_(torch.tensor(mean_logits))
        layer.var_weight.copy_(torch.tensor(var_logits))
        layer.weight.fill_(weight)
        layer.bias.fill_(bias)
    return layer


def test_dson_mixes_instance_and_batch_statistics_by_hand():
    # mean logits (in, bn) = (0, ln 3): w = (1/4, 3/4); variance logits (ln 3, 0): w' = (3/4, 1/4)
    layer = _layer([0.0, math.log(3.0)], [math.log(3.0), 0.0]).train()
    y = layer(X)
    mu = [0.25 * 2 + 0.75 * 5, 0.25 * 8 + 0.75 * 5]  # 4.25, 5.75
    var = [0.75 * 1 + 0.25 * 14, 0.75 * 9 + 0.25 * 14]  # 4.25, 10.25
    expected = torch.tensor([[[[2 * (v - mu[n]) / math.sqrt(var[n] + 1e-5) + 0.5 for v in row]]]
                             for n, row in enumerate([[1.0, 3.0], [5.0, 11.0]])])
    assert torch.allclose(y, expected, atol=1e-5)


def test_dson_updates_running_statistics_as_batchnorm_and_uses_them_in_evaluation():
    layer = _layer([0.0, 0.0], [0.0, 0.0]).train()
    layer(X)
    # momentum 0.1 from (0, 1); the running variance takes the unbiased batch variance 14 * 4 / 3
    assert torch.allclose(layer.running_mean, torch.tensor([0.5]))
    assert torch.allclose(layer.running_var, torch.tensor([0.9 + 0.1 * 14 * 4 / 3]))
    assert int(layer.num_batches_tracked) == 1
    layer.eval()
    y = layer(X)
    rm, rv = 0.5, 0.9 + 0.1 * 14 * 4 / 3
    mu = [0.5 * 2 + 0.5 * rm, 0.5 * 8 + 0.5 * rm]
    var = [0.5 * 1 + 0.5 * rv, 0.5 * 9 + 0.5 * rv]
    expected = torch.tensor([[[[2 * (v - mu[n]) / math.sqrt(var[n] + 1e-5) + 0.5 for v in row]]]
                             for n, row in enumerate([[1.0, 3.0], [5.0, 11.0]])])
    assert torch.allclose(y, expected, atol=1e-5)
    assert int(layer.num_batches_tracked) == 1  # evaluation leaves the statistics alone


def test_dson_starts_half_and_half_and_the_mixture_weights_learn():
    layer = make_norm("dson", 3).train()
    w_mean, w_var = layer.mixing_weights()
    assert torch.allclose(w_mean, torch.tensor([0.5, 0.5])) and torch.allclose(w_var, torch.tensor([0.5, 0.5]))
    (layer(torch.randn(4, 3, 3, 3)) ** 3).sum().backward()
    assert layer.mean_weight.grad.abs().sum() > 0 and layer.var_weight.grad.abs().sum() > 0


def test_dson_entries_are_all_the_domain_specific_bn_side():
    entries = [e for e in state_entries(build_model("smallcnn", num_classes=10, norm="dson"))
               if e.key.startswith("norm1.")]
    assert {e.key.split(".", 1)[1] for e in entries} == {
        "weight", "bias", "mean_weight", "var_weight", "running_mean", "running_var", "num_batches_tracked"}
    assert all(e.module_kind == "dson" and e.part == "bn" and e.is_bn_side for e in entries)
    assert {e.attr for e in entries if e.is_bn_stat} == {"running_mean", "running_var", "num_batches_tracked"}
