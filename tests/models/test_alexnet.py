"""AlexNet (FedBN/FedRDN) and alexnet-dropout (FedWon Table 6): layers, names, norms, sizes.

Structure checks run on the meta device (no 57 M-parameter init); one real
model checks the numbers.
"""

import pytest
import torch
from torch import nn

from mpifl.errors import MpiflError
from mpifl.models import NORM_KINDS, WSConv2d, build_model
from mpifl.models.norm import make_norm, supports_vectors
from mpifl.models.pretrained import renamed_keys

FEDBN_FEATURE_KEYS = [
    f"features.{layer}{i}.{attr}"
    for i in range(1, 6)
    for layer, attrs in (("conv", ("weight", "bias")),
                         ("bn", ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")))
    for attr in attrs
]  # fmt: skip
BN1D = ["weight", "bias", "running_mean", "running_var", "num_batches_tracked"]
FEDBN_HEAD_KEYS = (
    ["fc1.weight", "fc1.bias"] + [f"bn6.{a}" for a in BN1D]
    + ["fc2.weight", "fc2.bias"] + [f"bn7.{a}" for a in BN1D]
    + ["fc3.weight", "fc3.bias"]
)  # fmt: skip


def meta(name, **kw):
    kw.setdefault("image_size", (64, 64))
    with torch.device("meta"):
        return build_model(name, num_classes=kw.pop("num_classes", 10), **kw)


def meta_forward(model, side=64, batch=2):
    with torch.device("meta"):
        return model(torch.empty(batch, 3, side, side))


def conv(cin, cout, k):
    return cin * cout * k * k + cout


def linear(fin, fout):
    return fin * fout + fout


CONVS = conv(3, 64, 11) + conv(64, 192, 5) + conv(192, 384, 3) + conv(384, 256, 3) + conv(256, 256, 3)
CONV_BN = 2 * (64 + 192 + 384 + 256 + 256)
FCS = linear(9216, 4096) + linear(4096, 4096) + linear(4096, 10)


def test_parameter_counts():
    n_fedbn = sum(p.numel() for p in meta("alexnet").parameters())
    n_fedwon = sum(p.numel() for p in meta("alexnet-dropout").parameters())
    assert n_fedbn == CONVS + CONV_BN + FCS + 2 * 2 * 4096 == 57_063_498
    assert n_fedwon == CONVS + CONV_BN + FCS == 57_047_114


def test_state_dict_names_are_fedbn_features_and_top_level_fc():
    assert list(meta("alexnet").state_dict()) == FEDBN_FEATURE_KEYS + FEDBN_HEAD_KEYS
    fedwon = [k for k in FEDBN_FEATURE_KEYS + FEDBN_HEAD_KEYS if not k.startswith(("bn6", "bn7"))]
    assert list(meta("alexnet-dropout").state_dict()) == fedwon


def test_layers_follow_fedbn_and_fedwon_table_6():
    model = meta("alexnet")
    f = model.features
    assert [(c.in_channels, c.out_channels, c.kernel_size, c.stride, c.padding)
            for c in (f.conv1, f.conv2, f.conv3, f.conv4, f.conv5)] == [
        (3, 64, (11, 11), (4, 4), (2, 2)), (64, 192, (5, 5), (1, 1), (2, 2)),
        (192, 384, (3, 3), (1, 1), (1, 1)), (384, 256, (3, 3), (1, 1), (1, 1)),
        (256, 256, (3, 3), (1, 1), (1, 1)),
    ]  # fmt: skip
    assert [n for n, m in f.named_children() if isinstance(m, nn.MaxPool2d)] == [
        "maxpool1", "maxpool2", "maxpool5"
    ]
    assert f.maxpool1.kernel_size == 3 and f.maxpool1.stride == 2
    assert model.avgpool.output_size == (6, 6)
    assert isinstance(model.bn6, nn.BatchNorm1d) and isinstance(model.bn7, nn.BatchNorm1d)
    assert not any(isinstance(m, nn.Dropout) for m in model.modules())  # FedBN has none
    fedwon = meta("alexnet-dropout")
    assert isinstance(fedwon.bn6, nn.Identity) and isinstance(fedwon.bn7, nn.Identity)
    assert isinstance(fedwon.drop1, nn.Dropout) and fedwon.drop1.p == 0.5
    assert isinstance(fedwon.drop2, nn.Dropout)
    assert isinstance(fedwon.features.bn3, nn.BatchNorm2d)
    assert meta_forward(model, 256).shape == (2, 10)  # FedBN's Office-Caltech-10 / DomainNet size
    assert meta_forward(model, 224).shape == (2, 10)


@pytest.mark.parametrize("norm", NORM_KINDS)
def test_alexnet_every_norm(norm):
    model = meta("alexnet", norm=norm).train()
    conv_norm = type(make_norm(norm, 8))
    assert all(type(getattr(model.features, f"bn{i}")) is conv_norm for i in range(1, 6))
    fc_norm = type(make_norm(norm, 8, dims=1)) if supports_vectors(norm) else nn.Identity
    assert type(model.bn6) is fc_norm and type(model.bn7) is fc_norm
    if norm == "bn":
        assert fc_norm is nn.BatchNorm1d
    if norm in ("in", "perxan"):
        assert fc_norm is nn.Identity
    assert meta_forward(model, 63).shape == (2, 10)


@pytest.mark.parametrize("norm, conv", [("none", "ws"), ("gn", "plain"), ("ln", "plain")])
def test_alexnet_dropout_fedwon_variants(norm, conv):
    model = meta("alexnet-dropout", norm=norm, conv=conv).train()
    assert isinstance(model.bn6, nn.Identity)
    if conv == "ws":  # all five convs, Table 6's plain conv3 read as a typo
        assert all(isinstance(getattr(model.features, f"conv{i}"), WSConv2d) for i in range(1, 6))
        assert not any(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    assert meta_forward(model).shape == (2, 10)


def test_real_model_protocol_and_training_step():
    torch.manual_seed(0)
    model = build_model("alexnet", num_classes=10, image_size=(64, 64))
    x, y = torch.randn(4, 3, 64, 64), torch.randint(0, 10, (4,))
    model.train()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None for p in model.parameters())
    model.eval()
    with torch.no_grad():
        features = model.encode(x)
        assert features.shape == (4, 4096)
        assert torch.equal(model(x), model.classifier(features))
    assert model.classifier is model.fc3
    assert [k for k in model.state_dict() if k.startswith("fc3.")] == ["fc3.weight", "fc3.bias"]
    assert not any(k.startswith("classifier.") for k in model.state_dict())


@pytest.mark.parametrize("name", ["alexnet", "alexnet-dropout"])
def test_image_size_rule(name):
    meta(name, image_size=(63, 63), norm="in")
    with pytest.raises(MpiflError, match=f"model {name} needs images of at least 63x63.*62x80"):
        meta(name, image_size=(62, 80))


def test_fedbn_and_torchvision_checkpoint_names_map_onto_the_model():
    model = meta("alexnet")
    own = model.state_dict()
    fedbn = {("classifier." + k if k.startswith(("fc", "bn6", "bn7")) else k): v
             for k, v in own.items()}  # fmt: skip
    assert renamed_keys(model, fedbn).keys() == own.keys()
    torchvision = pytest.importorskip("torchvision")
    with torch.device("meta"):
        tv = torchvision.models.alexnet(num_classes=10).state_dict()
    mapped = renamed_keys(model, tv)
    ours = meta("alexnet-dropout", norm="none").state_dict()  # torchvision: no BN
    assert mapped.keys() == ours.keys()
    assert all(mapped[k].shape == ours[k].shape for k in ours)
