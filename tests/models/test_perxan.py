"""PerXAN against gPerXAN eq. (2) with the public code's softmax scores."""

import copy

import pytest
import torch
from torch import nn

from mpifl.errors import MpiflError
from mpifl.models import PerXAN, build_model, load_bn_state, perxan_state_from_bn


def make_layer():
    torch.manual_seed(0)
    layer = PerXAN(4)
    with torch.no_grad():
        for p in (layer.bn.weight, layer.bn.bias, layer.inorm.weight, layer.inorm.bias):
            p.normal_()
        layer.bn_score.fill_(0.7)
        layer.in_score.fill_(-0.4)
    return layer


def test_structure_and_init():
    layer = PerXAN(8)
    assert type(layer.bn) is nn.BatchNorm2d and layer.bn.affine and layer.bn.track_running_stats
    assert type(layer.inorm) is nn.InstanceNorm2d and layer.inorm.affine
    assert not layer.inorm.track_running_stats
    assert torch.equal(layer.bn_score, torch.ones(1)) and torch.equal(layer.in_score, torch.ones(1))
    torch.testing.assert_close(layer.mixing_weights(), torch.tensor([0.5, 0.5]))
    assert list(layer.state_dict()) == [
        "bn_score", "in_score", "bn.weight", "bn.bias", "bn.running_mean", "bn.running_var",
        "bn.num_batches_tracked", "inorm.weight", "inorm.bias",
    ]  # fmt: skip
    assert [PerXAN.part_of(k) for k in layer.state_dict()] == ["bn", "in"] + ["bn"] * 5 + ["in"] * 2


@pytest.mark.parametrize("training", [True, False])
def test_output_is_the_softmax_mix_of_the_two_branches(training):
    layer = make_layer()
    with torch.no_grad():
        layer.bn.running_mean.normal_()
        layer.bn.running_var.uniform_(0.5, 2)
    layer.train(training)
    branches = copy.deepcopy(layer)
    x = torch.randn(3, 4, 5, 5) * 2 + 1
    w = torch.softmax(torch.tensor([0.7, -0.4]), 0)
    expected = w[0] * branches.bn(x) + w[1] * branches.inorm(x)
    out = layer(x)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer.bn.running_mean, branches.bn.running_mean)
    out.square().sum().backward()
    assert layer.bn_score.grad.abs() > 0 and layer.in_score.grad.abs() > 0


def test_model_loader_from_a_bn_checkpoint():
    torch.manual_seed(0)
    bn_model = build_model("smallcnn", num_classes=5, norm="bn")
    with torch.no_grad():
        for value in bn_model.state_dict().values():
            if value.is_floating_point():
                value.uniform_(0.5, 1.5)
    torch.manual_seed(1)
    model = build_model("smallcnn", num_classes=5, norm="perxan")
    renamed = perxan_state_from_bn(model, bn_model.state_dict())
    assert "norm1.bn.running_var" in renamed and "norm1.running_var" not in renamed
    left = load_bn_state(model, bn_model.state_dict())
    assert sorted(left) == sorted(
        f"norm{i}.{k}" for i in (1, 2, 3) for k in ("bn_score", "in_score", "inorm.weight", "inorm.bias")
    )
    state = model.state_dict()
    for key, value in bn_model.state_dict().items():
        target = key.replace(".", ".bn.", 1) if key.startswith("norm") else key
        assert torch.equal(state[target], value), key
    assert torch.equal(state["norm2.inorm.weight"], torch.ones(32))


def test_model_loader_rejects_another_model():
    model = build_model("smallcnn", num_classes=5, norm="perxan")
    other = build_model("smallcnn", num_classes=7, norm="bn").state_dict()
    with pytest.raises(MpiflError, match="classifier.weight"):
        load_bn_state(model, other)
    gn = build_model("smallcnn", num_classes=5, norm="gn").state_dict()
    with pytest.raises(MpiflError, match="missing: norm1.bn.running_mean"):
        load_bn_state(model, gn)
