"""DigitModel: FedBN's layer sizes and names, norm variants, protocol, input size."""

import pytest
import torch
from torch import nn

from mpifl.errors import MpiflError
from mpifl.models import NORM_KINDS, AdaptiveGroupNorm, PerXAN, WNConv2d, WSConv2d, build_model

FEDBN_KEYS = [
    "conv1.weight", "conv1.bias",
    "bn1.weight", "bn1.bias", "bn1.running_mean", "bn1.running_var", "bn1.num_batches_tracked",
    "conv2.weight", "conv2.bias",
    "bn2.weight", "bn2.bias", "bn2.running_mean", "bn2.running_var", "bn2.num_batches_tracked",
    "conv3.weight", "conv3.bias",
    "bn3.weight", "bn3.bias", "bn3.running_mean", "bn3.running_var", "bn3.num_batches_tracked",
    "fc1.weight", "fc1.bias",
    "bn4.weight", "bn4.bias", "bn4.running_mean", "bn4.running_var", "bn4.num_batches_tracked",
    "fc2.weight", "fc2.bias",
    "bn5.weight", "bn5.bias", "bn5.running_mean", "bn5.running_var", "bn5.num_batches_tracked",
    "fc3.weight", "fc3.bias",
]  # fmt: skip


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    return {norm: build_model("digitmodel", num_classes=10, norm=norm) for norm in NORM_KINDS}


def conv(cin, cout, k):
    return cin * cout * k * k + cout


def linear(fin, fout):
    return fin * fout + fout


def test_parameter_count_equals_fedbn(models):
    expected = (
        conv(3, 64, 5) + 2 * 64
        + conv(64, 64, 5) + 2 * 64
        + conv(64, 128, 5) + 2 * 128
        + linear(128 * 7 * 7, 2048) + 2 * 2048
        + linear(2048, 512) + 2 * 512
        + linear(512, 10)
    )  # fmt: skip
    assert expected == 14_219_210
    assert sum(p.numel() for p in models["bn"].parameters()) == expected


def test_state_dict_keys_are_fedbn_names_in_order(models):
    assert list(models["bn"].state_dict()) == FEDBN_KEYS


def test_loads_a_fedbn_state_dict_by_name(models):
    fedbn = {k: torch.full_like(v, 0.5) for k, v in models["bn"].state_dict().items()}
    torch.manual_seed(1)
    model = build_model("digitmodel", num_classes=10)
    model.load_state_dict(fedbn, strict=True)
    assert torch.equal(model.fc1.weight, torch.full((2048, 6272), 0.5))


@pytest.mark.parametrize("norm", NORM_KINDS)
def test_output_and_feature_shapes(models, norm):
    model = models[norm].train()
    x = torch.randn(4, 3, 28, 28)
    assert model(x).shape == (4, 10)
    assert model.encode(x).shape == (4, 512)


@pytest.mark.parametrize(
    "norm, conv_norm, fc_norm",
    [
        ("bn", nn.BatchNorm2d, nn.BatchNorm1d),
        ("gn", nn.GroupNorm, nn.GroupNorm),
        ("ln", nn.GroupNorm, nn.GroupNorm),
        ("in", nn.InstanceNorm2d, nn.Identity),
        ("none", nn.Identity, nn.Identity),
        ("perxan", PerXAN, nn.Identity),
        ("agn", AdaptiveGroupNorm, AdaptiveGroupNorm),
    ],
)
def test_norm_attributes_keep_fedbn_names(models, norm, conv_norm, fc_norm):
    model = models[norm]
    for name in ("bn1", "bn2", "bn3"):
        assert type(getattr(model, name)) is conv_norm
    for name in ("bn4", "bn5"):
        assert type(getattr(model, name)) is fc_norm


def test_gn_and_ln_group_counts(models):
    assert [models["gn"].get_submodule(f"bn{i}").num_groups for i in range(1, 6)] == [32] * 5
    assert [models["ln"].get_submodule(f"bn{i}").num_groups for i in range(1, 6)] == [1] * 5


