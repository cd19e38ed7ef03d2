"""gPerXAN: BN sides personal, guiding regularizer through the frozen global classifier."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mpifl.algorithms import Uploads, get_algorithm
from mpifl.errors import MpiflError
from mpifl.models import PerXAN, state_entries
from mpifl.models.unet import UNet
from mpifl.plan.config import RunConfig
from mpifl.plan.segmentation import dice_loss
from mpifl.plan.task import SEGMENTATION

from .helpers import aggregate, client_meta, make_algo


def _algo(holdout=None, lam=0.5):
    algo, model = make_algo("gperxan", {"holdout": holdout}, guide_lambda=lam)
    return algo, model, {e.key: e for e in algo.entries}


def test_no_bn_side_tensor_crosses_the_wire_without_a_held_out_domain():
    algo, _, entries = _algo()
    policy = algo.policy()
    sent = [s.name for s in policy.download + policy.upload]
    assert sent and not any(entries[k].is_bn_side for k in sent)
    assert any(entries[k].module_kind == "perxan" and entries[k].part == "in" for k in sent)
    assert {s.name for s in policy.private} == {k for k, e in entries.items() if e.is_bn_side}
    assert algo.evaluates == ("personal",)


def test_with_a_held_out_domain_bn_sides_go_up_and_only_their_average_comes_down():
    algo, _, entries = _algo(holdout="street")
    policy = algo.policy()
    model_keys = set(entries)
    down_model = [s.name for s in policy.download if s.name in model_keys]
    assert not any(entries[k].is_bn_side for k in down_model)
    extra_down = [s.name for s in policy.download if s.name not in model_keys]
    assert extra_down and all(n.startswith("gperxan.global_bn/") for n in extra_down)
    assert not any(n.endswith("num_batches_tracked") for n in extra_down)
    assert algo.evaluates == ("global", "personal")


def test_server_averages_uploaded_bn_sides_into_the_global_copy():
    algo, model, _ = _algo(holdout="street")
    server = algo.init_server(model.state_dict())
    names = [s.name for s in algo.policy().upload]
    tensors = {n: [np.full(algo.policy().upload[i].shape, v, np.float32) for v in (1.0, 4.0)]
               for i, n in enumerate(names)}
    uploads = Uploads(clients=np.arange(2), meta=client_meta([1, 2]),
                      tensors=tensors)
    aggregate(algo, server, uploads)
    down = algo.download(server)
    global_bn = {k: v for k, v in down.items() if k.startswith("gperxan.global_bn/")}
    assert global_bn and all(torch.allclose(v, torch.full_like(v, 3.0)) for v in global_bn.values())
    private = algo.global_private(algo.init_client(None, model.state_dict()), down)
    key = next(iter(global_bn)).split("/", 1)[1]
    assert torch.equal(private[key], global_bn["gperxan.global_bn/" + key])


def test_guiding_term_is_lambda_ce_of_the_frozen_global_head_and_trains_only_the_extractor():
    algo, model, _ = _algo(lam=0.25)
    algo.begin_local(None, model, {})
    with torch.no_grad():
        model.classifier.weight.add_(1.0)  # the local head moves; the frozen global copy must not
    x, y = torch.randn(4, 3, 28, 28), torch.tensor([0, 1, 2, 3])
    features = model.encode(x)
    extra = algo.extra_loss(None, model, features, model.classifier(features), y)
    expected = 0.25 * F.cross_entropy(algo._global_head(features), y)
    assert torch.allclose(extra, expected)
    assert not torch.allclose(algo._global_head.weight, model.classifier.weight)
    extra.backward()
    assert model.classifier.weight.grad is None and algo._global_head.weight.grad is None
    assert model.conv1.weight.grad is not None and model.conv1.weight.grad.abs().sum() > 0


def test_on_a_segmentation_task_the_objective_is_dice_plus_lambda_dice_through_the_frozen_global_head():
    """Eq. 4 with the task's base loss l = Dice for both terms: a PerXAN U-Net's mini-batch objective is
    Dice(h_i(g_i(x)), m) + lambda Dice(h_g(g_i(x)), m), not a cross-entropy guide."""
    torch.manual_seed(0)
    net = UNet(num_classes=2, width=4, depth=2, norm="perxan")
    cfg = RunConfig(algo="gperxan", algo_options={**{o.name: o.default for o in get_algorithm("gperxan").options},
                                                   "guide_lambda": 0.5})
    algo = get_algorithm("gperxan")(cfg, state_entries(net))
    algo.bind_task(SEGMENTATION)
    net.train()
    algo.begin_local(None, net, {})
    with torch.no_grad():
        net.classifier.weight.mul_(-2.0)  # the local head moves; h_g keeps the downloaded one
    x = torch.randn(2, 3, 16, 16)
    masks = torch.zeros(2, 16, 16, dtype=torch.long)
    masks[:, 4:12, 3:10] = 1
    loss, logits = algo.batch_loss(None, net, x, masks)
    features = net.encode(x)  # training mode: batch statistics, the same features again
    assert torch.allclose(logits, net.classifier(features))
    local, guide = dice_loss(net.classifier(features), masks), dice_loss(algo._global_head(features), masks)
    assert torch.allclose(loss, local + 0.5 * guide, atol=1e-6)
    assert not torch.allclose(loss, local + 0.5 * F.cross_entropy(algo._global_head(features), masks), atol=1e-3)


def _adapted(blocks=None, model="smallcnn", image_size=(28, 28), **core):
    """(algorithm, model) with ``--perxan-blocks blocks`` (None: the default) and core options ``core``
    (``norm``, ``norm_blocks``), the network built as the session does."""
    cls = get_algorithm("gperxan")
    options = {o.name: o.default for o in cls.options}
    if blocks is not None:
        options["perxan_blocks"] = blocks
    cfg = RunConfig(algo="gperxan", model=model, algo_options=options, **core)
    net = cls.network(cfg, num_classes=10, image_size=image_size)
    return cls(cfg, state_entries(net)), net


def test_perxan_blocks_default_is_every_bn_layer_as_the_authors_code():
    _, net = _adapted()
    assert all(isinstance(getattr(net, f"norm{i}"), PerXAN) for i in (1, 2, 3))


def test_perxan_blocks_keeps_perxan_in_the_first_stages_and_shares_the_later_plain_bn():
    algo, net = _adapted("2")  # SmallCNN's stages end at norm1, norm2, norm3
    assert isinstance(net.norm1, PerXAN) and isinstance(net.norm2, PerXAN)
    assert type(net.norm3) is torch.nn.BatchNorm2d
    policy = algo.policy()
    sent = {s.name for s in policy.download}
    assert {"norm3.weight", "norm3.bias", "norm3.running_mean", "norm3.running_var"} <= sent
    assert "norm3.num_batches_tracked" not in sent
    assert {s.name for s in policy.private} == {
        f"norm{i}.{k}" for i in (1, 2)
        for k in ("bn.weight", "bn.bias", "bn.running_mean", "bn.running_var", "bn.num_batches_tracked", "bn_score")
    } | {"norm3.num_batches_tracked"}


def test_perxan_blocks_on_densenet_is_the_first_dense_block_with_its_transition_and_the_stem_unless_nostem():
    _, net = _adapted("1", model="densenet121", image_size=(64, 64))
    assert isinstance(net.features.norm0, PerXAN) and isinstance(net.features.transition1.norm, PerXAN)
    assert type(net.features.denseblock2.denselayer1.norm1) is torch.nn.BatchNorm2d
    _, net = _adapted("1-nostem", model="densenet121", image_size=(64, 64))
    assert type(net.features.norm0) is torch.nn.BatchNorm2d and isinstance(net.features.transition1.norm, PerXAN)


@pytest.mark.parametrize("blocks", ["0", "4", "two"])
def test_perxan_blocks_out_of_range_is_a_one_line_error(blocks):
    with pytest.raises(MpiflError, match="--perxan-blocks must be auto, all, N or N-nostem with N a number of "
                                         "stages from 1 to 3"):
        _adapted(blocks)
