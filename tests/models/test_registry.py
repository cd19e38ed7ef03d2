"""build_model: registry contents, model protocol, determinism, user errors."""

import pytest
import torch

from mpifl.errors import MpiflError
from mpifl.models import CONV_KINDS, MODEL_DESCRIPTIONS, MODEL_NAMES, NORM_KINDS, build_model


def test_registry_lists_models_with_one_line_descriptions():
    assert MODEL_NAMES == (
        "digitmodel", "fedwon-cnn", "smallcnn", "alexnet", "alexnet-dropout", "lenet", "resnet20",
        "resnet18", "resnet50", "mobilenetv2", "densenet121", "unet",
    )  # fmt: skip
    assert set(MODEL_DESCRIPTIONS) == set(MODEL_NAMES)
    for desc in MODEL_DESCRIPTIONS.values():
        assert desc and "\n" not in desc


def test_unknown_model_lists_the_names():
    with pytest.raises(MpiflError) as err:
        build_model("resnet999", num_classes=10)
    message = str(err.value)
    assert "'resnet999'" in message
    for name in MODEL_NAMES:
        assert name in message


@pytest.mark.parametrize("name", ["digitmodel", "smallcnn"])
def test_unknown_norm_is_a_user_error(name):
    with pytest.raises(MpiflError, match="unknown norm 'foo'"):
        build_model(name, num_classes=10, norm="foo")


@pytest.mark.parametrize("name", ["digitmodel", "smallcnn"])
def test_unknown_conv_is_a_user_error(name):
    with pytest.raises(MpiflError, match="unknown conv 'foo'"):
        build_model(name, num_classes=10, conv="foo")


@pytest.mark.parametrize("norm", NORM_KINDS)
@pytest.mark.parametrize("conv", CONV_KINDS)
def test_smallcnn_every_norm_and_conv_trains_a_step(norm, conv):
    torch.manual_seed(0)
    model = build_model("smallcnn", num_classes=5, norm=norm, conv=conv).train()
    x, y = torch.randn(6, 3, 12, 12), torch.randint(0, 5, (6,))
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    model.eval()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.1 * p.grad
        out = model(x)
        assert out.shape == (6, 5) and torch.isfinite(out).all()
        assert torch.equal(out, model(x))  # evaluation is deterministic


@pytest.mark.parametrize("name", ["digitmodel", "smallcnn"])
def test_same_seed_same_weights_other_seed_other_weights(name):
    def weights(seed):
        torch.manual_seed(seed)
        return build_model(name, num_classes=10).state_dict()

    a, b, c = weights(1), weights(1), weights(2)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert not torch.equal(a["conv1.weight"], c["conv1.weight"])


@pytest.mark.parametrize("norm", NORM_KINDS)
def test_smallcnn_output_shapes(norm):
    torch.manual_seed(0)
    model = build_model("smallcnn", num_classes=7, norm=norm, image_size=(28, 28))
    assert model(torch.randn(4, 3, 28, 28)).shape == (4, 7)
    assert model.encode(torch.randn(4, 3, 28, 28)).shape == (4, 64)


@pytest.mark.parametrize("size", [(8, 8), (32, 40), (64, 64)])
def test_smallcnn_takes_any_image_size_from_8(size):
    model = build_model("smallcnn", num_classes=5, in_channels=1, image_size=size)
    assert model(torch.randn(2, 1, *size)).shape == (2, 5)


def test_smallcnn_rejects_images_below_8():
    with pytest.raises(MpiflError, match="at least 8x8 but the data is 6x28"):
        build_model("smallcnn", num_classes=10, image_size=(6, 28))


def test_smallcnn_protocol():
    torch.manual_seed(0)
    model = build_model("smallcnn", num_classes=10).eval()
    x = torch.randn(5, 3, 28, 28)
    assert isinstance(model.classifier, torch.nn.Linear)
    assert model.classifier.in_features == 64
    assert torch.equal(model(x), model.classifier(model.encode(x)))
    assert [k for k in model.state_dict() if k.startswith("classifier.")] == [
        "classifier.weight",
        "classifier.bias",
    ]


def test_smallcnn_is_much_smaller_than_digitmodel():
    small = build_model("smallcnn", num_classes=10)
    digit = build_model("digitmodel", num_classes=10)
    n_small = sum(p.numel() for p in small.parameters())
    n_digit = sum(p.numel() for p in digit.parameters())
    # convs 3->16, 16->32, 32->64 (3x3, bias), BN affine 2*(16+32+64), fc 64->10
    assert n_small == (3 * 16 * 9 + 16) + (16 * 32 * 9 + 32) + (32 * 64 * 9 + 64) + 224 + 650
    assert n_digit > 100 * n_small