@pytest.mark.parametrize("norm", NORM_KINDS)
def test_forward_is_classifier_of_encode(models, norm):
    model = models[norm].eval()
    x = torch.randn(3, 3, 28, 28)
    with torch.no_grad():
        assert torch.equal(model(x), model.classifier(model.encode(x)))


def test_classifier_is_fc3_and_not_duplicated(models):
    model = models["bn"]
    assert model.classifier is model.fc3
    assert not any(k.startswith("classifier") for k in model.state_dict())
    assert len(list(model.parameters())) == len({id(p) for p in model.parameters()})


def test_other_input_channels():
    model = build_model("digitmodel", num_classes=4, in_channels=1)
    assert model(torch.randn(2, 1, 28, 28)).shape == (2, 4)


@pytest.mark.parametrize("size", [(32, 32), (28, 32), (224, 224)])
def test_other_image_sizes_are_a_user_error(size):
    with pytest.raises(MpiflError) as err:
        build_model("digitmodel", num_classes=10, image_size=size)
    message = str(err.value)
    assert "28x28" in message and f"{size[0]}x{size[1]}" in message
    assert "--model smallcnn" in message


def test_plain_conv_is_the_default_and_keeps_fedbn_keys():
    torch.manual_seed(3)
    default = build_model("digitmodel", num_classes=10)
    torch.manual_seed(3)
    plain = build_model("digitmodel", num_classes=10, conv="plain")
    assert list(plain.state_dict()) == FEDBN_KEYS
    assert all(type(plain.get_submodule(f"conv{i}")) is nn.Conv2d for i in (1, 2, 3))
    for key, value in default.state_dict().items():
        assert torch.equal(value, plain.state_dict()[key]), key


@pytest.mark.parametrize("conv, cls", [("ws", WSConv2d), ("wn", WNConv2d)])
def test_conv_kinds_fedwon_and_fednn(conv, cls):
    norm = "none" if conv == "ws" else "agn"  # FedWon: no norm + WSConv; FedNN: AGN + WN
    model = build_model("digitmodel", num_classes=10, norm=norm, conv=conv).train()
    assert all(type(model.get_submodule(f"conv{i}")) is cls for i in (1, 2, 3))
    keys = list(model.state_dict())
    gains = [k for k in keys if k.endswith(".gain")]
    assert gains == (["conv1.gain", "conv2.gain", "conv3.gain"] if conv == "ws" else [])
    x = torch.randn(4, 3, 28, 28)
    model(x).logsumexp(1).sum().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_fedwon_cnn_is_table_5_dropout_before_fc1_fc2_and_no_fc_norms():
    bn = build_model("fedwon-cnn", num_classes=10, norm="bn")
    assert [k for k in bn.state_dict() if k.startswith(("bn4", "bn5"))] == []
    assert [k for k in bn.state_dict() if k.startswith("bn")] == [
        f"bn{i}.{a}" for i in (1, 2, 3) for a in ("weight", "bias", "running_mean", "running_var",
                                                  "num_batches_tracked")]
    assert type(bn.drop1) is torch.nn.Dropout and type(bn.drop2) is torch.nn.Dropout
    assert bn.drop1.p == 0.5 and bn.drop2.p == 0.5
    fedwon = build_model("fedwon-cnn", num_classes=10, norm="none", conv="ws")
    assert {k.split(".")[0] for k in fedwon.state_dict()} == {"conv1", "conv2", "conv3", "fc1", "fc2", "fc3"}
    assert "conv1.gain" in fedwon.state_dict()
    seen = {}
    for name in ("drop1", "drop2"):
        getattr(bn, name).register_forward_hook(lambda m, inp, out, name=name: seen.update({name: inp[0].shape[1]}))
    bn.train()(torch.randn(2, 3, 28, 28))
    assert seen == {"drop1": 6272, "drop2": 2048}  # the inputs of fc1 and fc2
    assert type(build_model("digitmodel", num_classes=10).drop1) is torch.nn.Identity
