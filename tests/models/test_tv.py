"""torchvision backbones: torchvision's keys and init, every norm and conv kind, sizes.

Structures (ResNet-18/50, DenseNet-121 norm and conv variants) are checked on
the meta device (no weight init); MobileNetV2 trains a step with every norm,
ResNet-18 is compared with torchvision's for real and DenseNet-121 with PerXAN
trains at its least image size.
"""

import pytest
import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from mpifl.errors import MpiflError
from mpifl.models import (
    NORM_KINDS,
    IBN,
    PerXAN,
    WNConv2d,
    WSConv2d,
    build_model,
    state_entries,
)
from mpifl.models.norm import make_norm

torchvision = pytest.importorskip("torchvision")
tvm = torchvision.models

TV_BUILDERS = {
    "resnet18": tvm.resnet18,
    "resnet50": tvm.resnet50,
    "mobilenetv2": tvm.mobilenet_v2,
    "densenet121": tvm.densenet121,
}


def norm_class(kind):
    """The class ``make_norm`` builds for ``kind`` after a conv."""
    return type(make_norm(kind, 8))


def meta(name, side=64, **kw):
    with torch.device("meta"):
        return build_model(name, num_classes=kw.pop("num_classes", 10), image_size=(side, side), **kw)


def plain_bns(model, kind):
    """BatchNorms outside PerXAN and IBN layers that are not ``kind``'s layer (JSNorm is a BN subclass)."""
    inner = {id(m.bn) for m in model.modules() if isinstance(m, (PerXAN, IBN))}
    own = norm_class(kind)
    return [n for n, m in model.named_modules()
            if isinstance(m, _BatchNorm) and id(m) not in inner and type(m) is not own]  # fmt: skip


def tv_keys(name):
    with torch.device("meta"):
        keys = list(TV_BUILDERS[name](weights=None, num_classes=10).state_dict())
    return [k.replace("classifier.1.", "classifier.") if name == "mobilenetv2" else k for k in keys]


@pytest.fixture(scope="module")
def tv_resnet18():
    torch.manual_seed(0)
    return tvm.resnet18(weights=None, num_classes=10).eval()


def test_resnet18_is_torchvisions_resnet18(tv_resnet18):
    torch.manual_seed(0)
    ours = build_model("resnet18", num_classes=10, image_size=(64, 64)).eval()
    ref = tv_resnet18.state_dict()
    assert list(ours.state_dict()) == list(ref)
    assert all(torch.equal(v, ref[k]) for k, v in ours.state_dict().items())  # same init, same order
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        assert torch.equal(ours(x), tv_resnet18(x))
        assert ours.encode(x).shape == (2, 512)
        assert torch.equal(ours(x), ours.classifier(ours.encode(x)))
    assert ours.classifier is ours.fc


@pytest.mark.parametrize("name", ["resnet50", "mobilenetv2", "densenet121"])
def test_state_dict_keys_are_torchvisions(name):
    """Exactly torchvision's keys; MobileNetV2's head Linear is 'classifier', not 'classifier.1'."""
    model = meta(name)
    assert list(model.state_dict()) == tv_keys(name)
    assert isinstance(model.classifier, nn.Linear)
    head = [k for k in model.state_dict() if k.startswith("classifier.") or k.startswith("fc.")]
    assert head == [f"{'fc' if name == 'resnet50' else 'classifier'}.{a}" for a in ("weight", "bias")]


@pytest.mark.parametrize("name", ["mobilenetv2", "densenet121"])
def test_same_seed_same_weights_as_torchvision(name):
    torch.manual_seed(0)
    ref = TV_BUILDERS[name](weights=None, num_classes=10).state_dict()
    torch.manual_seed(0)
    ours = build_model(name, num_classes=10, image_size=(64, 64)).state_dict()
    assert list(ours) == tv_keys(name)
    assert all(torch.equal(a, b) for a, b in zip(ref.values(), ours.values()))


def train_step(model, side, channels=3):
    torch.manual_seed(1)
    x, y = torch.randn(2, channels, side, side), torch.randint(0, 10, (2,))
    model.train()
    nn.functional.cross_entropy(model(x), y).backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(x), model.classifier(model.encode(x)))


@pytest.mark.parametrize("norm", NORM_KINDS)
def test_resnet18_every_norm(norm):
    """Through torchvision's norm_layer hook, under torchvision's module names."""
    model = meta("resnet18", norm=norm)
    assert plain_bns(model, norm) == []
    modules = dict(model.named_modules())
    for name in ("bn1", "layer1.0.bn1", "layer4.1.bn2", "layer2.0.downsample.1"):
        assert type(modules[name]) is norm_class(norm), name


@pytest.mark.parametrize("norm", NORM_KINDS)
def test_mobilenetv2_every_norm_trains(norm):
    torch.manual_seed(0)
    model = build_model("mobilenetv2", num_classes=10, image_size=(33, 33), norm=norm)
    assert plain_bns(model, norm) == []
    assert type(model.features[0][1]) is norm_class(norm)  # Conv2dNormActivation's norm
    train_step(model, 33)


@pytest.mark.parametrize("norm", ["gn", "none"])
def test_densenet121_norms_replaced_after_construction(norm):
    model = meta("densenet121", norm=norm)
    assert plain_bns(model, norm) == []
    assert type(model.features.transition1.norm) is norm_class(norm)
    assert type(model.features.denseblock4.denselayer16.norm2) is norm_class(norm)


