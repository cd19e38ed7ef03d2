"""replace_norms / replace_convs / set_input_channels: generic module swaps keeping names."""

import pytest
import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from mpifl.errors import MpiflError
from mpifl.models import (
    NORM_KINDS,
    AdaptiveGroupNorm,
    IBN,
    PerXAN,
    WNConv2d,
    WSConv2d,
    build_model,
    replace_convs,
    place_composite_norms,
    replace_norms,
    set_input_channels,
)
from mpifl.models.norm import make_norm, supports_vectors


class Net(nn.Module):
    """Nested convs (one depthwise, one dilated, one with bias), BN2d and a BN1d head."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 2, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.block = nn.Sequential(
            nn.Conv2d(8, 8, 3, 1, 1, groups=8, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
            nn.Conv2d(8, 16, 3, 1, 2, dilation=2, bias=True), nn.BatchNorm2d(16), nn.ReLU(),
        )  # fmt: skip
        self.fc = nn.Linear(16, 12)
        self.bn_fc = nn.BatchNorm1d(12)
        self.classifier = nn.Linear(12, 4)

    def forward(self, x):
        x = self.block(self.stem(x)).mean((2, 3))
        return self.classifier(torch.relu(self.bn_fc(self.fc(x))))


def plain_bns(model, kind=None):
    """BatchNorms outside PerXAN and IBN layers; with ``kind``, those that are not its layers."""
    inner = {id(m.bn) for m in model.modules() if isinstance(m, (PerXAN, IBN))}
    own = () if kind is None else (norm_type(kind, 1), norm_type(kind, 2))
    return [n for n, m in model.named_modules()
            if isinstance(m, _BatchNorm) and id(m) not in inner and type(m) not in own]  # fmt: skip


def norm_type(kind, dims=2):
    """The class ``make_norm`` builds for ``kind`` (Identity where undefined on vectors)."""
    return type(make_norm(kind, 8, dims)) if dims == 2 or supports_vectors(kind) else nn.Identity


BN_NAMES = ["stem.1", "block.1", "block.4", "bn_fc"]


@pytest.mark.parametrize("kind", [k for k in NORM_KINDS if k != "bn"])
def test_replace_norms_swaps_every_bn_under_its_name(kind):
    torch.manual_seed(0)
    model = Net()
    assert plain_bns(model) == BN_NAMES
    assert replace_norms(model, kind) == 4
    assert plain_bns(model, kind) == []
    modules = dict(model.named_modules())
    for name in BN_NAMES[:3]:
        assert type(modules[name]) is norm_type(kind), name
    # after a linear layer: the kind where defined on vectors, else Identity (as DigitModel)
    assert type(modules["bn_fc"]) is norm_type(kind, dims=1)
    out = model.train()(torch.randn(3, 3, 8, 8))
    assert out.shape == (3, 4) and torch.isfinite(out).all()


def test_replace_norms_state_keys_keep_their_prefixes():
    model = Net()
    replace_norms(model, "perxan")
    keys = model.state_dict().keys()
    assert "stem.1.bn.running_mean" in keys and "stem.1.inorm.weight" in keys
    model = Net()
    replace_norms(model, "gn")
    assert "block.4.weight" in model.state_dict() and "block.4.running_mean" not in model.state_dict()


def test_replace_norms_bn_is_a_no_op_and_unknown_kind_is_a_user_error():
    model = Net()
    before = list(model.state_dict())
    assert replace_norms(model, "bn") == 0
    assert list(model.state_dict()) == before
    with pytest.raises(MpiflError, match="unknown norm 'foo'"):
        replace_norms(model, "foo")


def test_replace_norms_select_restricts_the_layers():
    model = Net()
    assert replace_norms(model, "perxan", select=lambda name: name.startswith("stem")) == 1
    assert isinstance(model.stem[1], PerXAN)
    assert plain_bns(model, "perxan") == BN_NAMES[1:]


def test_replace_norms_leaves_the_bn_inside_composite_layers():
    model = Net()
    replace_norms(model, "perxan")
    assert isinstance(model.bn_fc, nn.Identity)  # PerXAN is undefined on vectors
    assert replace_norms(model, "gn") == 0  # the BNs inside PerXAN layers are theirs
    assert all(isinstance(m.bn, nn.BatchNorm2d) for m in model.modules() if isinstance(m, PerXAN))


@pytest.mark.parametrize("kind, cls", [("ws", WSConv2d), ("wn", WNConv2d)])
def test_replace_convs_keeps_hyperparameters(kind, cls):
    torch.manual_seed(0)
    model = Net()
    old = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Conv2d)]
    assert replace_convs(model, kind) == 3
    new = dict(model.named_modules())
    for name, conv in old:
        swapped = new[name]
        assert type(swapped) is cls
        for attr in ("in_channels", "out_channels", "kernel_size", "stride", "padding",
                     "dilation", "groups", "padding_mode"):  # fmt: skip
            assert getattr(swapped, attr) == getattr(conv, attr), (name, attr)
        assert (swapped.bias is None) == (conv.bias is None)
    assert model.block[0].groups == 8  # depthwise stays depthwise
    assert model(torch.randn(2, 3, 8, 8)).shape == (2, 4)
    assert replace_convs(model, kind) == 0  # already swapped: left alone


def test_replace_convs_copy_weights_or_own_init():
    torch.manual_seed(0)
    model = Net()
    weight = model.block[3].weight.detach().clone()
    bias = model.block[3].bias.detach().clone()
    replace_convs(model, "wn", copy_weights=True)
    assert torch.equal(model.block[3].weight, weight) and torch.equal(model.block[3].bias, bias)
    torch.manual_seed(0)
    model = Net()
    replace_convs(model, "ws")  # FedWon Listing 1's xavier-normal init, not the old weight
    assert not torch.equal(model.block[3].weight, weight)
    assert torch.equal(model.block[3].gain, torch.ones(16, 1, 1, 1))


def test_replace_convs_plain_is_a_no_op_and_unknown_kind_is_a_user_error():
    model = Net()
    assert replace_convs(model, "plain") == 0
    assert type(model.stem[0]) is nn.Conv2d
    with pytest.raises(MpiflError, match="unknown conv 'foo'"):
        replace_convs(model, "foo")


def test_set_input_channels_rebuilds_the_first_conv():
    model = Net()
    assert set_input_channels(model, 1) is True
    assert model.stem[0].in_channels == 1 and model.stem[0].stride == (2, 2)
    assert model(torch.randn(2, 1, 8, 8)).shape == (2, 4)
    assert set_input_channels(model, 1) is False
    with pytest.raises(MpiflError):
        set_input_channels(model, 0)


def test_surgery_on_a_registry_model():
    model = build_model("resnet20", num_classes=10, image_size=(8, 8))
    assert replace_norms(model, "agn") == 19 and plain_bns(model, "agn") == []
    assert all(isinstance(m, AdaptiveGroupNorm) for n, m in model.named_modules() if "bn" in n)
    assert replace_convs(model, "ws") == 19
    assert model(torch.randn(2, 3, 8, 8)).shape == (2, 10)


# ------------------------------------------------------------------ place_composite_norms (--norm-blocks)
def _kinds(model, names):
    modules = dict(model.named_modules())
    return [type(modules[n]).__name__ for n in names]


def test_ibn_default_is_every_stage_but_the_last():
    model = place_composite_norms(build_model("smallcnn", num_classes=10, norm="ibn"), "auto", "--norm-blocks")
    assert _kinds(model, ["norm1", "norm2", "norm3"]) == ["IBN", "IBN", "BatchNorm2d"]


def test_ibn_in_a_resnet_is_the_first_norm_of_each_residual_block_of_the_first_stages_as_ibn_a():
    model = place_composite_norms(build_model("resnet20", num_classes=10, image_size=(32, 32), norm="ibn"),
                                  "auto", "--norm-blocks")
    ibn = sorted(n for n, m in model.named_modules() if isinstance(m, IBN))
    assert ibn == [f"layer{s}.{b}.bn1" for s in (1, 2) for b in range(3)]  # stem BN, bn2 BN, layer3 BN
    assert _kinds(model, ["bn1", "layer1.0.bn2", "layer3.0.bn1"]) == ["BatchNorm2d"] * 3
    every = place_composite_norms(build_model("resnet20", num_classes=10, image_size=(32, 32), norm="ibn"),
                                  "all", "--norm-blocks")
    assert sum(isinstance(m, IBN) for m in every.modules()) == 9


def test_dson_and_perxan_default_to_every_layer_and_n_keeps_the_stem_and_first_stages():
    model = place_composite_norms(build_model("smallcnn", num_classes=10, norm="dson"), "auto", "--norm-blocks")
    assert _kinds(model, ["norm1", "norm2", "norm3"]) == ["DSON"] * 3
    model = place_composite_norms(build_model("resnet20", num_classes=10, image_size=(32, 32), norm="dson"),
                                  "1", "--norm-blocks")
    assert _kinds(model, ["bn1", "layer1.2.bn2", "layer2.0.bn1"]) == ["DSON", "DSON", "BatchNorm2d"]


def test_n_nostem_keeps_the_first_stages_and_leaves_the_stem_plain():
    """gPerXAN's Camelyon17 rule (paper, Section 4.2): the first dense block and its transition, not ``norm0``."""
    model = place_composite_norms(build_model("densenet121", num_classes=2, image_size=(96, 96), norm="perxan"),
                                  "1-nostem", "--perxan-blocks")
    names = ["features.norm0", "features.denseblock1.denselayer1.norm1", "features.transition1.norm",
             "features.denseblock2.denselayer1.norm1"]
    assert _kinds(model, names) == ["BatchNorm2d", "PerXAN", "PerXAN", "BatchNorm2d"]
    model = place_composite_norms(build_model("resnet20", num_classes=10, image_size=(32, 32), norm="dson"),
                                  "2-nostem", "--norm-blocks")
    assert _kinds(model, ["bn1", "layer2.2.bn2", "layer3.0.bn1"]) == ["BatchNorm2d", "DSON", "BatchNorm2d"]


