"""MixStyle inside FedAvg: layers after all stages but the last, active only in local training."""

import pytest
import torch
import torch.nn.functional as F

from mpifl.algorithms import get_algorithm
from mpifl.plan.config import RunConfig
from mpifl.errors import MpiflError
from mpifl.models import build_model, state_entries
from mpifl.models.mixstyle import MixStyle



def _mixstyle(model="smallcnn", size=28, **options):
    cls = get_algorithm("mixstyle")
    cfg = RunConfig(algo="mixstyle", algo_options={**{o.name: o.default for o in cls.options}, **options})
    torch.manual_seed(0)
    plain = build_model(model, num_classes=10, image_size=(size, size))
    torch.manual_seed(0)
    net = cls.adapt_model(build_model(model, num_classes=10, image_size=(size, size)), cfg)
    return cls(cfg, state_entries(net)), net, plain


@pytest.mark.parametrize("model,size,after", [("smallcnn", 28, ["norm1", "norm2"]),
                                              ("resnet20", 32, ["layer1", "layer2"]),
                                              ("resnet18", 32, ["layer1", "layer2", "layer3"])])
def test_layers_follow_every_stage_but_the_last(model, size, after):
    _, net, plain = _mixstyle(model, size)
    assert all(isinstance(m, MixStyle) and (m.p, m.alpha) == (0.5, 0.1) for m in net.mixstyle)
    hooked = [name for name, m in net.named_modules() if m._forward_hooks]
    assert hooked == after
    assert list(net.state_dict()) == list(plain.state_dict())  # stateless layers: same keys, same wire


def test_policy_is_fedavgs():
    algo, _, _ = _mixstyle()
    fedavg = get_algorithm("fedavg")(algo.cfg, algo.entries)
    assert algo.policy() == fedavg.policy() and algo.evaluates == ("global",)


def test_evaluation_and_p_zero_training_equal_the_plain_model():
    _, net, plain = _mixstyle(mixstyle_p=0.0)
    x = torch.randn(6, 3, 28, 28)
    net.train(), plain.train()
    assert torch.equal(net(x), plain(x))
    _, net, plain = _mixstyle(mixstyle_p=1.0)
    net.eval(), plain.eval()
    assert torch.equal(net(x), plain(x))
    net.train(), plain.train()
    torch.manual_seed(4)
    assert not torch.allclose(net(x), plain(x))


def test_training_loss_is_ce_through_the_mixed_features():
    algo, net, _ = _mixstyle(mixstyle_p=1.0)
    x, y = torch.randn(6, 3, 28, 28), torch.arange(6)
    torch.manual_seed(7)
    loss, logits = algo.batch_loss(None, net, x, y)
    torch.manual_seed(7)
    assert torch.equal(logits, net(x)) and torch.equal(loss, F.cross_entropy(logits, y))


@pytest.mark.parametrize("bad", [{"mixstyle_p": -0.1}, {"mixstyle_alpha": 0.0}])
def test_bad_options(bad):
    """Refused in one line before the network is built (the method's options' ranges)."""
    cls = get_algorithm("mixstyle")
    cfg = RunConfig(algo="mixstyle", model="smallcnn", algo_options={**{o.name: o.default for o in cls.options}, **bad})
    with pytest.raises(MpiflError, match=f"^--{next(iter(bad)).replace('_', '-')} must be "):
        cls.network(cfg, num_classes=10)
