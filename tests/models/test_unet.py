"""2D U-Net (HarmoFL / FedFA prostate code): widths, shapes, parameter count, norms and convs, sizes, blocks."""

import pytest
import torch
from torch import nn

from mpifl.errors import MpiflError
from mpifl.models import CONV_KINDS, NORM_KINDS, WNConv2d, WSConv2d, build_model, state_entries
from mpifl.models.norm import make_norm
from mpifl.models.structure import blocks
from mpifl.models.unet import UNet


def small(**kw) -> UNet:
    torch.manual_seed(0)
    return UNet(kw.pop("num_classes", 3), kw.pop("in_channels", 1), width=4, depth=2, **kw)


def double_conv_params(a: int, b: int) -> int:
    return 9 * a * b + 9 * b * b + 4 * b  # two bias-free 3x3 convs, two affine BNs


def test_parameter_count_by_hand():
    # width 2, depth 1, 1 input channel, 2 classes:
    # enc1 DoubleConv(1->2) 18+36+8, bottleneck DoubleConv(2->4) 72+144+16,
    # up1 ConvTranspose 4->2 2x2 (32 + 2 bias) + DoubleConv(4->2) 72+36+8, classifier 1x1 2->2 (4 + 2)
    model = UNet(2, 1, width=2, depth=1)
    assert sum(p.numel() for p in model.parameters()) == 62 + 232 + 150 + 6 == 450


@pytest.fixture(scope="module")
def unet() -> UNet:
    """The registry's U-Net for 2 classes and 1 input channel (built once: 7.8 M parameters)."""
    torch.manual_seed(0)
    return build_model("unet", num_classes=2, in_channels=1, image_size=(384, 384))


def test_registry_unet_widths_and_size(unet):
    model = unet
    assert [getattr(model, f"enc{i}").conv1.out_channels for i in (1, 2, 3, 4)] == [32, 64, 128, 256]
    assert model.bottleneck.conv2.out_channels == 512
    assert [getattr(model, f"up{i}").up.out_channels for i in (4, 3, 2, 1)] == [256, 128, 64, 32]
    assert [getattr(model, f"up{i}").block.conv1.in_channels for i in (4, 3, 2, 1)] == [512, 256, 128, 64]
    w = (32, 64, 128, 256, 512)
    encoder = double_conv_params(1, 32) + sum(double_conv_params(a, b) for a, b in zip(w[:3], w[1:4]))
    decoder = sum(4 * b * a + a + double_conv_params(2 * a, a) for a, b in zip(w[:4], w[1:]))
    expected = encoder + double_conv_params(256, 512) + decoder + 32 * 2 + 2
    assert sum(p.numel() for p in model.parameters()) == expected == 7_762_498
    assert isinstance(model.classifier, nn.Conv2d) and model.classifier.kernel_size == (1, 1)


def test_output_shape_and_protocol():
    model = small().eval()
    x = torch.randn(2, 1, 16, 24)
    with torch.no_grad():
        assert model.encode(x).shape == (2, 4, 16, 24)
        assert model(x).shape == (2, 3, 16, 24)
        assert torch.equal(model(x), model.classifier(model.encode(x)))


def test_skip_connections_carry_the_input_resolution():
    # with the up-sampling path zeroed, the decoder still sees the encoder's full-resolution map
    model = small(norm="none").eval()
    with torch.no_grad():
        model.up1.up.weight.zero_()
        model.up1.up.bias.zero_()
        x = torch.randn(1, 1, 8, 8)
        skip = model.enc1(x)
        expected = model.up1.block(torch.cat([torch.zeros_like(skip), skip], 1))
        assert torch.equal(model.encode(x), expected)


@pytest.mark.parametrize("norm", NORM_KINDS)
@pytest.mark.parametrize("conv", CONV_KINDS)
def test_every_norm_and_conv_trains_a_step(norm, conv):
    model = small(norm=norm, conv=conv).train()
    x, masks = torch.randn(2, 1, 8, 8), torch.randint(0, 3, (2, 8, 8))
    nn.functional.cross_entropy(model(x), masks).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    conv_cls = {"plain": nn.Conv2d, "ws": WSConv2d, "wn": WNConv2d}[conv]
    threes = [m for m in model.modules() if isinstance(m, nn.Conv2d) and m.kernel_size == (3, 3)]
    assert len(threes) == 10 and all(type(m) is conv_cls and m.bias is None for m in threes)
    assert type(model.classifier) is nn.Conv2d
    assert all(type(m) is nn.ConvTranspose2d for m in (model.up1.up, model.up2.up))
    assert type(model.enc1.norm1) is type(make_norm(norm, 4))
    model.eval()
    with torch.no_grad():
        out = model(x)
        assert out.shape == (2, 3, 8, 8) and torch.isfinite(out).all()


def test_inputs_not_divisible_by_two_to_the_depth_raise():
    with pytest.raises(ValueError, match="multiples of 4"):
        small()(torch.randn(1, 1, 16, 18))


@pytest.mark.parametrize("size,norm", [((100, 96), "bn"), ((384, 8), "bn"), ((16, 16), "in"), ((16, 32), "perxan")])
def test_builder_refuses_sizes(size, norm):
    with pytest.raises(MpiflError, match=f"multiples of 16 and at least .* but the data is {size[0]}x{size[1]}"):
        build_model("unet", num_classes=2, image_size=size, norm=norm)


def test_builder_takes_the_least_sizes(unet):
    with torch.no_grad():
        assert unet.eval()(torch.randn(2, 1, 16, 48)).shape == (2, 2, 16, 48)
    build_model("unet", num_classes=2, image_size=(32, 32), norm="in")


def test_blocks_follow_forward_order_and_the_head_is_the_classifier(unet):
    model = unet
    names = [group[0] for group in blocks(model)]
    assert names == ["enc1", "enc2", "enc3", "enc4", "bottleneck", "up4", "up3", "up2", "up1", "classifier"]
    head = [e.key for e in state_entries(model) if e.is_head]
    assert head == ["classifier.weight", "classifier.bias"]
    assert [m for m, _ in model.named_children() if m.startswith("pool")] == ["pool1", "pool2", "pool3", "pool4"]


def test_same_seed_same_weights():
    a, b = small().state_dict(), small().state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