@pytest.mark.parametrize("name, image_size", [("densenet121", (96, 96)), ("resnet18", (64, 64)),
                                              ("mobilenetv2", (64, 64)), ("resnet20", (32, 32))])
def test_every_stem_names_its_modules_and_holds_only_the_first_conv_and_norm(name, image_size):
    from mpifl.models.surgery import _STEMS
    model = build_model(name, num_classes=2, image_size=image_size, norm="bn")
    modules = dict(model.named_modules())
    stem = _STEMS[type(model).__name__]
    assert all(s in modules for s in stem)
    in_stem = [any(n == s or n.startswith(s + ".") for s in stem) for n in modules]
    layers = [inside for inside, m in zip(in_stem, modules.values()) if isinstance(m, (nn.Conv2d, nn.BatchNorm2d))]
    assert layers[:2] == [True, True] and not any(layers[2:])


def test_n_nostem_on_a_model_without_a_stem_is_one_line():
    with pytest.raises(MpiflError, match="--norm-blocks 1-nostem: SmallCNN has no stem before its first stage; "
                                         "pass --norm-blocks 1"):
        place_composite_norms(build_model("smallcnn", num_classes=10, norm="ibn"), "1-nostem", "--norm-blocks")


@pytest.mark.parametrize("blocks, message", [
    ("4", "--norm-blocks must be auto, all, N or N-nostem with N a number of stages from 1 to 3 for SmallCNN, "
          "got '4'"),
    ("x", "--norm-blocks must be auto, all, N or N-nostem with N a number of stages from 1 to 3"),
    ("0-nostem", "--norm-blocks must be auto, all, N or N-nostem"),
])  # fmt: skip
def test_norm_blocks_out_of_range_is_one_line(blocks, message):
    with pytest.raises(MpiflError, match=message):
        place_composite_norms(build_model("smallcnn", num_classes=10, norm="ibn"), blocks, "--norm-blocks")


def test_norm_blocks_on_a_model_without_composite_norms_is_refused():
    with pytest.raises(MpiflError, match="--norm-blocks places perxan, ibn and dson layers and this model has none"):
        place_composite_norms(build_model("smallcnn", num_classes=10, norm="bn"), "2", "--norm-blocks")
    model = build_model("smallcnn", num_classes=10, norm="bn")
    assert place_composite_norms(model, "auto", "--norm-blocks") is model