def test_densenet121_perxan_replaces_every_bn_and_trains_at_its_least_size():
    """gPerXAN's DenseNet-121: every BN -> PerXAN (BN side under the old name + '.bn'); 61 px."""
    with torch.device("meta"):
        n_bn = sum(isinstance(m, nn.BatchNorm2d) for m in tvm.densenet121(weights=None).modules())
    torch.manual_seed(0)
    model = build_model("densenet121", num_classes=10, image_size=(61, 61), norm="perxan")
    assert sum(isinstance(m, PerXAN) for m in model.modules()) == n_bn == 121
    assert plain_bns(model, "perxan") == []
    keys = list(model.state_dict())
    assert "features.denseblock1.denselayer1.norm1.bn.running_mean" in keys
    assert "features.norm5.inorm.weight" in keys and "features.norm0.bn_score" in keys
    train_step(model, 61)
    with pytest.raises(ValueError, match="more than 1 spatial element"):
        model.train()(torch.randn(2, 3, 60, 60))  # what the size rule prevents


@pytest.mark.parametrize("name, norm, conv", [
    ("resnet50", "perxan", "plain"),  # gPerXAN PACS / Office-Home
    ("resnet18", "none", "ws"),  # FedWon
    ("resnet18", "agn", "wn"),  # FedNN
    ("mobilenetv2", "gn", "plain"),  # FedWon's FedAvg+GN baseline on CIFAR-10
])  # fmt: skip
def test_paper_configurations(name, norm, conv):
    """Structure only (every conv swapped, every BN replaced); training runs in the tests above."""
    model = meta(name, side=224, norm=norm, conv=conv)
    conv_cls = {"plain": nn.Conv2d, "ws": WSConv2d, "wn": WNConv2d}[conv]
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    assert convs and all(type(m) is conv_cls for m in convs)
    assert plain_bns(model, norm) == []
    entries = state_entries(model)  # every entry classifiable for share policies
    if norm == "perxan":
        assert sum(e.is_bn_side for e in entries) == 6 * 53  # 53 BNs in ResNet-50
    if conv == "ws":
        assert all(e.module_kind == "conv" for e in entries if e.attr == "gain")


def test_mobilenetv2_gn_groups_follow_fedwon():
    model = meta("mobilenetv2", norm="gn")
    groups = {m.num_channels: m.num_groups for m in model.modules() if isinstance(m, nn.GroupNorm)}
    assert groups[144] == 24 and groups[16] == 8 and groups[96] == 32 and groups[32] == 32


def test_mobilenetv2_runs_for_real_at_cifar_size():
    """FedWon's CIFAR-10 model (WSConv, no norm): depthwise convs stay depthwise, Dropout in encode."""
    torch.manual_seed(0)
    model = build_model("mobilenetv2", num_classes=10, image_size=(32, 32), norm="none", conv="ws")
    depthwise = [m for m in model.modules() if isinstance(m, WSConv2d) and m.groups > 1]
    assert depthwise and all(m.groups == m.in_channels == m.out_channels for m in depthwise)
    assert isinstance(model.dropout, nn.Dropout) and model.dropout.p == 0.2
    train_step(model, 32)
    with torch.no_grad():
        assert model.encode(torch.randn(2, 3, 32, 32)).shape == (2, 1280)


def test_wn_convs_keep_torchvisions_init(tv_resnet18):
    torch.manual_seed(0)
    wn = build_model("resnet18", num_classes=10, image_size=(64, 64), conv="wn")
    assert isinstance(wn.layer3[0].conv1, WNConv2d)
    assert torch.equal(wn.layer3[0].conv1.weight, tv_resnet18.layer3[0].conv1.weight)
    assert torch.equal(wn.fc.weight, tv_resnet18.fc.weight)


@pytest.mark.parametrize("name", ["resnet18", "mobilenetv2"])
def test_other_input_channels_rebuild_the_stem(name):
    model = meta(name, in_channels=1, conv="ws")
    first = next(m for m in model.modules() if isinstance(m, nn.Conv2d))
    assert first.in_channels == 1 and isinstance(first, WSConv2d)
    assert sum(isinstance(m, nn.Conv2d) and m.in_channels == 1 for m in model.modules()) == 1


def test_other_input_channels_train():
    model = build_model("mobilenetv2", num_classes=10, in_channels=1, image_size=(32, 32))
    train_step(model, 32, channels=1)


@pytest.mark.parametrize("name, norm, least", [
    ("resnet18", "bn", 32), ("resnet18", "perxan", 33), ("resnet50", "in", 33),
    ("mobilenetv2", "gn", 32), ("mobilenetv2", "in", 33),
    ("densenet121", "bn", 32), ("densenet121", "perxan", 61),
])  # fmt: skip
def test_image_size_rules(name, norm, least):
    with pytest.raises(MpiflError, match=rf"model {name} needs images of at least {least}x{least}"):
        build_model(name, num_classes=10, image_size=(least - 1, 224), norm=norm)


def test_least_size_with_instance_statistics_trains_and_one_less_fails():
    torch.manual_seed(0)
    model = build_model("mobilenetv2", num_classes=10, image_size=(33, 33), norm="in")
    train_step(model, 33)
    with pytest.raises(ValueError, match="more than 1 spatial element"):
        model.train()(torch.randn(2, 3, 32, 32))


def test_default_28px_is_rejected_with_the_fix():
    with pytest.raises(MpiflError, match=r"resnet18 needs .* 28x28; prepare the dataset larger .*--size 224"):
        build_model("resnet18", num_classes=10)


@pytest.mark.parametrize("name", list(TV_BUILDERS))
def test_unknown_kinds_are_user_errors(name):
    with pytest.raises(MpiflError, match="unknown norm 'batch'"):
        build_model(name, num_classes=10, norm="batch")
    with pytest.raises(MpiflError, match="unknown conv 'std'"):
        build_model(name, num_classes=10, conv="std")
