"""IBN-a: IN (affine) on the first C // 2 channels, BN on the rest, in training and evaluation."""

import torch

from mpifl.models import IBN, build_model, make_norm, state_entries


def _by_hand(x, mean, var, weight, bias, eps=1e-5):
    return (x - mean) / torch.sqrt(var + eps) * weight.view(1, -1, 1, 1) + bias.view(1, -1, 1, 1)


def _ibn(channels=5):
    torch.manual_seed(0)
    layer = make_norm("ibn", channels)
    with torch.no_grad():
        for p in layer.parameters():
            p.uniform_(0.5, 1.5)
    return layer


def test_ibn_is_in_on_the_first_half_and_bn_on_the_rest_in_training():
    layer = _ibn(5)  # floor(5 / 2) = 2 instance-normalized channels, 3 batch-normalized
    assert isinstance(layer, IBN) and (layer.inorm.num_features, layer.bn.num_features) == (2, 3)
    x = torch.randn(4, 5, 3, 3) * 2 + 1
    layer.train()
    y = layer(x)
    first, rest = x[:, :2], x[:, 2:]
    expected_in = _by_hand(first, first.mean((2, 3), keepdim=True), first.var((2, 3), unbiased=False, keepdim=True),
                           layer.inorm.weight, layer.inorm.bias)
    expected_bn = _by_hand(rest, rest.mean((0, 2, 3), keepdim=True),
                           rest.var((0, 2, 3), unbiased=False, keepdim=True), layer.bn.weight, layer.bn.bias)
    assert torch.allclose(y[:, :2], expected_in, atol=1e-5)
    assert torch.allclose(y[:, 2:], expected_bn, atol=1e-5)
    # torch's BN momentum 0.1 on the BN half only, from (0, 1)
    assert torch.allclose(layer.bn.running_mean, 0.1 * rest.mean((0, 2, 3)), atol=1e-6)
    assert torch.allclose(layer.bn.running_var, 0.9 + 0.1 * rest.var((0, 2, 3), unbiased=True), atol=1e-5)


def test_ibn_in_evaluation_keeps_instance_statistics_and_uses_the_running_bn_ones():
    layer = _ibn(4)
    with torch.no_grad():
        layer.bn.running_mean.copy_(torch.tensor([0.5, -1.0]))
        layer.bn.running_var.copy_(torch.tensor([2.0, 0.25]))
    layer.eval()
    x = torch.randn(3, 4, 2, 2)
    y = layer(x)
    first, rest = x[:, :2], x[:, 2:]
    expected_in = _by_hand(first, first.mean((2, 3), keepdim=True), first.var((2, 3), unbiased=False, keepdim=True),
                           layer.inorm.weight, layer.inorm.bias)
    expected_bn = _by_hand(rest, layer.bn.running_mean.view(1, -1, 1, 1), layer.bn.running_var.view(1, -1, 1, 1),
                           layer.bn.weight, layer.bn.bias)
    assert torch.allclose(y[:, :2], expected_in, atol=1e-5)
    assert torch.allclose(y[:, 2:], expected_bn, atol=1e-5)


def test_ibn_entries_have_a_bn_half_and_an_in_half():
    entries = {e.key: e for e in state_entries(build_model("smallcnn", num_classes=10, norm="ibn"))}
    assert {k for k, e in entries.items() if e.module_kind == "ibn" and e.part == "bn"} == {
        f"norm{i}.bn.{a}" for i in (1, 2, 3)
        for a in ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")}  # fmt: skip
    assert {k for k, e in entries.items() if e.part == "in"} == {
        f"norm{i}.inorm.{a}" for i in (1, 2, 3) for a in ("weight", "bias")}
    assert entries["norm1.bn.running_mean"].is_bn_stat and entries["norm1.bn.weight"].is_bn_side
    assert not entries["norm1.inorm.weight"].is_bn_side


def test_ibn_on_vectors_is_plain_bn_as_ibn_a_keeps_bn_where_it_puts_no_in():
    assert type(make_norm("ibn", 8, dims=1)) is torch.nn.BatchNorm1d
    model = build_model("digitmodel", num_classes=10, norm="ibn")
    assert type(model.bn1) is IBN and type(model.bn4) is torch.nn.BatchNorm1d
