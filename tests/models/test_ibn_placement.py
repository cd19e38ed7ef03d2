"""Where ``--norm ibn`` puts IBN-a layers, per registry model, against IBN-Net's own builders.

The expected sites are hard-coded from the authors' code (github.com/XingangPan/IBN-Net, ``ibnnet/``):

* ``resnet_ibn.py``, ``resnet18_ibn_a`` / ``resnet50_ibn_a``: ``ibn_cfg=('a', 'a', 'a', None)``, so
  ``bn1`` of every block of layer1-layer3 is ``modules.IBN(planes)``, IN on the first
  ``int(planes * 0.5)`` channels; stem, ``bn2``/``bn3``, downsample and layer4 stay BN.
* ``densenet_ibn.py``, ``densenet121_ibn_a``: in dense blocks 1-3 (not 4), ``norm1`` of dense layers with
  ``i % 3 == 0`` (denselayer1, 4, 7, ...) is that file's ``IBN(C, 0.4)``: BN on the first
  ``int(C * 0.6)`` channels, IN on the other ``C - int(C * 0.6)``; everything else BN.

The other architectures have no IBN-Net builder; their rule is the one stated in
:mod:`mpifl.models.surgery` (CIFAR ResNet and MobileNetV2: the ResNet rule on their blocks; plain CNNs
and the U-Net: every conv norm of every stage but the last).
"""

import pytest
import torch
from torch import nn

from mpifl.errors import MpiflError
from mpifl.models import IBN, build_model, place_composite_norms, state_entries
from mpifl.models.registry import MODEL_NAMES

SIZES = {"digitmodel": 28, "fedwon-cnn": 28, "lenet": 32, "smallcnn": 32, "alexnet": 64, "alexnet-dropout": 64,
         "resnet20": 32, "resnet18": 64, "resnet50": 64, "mobilenetv2": 64, "densenet121": 64, "unet": 32}

# model -> (IBN layers, IN channels over all of them, the IN channels first), under --norm-blocks auto
EXPECTED = {
    # IBN-Net resnet_ibn.py resnet18_ibn_a: BasicBlock [2, 2, 2, 2], bn1 of layer1-3: 2 * (32 + 64 + 128)
    "resnet18": (6, 448, True),
    # IBN-Net resnet_ibn.py resnet50_ibn_a: Bottleneck [3, 4, 6, 3], bn1 of layer1-3: 3*32 + 4*64 + 6*128
    "resnet50": (13, 1120, True),
    # IBN-Net densenet_ibn.py densenet121_ibn_a: blocks (6, 12, 24, 16), norm1 of every third dense layer of
    # blocks 1-3: 2 + 4 + 8 = 14 layers, IN on the last C - int(0.6 C) channels (DENSENET121_SITES)
    "densenet121": (14, 2425, False),
    # no IBN-Net builder: the ResNet rule, bn1 of the blocks of layer1-2 of 3 (16 and 32 planes, 3 blocks each)
    "resnet20": (6, 72, True),
    # no IBN-Net builder: the ResNet rule on inverted-residual blocks 1-13 (stages 1-3 of 4), their first norm
    # (channels 32, 96, 144, 144, 192, 192, 192, 384, 384, 384, 384, 576, 576), C // 2 first
    "mobilenetv2": (13, 1840, True),
    # no IBN-Net builder: plain CNNs and U-Net, every conv norm of every stage but the last, C // 2 first
    "digitmodel": (2, 64, True),  # 64, 64 of conv 64-64-128
    "fedwon-cnn": (2, 64, True),
    "smallcnn": (2, 24, True),  # 16, 32 of 16-32-64
    "alexnet": (4, 448, True),  # 64, 192, 384, 256 of bn1-bn4 (bn5 in the last stage)
    "alexnet-dropout": (4, 448, True),
    "lenet": (1, 32, True),  # 64 of bn1 (bn2 in the last stage)
    "unet": (8, 480, True),  # norm1, norm2 of enc1-enc4 (32, 64, 128, 256); bottleneck and decoder BN
}

# IBN-Net densenet_ibn.py on DenseNet-121: (site, C, IN channels = C - int(C * (1 - 0.4)))
DENSENET121_SITES = [
    ("denseblock1.denselayer1", 64, 26), ("denseblock1.denselayer4", 160, 64),
    ("denseblock2.denselayer1", 128, 52), ("denseblock2.denselayer4", 224, 90),
    ("denseblock2.denselayer7", 320, 128), ("denseblock2.denselayer10", 416, 167),
    ("denseblock3.denselayer1", 256, 103), ("denseblock3.denselayer4", 352, 141),
    ("denseblock3.denselayer7", 448, 180), ("denseblock3.denselayer10", 544, 218),
    ("denseblock3.denselayer13", 640, 256), ("denseblock3.denselayer16", 736, 295),
    ("denseblock3.denselayer19", 832, 333), ("denseblock3.denselayer22", 928, 372),
]


