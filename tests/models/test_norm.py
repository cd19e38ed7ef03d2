"""make_norm: layer types, torch defaults, the GN group rule, LN semantics."""

import pytest
import torch
from torch import nn

from mpifl.errors import MpiflError
from mpifl.models import (
    CONV_KINDS, NORM_KINDS, AdaptiveGroupNorm, PerXAN, WNConv2d, WSConv2d, make_conv, make_norm,
)  # fmt: skip
from mpifl.models.norm import gn_groups, supports_vectors


def test_norm_kinds_are_the_five_base_kinds_then_the_papers():
    assert NORM_KINDS == ("bn", "gn", "ln", "in", "none", "perxan", "agn", "jsbn", "ibn", "dson")


@pytest.mark.parametrize("dims, cls", [(2, nn.BatchNorm2d), (1, nn.BatchNorm1d)])
def test_bn_by_dims_with_torch_defaults(dims, cls):
    layer = make_norm("bn", 16, dims=dims)
    assert type(layer) is cls
    assert layer.num_features == 16
    assert layer.momentum == 0.1 and layer.eps == 1e-5
    assert layer.affine and layer.track_running_stats


@pytest.mark.parametrize(
    "channels, groups",
    [
        (2048, 32), (128, 32), (64, 32), (48, 24), (32, 32),
        (24, 8), (16, 8), (12, 6), (7, 7), (1, 1),
    ],  # fmt: skip
)
def test_gn_group_rule(channels, groups):
    assert gn_groups(channels) == groups
    layer = make_norm("gn", channels)
    assert type(layer) is nn.GroupNorm
    assert (layer.num_groups, layer.num_channels) == (groups, channels)


def test_ln_is_one_group_and_matches_manual_layer_norm_over_chw():
    torch.manual_seed(0)
    layer = make_norm("ln", 6)
    assert type(layer) is nn.GroupNorm and layer.num_groups == 1
    with torch.no_grad():
        layer.weight.normal_()
        layer.bias.normal_()
    x = torch.randn(4, 6, 5, 3) * 3 + 1
    mean = x.mean(dim=(1, 2, 3), keepdim=True)
    var = x.var(dim=(1, 2, 3), unbiased=False, keepdim=True)
    expected = (x - mean) / torch.sqrt(var + 1e-5)
    expected = expected * layer.weight.view(1, 6, 1, 1) + layer.bias.view(1, 6, 1, 1)
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)


def test_ln_on_vectors_normalizes_each_row():
    x = torch.randn(3, 10) * 4 + 2
    y = make_norm("ln", 10, dims=1)(x)
    torch.testing.assert_close(y.mean(dim=1), torch.zeros(3), atol=1e-5, rtol=0)
    torch.testing.assert_close(y.var(dim=1, unbiased=False), torch.ones(3), atol=1e-3, rtol=0)


def test_in_is_affine_without_running_stats():
    layer = make_norm("in", 8)
    assert type(layer) is nn.InstanceNorm2d
    assert layer.affine and not layer.track_running_stats
    assert dict(layer.named_buffers()) == {}
    x = torch.randn(2, 8, 4, 4) * 5 + 3
    y = layer(x)
    torch.testing.assert_close(y.mean(dim=(2, 3)), torch.zeros(2, 8), atol=1e-5, rtol=0)


def test_in_on_vectors_is_a_user_error():
    assert not supports_vectors("in")
    with pytest.raises(MpiflError, match="undefined on feature vectors"):
        make_norm("in", 8, dims=1)


def test_none_is_identity():
    assert type(make_norm("none", 8)) is nn.Identity
    assert type(make_norm("none", 8, dims=1)) is nn.Identity


@pytest.mark.parametrize("kind", NORM_KINDS)
def test_every_kind_keeps_the_input_shape(kind):
    x = torch.randn(2, 16, 5, 5)
    assert make_norm(kind, 16)(x).shape == x.shape


def test_unknown_kind_lists_the_valid_kinds():
    with pytest.raises(MpiflError) as err:
        make_norm("batchnorm", 8)
    message = str(err.value)
    assert "'batchnorm'" in message
    for kind in NORM_KINDS:
        assert kind in message
    with pytest.raises(MpiflError):
        supports_vectors("batchnorm")


def test_paper_norm_kinds():
    layer = make_norm("perxan", 16)
    assert type(layer) is PerXAN and layer.num_features == 16
    assert not supports_vectors("perxan")
    with pytest.raises(MpiflError, match="undefined on feature vectors"):
        make_norm("perxan", 16, dims=1)
    agn = make_norm("agn", 16)
    assert type(agn) is AdaptiveGroupNorm and agn.num_groups == 2
    assert make_norm("agn", 7).num_groups == 1
    assert supports_vectors("agn")
    assert make_norm("agn", 10, dims=1)(torch.randn(4, 10)).shape == (4, 10)


@pytest.mark.parametrize("kind, cls", [("plain", nn.Conv2d), ("ws", WSConv2d), ("wn", WNConv2d)])
def test_make_conv_kinds(kind, cls):
    assert CONV_KINDS == ("plain", "ws", "wn")
    conv = make_conv(kind, 3, 8, 5, 2, 1, bias=False)
    assert type(conv) is cls
    assert (conv.in_channels, conv.out_channels, conv.kernel_size) == (3, 8, (5, 5))
    assert (conv.stride, conv.padding, conv.bias) == ((2, 2), (1, 1), None)
    assert conv(torch.randn(2, 3, 9, 9)).shape == (2, 8, 4, 4)
    assert make_conv(kind, 3, 8, 3).bias is not None


def test_unknown_conv_lists_the_kinds():
    with pytest.raises(MpiflError) as err:
        make_conv("wsconv", 3, 8, 3)
    message = str(err.value)
    assert "'wsconv'" in message and all(k in message for k in CONV_KINDS)


@pytest.mark.parametrize("dims, base", [(2, nn.BatchNorm2d), (1, nn.BatchNorm1d)])
def test_jsbn_is_a_batchnorm_with_the_same_state(dims, base):
    layer = make_norm("jsbn", 16, dims=dims)
    assert isinstance(layer, base) and type(layer) is not base
    assert list(layer.state_dict()) == list(base(16).state_dict())