def _placed(name, blocks="auto"):
    torch.manual_seed(0)
    side = SIZES[name]
    model = build_model(name, num_classes=4, image_size=(side, side), norm="ibn")
    return place_composite_norms(model, blocks, "--norm-blocks")


def _ibn_layers(model):
    return [(n, m) for n, m in model.named_modules() if isinstance(m, IBN)]


def _split(layer):
    """(IN channels, BN channels, IN on the first channels)."""
    return layer.inorm.num_features, layer.bn.num_features, getattr(layer, "in_first", True)


def test_every_registry_model_that_takes_ibn_has_an_expected_placement():
    takes = []
    for name in MODEL_NAMES:
        side = SIZES.get(name, 64)
        try:
            build_model(name, num_classes=4, image_size=(side, side), norm="ibn")
        except MpiflError:
            continue
        takes.append(name)
    assert sorted(takes) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_ibn_layers_and_in_channels_follow_ibn_net(name):
    layers, in_channels, in_first = EXPECTED[name]
    ibn = _ibn_layers(_placed(name))
    assert len(ibn) == layers
    assert sum(m.inorm.num_features for _, m in ibn) == in_channels
    assert all(_split(m)[2] is in_first for _, m in ibn)
    assert all(m.inorm.num_features + m.bn.num_features == m.num_features for _, m in ibn)
    assert all(m.inorm.affine and not m.inorm.track_running_stats for _, m in ibn)


def test_densenet121_is_ibn_nets_densenet121_ibn_a():
    model = _placed("densenet121")
    got = [(n, m.num_features, *_split(m)) for n, m in _ibn_layers(model)]
    assert got == [(f"features.{s}.norm1", c, i, c - i, False) for s, c, i in DENSENET121_SITES]
    modules = dict(model.named_modules())
    plain = ["features.norm0", "features.denseblock1.denselayer1.norm2", "features.denseblock1.denselayer2.norm1",
             "features.transition1.norm", "features.denseblock4.denselayer1.norm1", "features.norm5"]
    assert [type(modules[n]) for n in plain] == [nn.BatchNorm2d] * len(plain)


def test_densenet_ibn_normalizes_the_last_channels_by_instance_and_the_first_by_batch():
    layer = _placed("densenet121").features.denseblock1.denselayer1.norm1  # C 64: BN 38, IN 26
    layer.train()
    x = torch.randn(4, 64, 5, 5) * 3 + 1
    y = layer(x)
    first, last = x[:, :38], x[:, 38:]
    bn = (first - first.mean((0, 2, 3), keepdim=True)) / torch.sqrt(first.var((0, 2, 3), unbiased=False,
                                                                                keepdim=True) + 1e-5)
    inst = (last - last.mean((2, 3), keepdim=True)) / torch.sqrt(last.var((2, 3), unbiased=False, keepdim=True)
                                                                 + 1e-5)
    assert torch.allclose(y[:, :38], bn, atol=1e-4) and torch.allclose(y[:, 38:], inst, atol=1e-4)


def test_densenet_ibn_entries_keep_their_bn_and_in_sides():
    entries = {e.key: e for e in state_entries(_placed("densenet121"))}
    key = "features.denseblock1.denselayer1.norm1"
    assert entries[f"{key}.bn.running_mean"].shape == (38,) and entries[f"{key}.bn.running_mean"].is_bn_side
    assert entries[f"{key}.inorm.weight"].shape == (26,) and entries[f"{key}.inorm.weight"].part == "in"
    assert entries["features.denseblock1.denselayer2.norm1.running_mean"].module_kind == "bn"


def test_resnet50_is_ibn_nets_resnet50_ibn_a():
    model = _placed("resnet50")
    got = [(n, *_split(m)) for n, m in _ibn_layers(model)]
    planes = {1: 64, 2: 128, 3: 256}
    assert got == [(f"layer{s}.{b}.bn1", planes[s] // 2, planes[s] - planes[s] // 2, True)
                   for s, n in ((1, 3), (2, 4), (3, 6)) for b in range(n)]


def test_norm_blocks_n_and_all_keep_the_architectures_sites():
    assert len(_ibn_layers(_placed("densenet121", "1"))) == 2  # dense block 1: denselayer1, 4
    assert len(_ibn_layers(_placed("densenet121", "all"))) == 20  # + block 4: denselayer1, 4, ..., 16
    assert len(_ibn_layers(_placed("resnet18", "all"))) == 8  # every block's bn1
    assert len(_ibn_layers(_placed("mobilenetv2", "all"))) == 17  # every inverted-residual block


def test_ibn_sites_refuses_an_architecture_without_a_rule():
    from mpifl.models.surgery import ibn_sites

    with pytest.raises(MpiflError, match="no IBN-a placement is known for Sequential"):
        ibn_sites(nn.Sequential(nn.Conv2d(3, 4, 3), IBN(4)))
