"""The guiding regularizer (--guide-lambda): lambda L(h_g(features), y) with h_g the downloaded classifier,
frozen, and L the task's loss (cross-entropy; Dice on a segmentation task), for every method whose download
holds it; refused in one line for the others."""

import copy
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mpifl.algorithms import ALGORITHMS, get_algorithm
from mpifl.algorithms.core.guide import check_guide
from mpifl.client.client_data import ClientData, ResidentImages
from mpifl.client.training import load_state
from mpifl.errors import MpiflError
from mpifl.models import build_model, state_entries
from mpifl.plan.clients import ClientSpec
from mpifl.plan.config import RunConfig
from mpifl.plan.normalize import fixed
from mpifl.plan.task import SEGMENTATION, SEGMENTATION_DICE_CE

from ...conftest import read_metrics, run_here
from ..helpers import local_round, make_algo


class Tiny(nn.Module):
    """features = encode(x) = x (2-d), classifier 2 -> 3 with W = [[1, 0], [0, 1], [1, 1]], b = 0."""

    def __init__(self):
        super().__init__()
        self.classifier = nn.Linear(2, 3)
        with torch.no_grad():
            self.classifier.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]))
            self.classifier.bias.zero_()

    def encode(self, x):
        return x


def test_guide_term_and_its_gradients_by_hand_on_a_tiny_model():
    algo, _ = make_algo("fedavg", guide_lambda=0.5)
    model = Tiny()
    algo.begin_local(None, model, {})
    with torch.no_grad():
        model.classifier.weight.mul_(-3.0)  # the local head moves; h_g is the copy taken at begin_local
    features = torch.tensor([[1.0, 2.0]], requires_grad=True)
    y = torch.tensor([0])
    term = algo.extra_loss(None, model, features, model.classifier(features), y)
    # h_g(f) = [1, 2, 3]; CE = log(e + e^2 + e^3) - 1 = 2.4076059644; lambda = 0.5
    assert term.item() == pytest.approx(0.5 * 2.4076059644, abs=1e-6)
    term.backward()
    # d/df = lambda W^T (softmax([1, 2, 3]) - e_0) = 0.5 [-0.9099694 + 0.6652410, 0.2447285 + 0.6652410]
    assert torch.allclose(features.grad, torch.tensor([[-0.1223642, 0.4549847]]), atol=1e-6)
    assert algo._global_head.weight.grad is None and not algo._global_head.weight.requires_grad
    assert model.classifier.weight.grad is None  # the local head gets nothing from the term


class TinySeg(nn.Module):
    """features = encode(x) = x, (N, 2, H, W); classifier a 1x1 conv 2 -> 2 with W = I, b = 0: logits = features."""

    def __init__(self):
        super().__init__()
        self.classifier = nn.Conv2d(2, 2, 1)
        with torch.no_grad():
            self.classifier.weight.copy_(torch.eye(2).reshape(2, 2, 1, 1))
            self.classifier.bias.zero_()

    def encode(self, x):
        return x


@pytest.mark.parametrize("task", [SEGMENTATION, SEGMENTATION_DICE_CE], ids=["dice", "dice-ce"])
def test_on_a_segmentation_task_the_guide_is_the_tasks_loss_through_the_frozen_head_by_hand(task):
    """Eq. 4 of gPerXAN: one base loss l for both terms, so the guide of a Dice-trained run is a Dice loss."""
    algo, _ = make_algo("fedavg", guide_lambda=0.5)
    algo.bind_task(task)
    model = TinySeg()
    algo.begin_local(None, model, {})
    with torch.no_grad():
        model.classifier.weight.mul_(-3.0)  # the local head moves; h_g is the copy taken at begin_local
        model.classifier.bias.fill_(2.0)
    # one image of 1 x 2 pixels; through h_g the logits are the features: pixel 1 (0, ln 3) -> p = (1/4, 3/4),
    # class 1; pixel 2 (0, 0) -> p = (1/2, 1/2), class 0
    features = torch.tensor([[[[0.0, 0.0]], [[math.log(3.0), 0.0]]]], requires_grad=True)
    masks = torch.tensor([[[1, 0]]])
    term = algo.extra_loss(None, model, features, model.classifier(features), masks)
    eps = 1e-5  # Dice over the batch per class k: (2 sum p_k y_k + eps) / (sum p_k + sum y_k + eps)
    dice = 1 - ((2 * 0.5 + eps) / (0.75 + 1 + eps) + (2 * 0.75 + eps) / (1.25 + 1 + eps)) / 2  # 0.3809524
    ce = (-math.log(0.75) - math.log(0.5)) / 2  # 0.4904146, the pixels' mean
    expected = 0.5 * (dice if task is SEGMENTATION else (ce + dice) / 2)
    assert term.item() == pytest.approx(expected, abs=1e-6)
    assert term.item() != pytest.approx(0.5 * ce, abs=1e-3)  # not the cross-entropy of a classification task
    term.backward()
    assert features.grad.abs().sum() > 0 and model.classifier.weight.grad is None
    assert algo._global_head.weight.grad is None


def test_guide_off_adds_nothing_and_holds_no_head():
    algo, model = make_algo("fedavg")
    algo.begin_local(None, model, {})
    assert algo.guide_lambda == 0 and algo._global_head is None
    features = model.encode(torch.randn(2, 3, 28, 28))
    assert algo.extra_loss(None, model, features, model.classifier(features), torch.tensor([0, 1])) is None


def test_fedavg_with_the_guide_differs_from_fedavg_without_by_exactly_that_term():
    torch.manual_seed(0)
    on, model = make_algo("fedavg", guide_lambda=0.5)
    off, _ = make_algo("fedavg")
    x, y = torch.randn(6, 3, 28, 28), torch.arange(6)
    model.train()
    on.begin_local(None, model, {})
    off.begin_local(None, model, {})
    head = copy.deepcopy(model.classifier)

    def loss_and_grads(algo):
        model.zero_grad()
        loss, _ = algo.batch_loss(None, model, x, y)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    loss_on, grads_on = loss_and_grads(on)
    loss_off, grads_off = loss_and_grads(off)
    model.zero_grad()
    term = 0.5 * F.cross_entropy(head(model.encode(x)), y)
    term.backward()
    assert torch.allclose(loss_on - loss_off, term.detach(), atol=1e-6)
    for name, p in model.named_parameters():
        if name.startswith("classifier."):  # the local head: same gradient with and without the term
            assert torch.equal(grads_on[name], grads_off[name]) and p.grad is None
        else:
            assert torch.allclose(grads_on[name] - grads_off[name], p.grad, atol=1e-6), name
    assert any(p.grad.abs().sum() > 0 for n, p in model.named_parameters() if not n.startswith("classifier."))


def test_a_round_of_fedavg_with_the_guide_steps_by_the_terms_gradient_and_releases_the_head():
    torch.manual_seed(0)
    batch = (torch.randn(6, 3, 28, 28), torch.arange(6))
    uploads = {}
    for lam in (0.0, 0.5):
        torch.manual_seed(1)  # the same initial model
        algo, model = make_algo("fedavg", {"lr": 0.1}, guide_lambda=lam)
        initial = {k: v.clone() for k, v in model.state_dict().items()}
        client = algo.init_client(ClientSpec(0, "d", {"train": np.arange(6)}), initial)
        uploads[lam] = local_round(algo, model, client, algo.download(algo.init_server(initial)), 1, batch=batch)
        assert algo._global_head is None  # released after the round: a later fine-tuning is not guided
    torch.manual_seed(1)
    _, model = make_algo("fedavg")
    model.train()
    head = copy.deepcopy(model.classifier).requires_grad_(False)
    term = 0.5 * F.cross_entropy(head(model.encode(batch[0])), batch[1])
    names, params = zip(*model.named_parameters())
    grads = torch.autograd.grad(term, params, allow_unused=True)
    for name, param, grad in zip(names, params, grads):  # one SGD step, lr 0.1: the difference is -lr d(term)
        expected = torch.zeros_like(param) if grad is None else -0.1 * grad  # the local head: no difference
        assert np.allclose(uploads[0.5][name] - uploads[0.0][name], expected.numpy(), atol=1e-6), name
    assert not np.array_equal(uploads[0.5]["conv1.weight"], uploads[0.0]["conv1.weight"])


def _adapted(name, data_root, lam, **options):
    """(algorithm, model) built as the session builds them (the method's model changes included)."""
    cls = get_algorithm(name)
    cfg = RunConfig(algo=name, data_root=str(data_root),
                    algo_options={**{o.name: o.default for o in cls.options}, "guide_lambda": lam, **options})
    net = cls.adapt_model(build_model("smallcnn", num_classes=10, image_size=(28, 28), norm=cls.norm,
                                      conv=cls.conv), cfg)
    return cls(cfg, state_entries(net)), net


def _client_data(seed):
    """8 random images per split, as a client's host holds them."""
    pixels = torch.randint(0, 256, (8, 3, 28, 28), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    splits = ("train", "val", "test")
    return ClientData({s: ResidentImages(pixels) for s in splits}, {s: torch.arange(8) for s in splits},
                      fixed([0.5] * 3, [0.25] * 3))


def _client_and_download(algo, model):
    """Client 0 of two training clients, after the method's one-time exchange (if it has one) from their
    data, and a download whose classifier differs from the initial one, loaded."""
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    specs = [ClientSpec(i, domain, {s: np.arange(8) for s in ("train", "val", "test")})
             for i, domain in enumerate(("mono", "paper"))]
    algo.bind_clients(specs)
    if algo.setup_exchange() is not None:  # FedMix's mean images, ELCFS's spectra, CCST's styles
        algo.setup_received(torch.stack([algo.setup_contribution(spec, _client_data(spec.id)) for spec in specs]))
    spec = specs[0]
    client = algo.init_client(spec, initial)
    server = algo.init_server(initial)
    heads = [e.key for e in algo.entries if e.is_head]
    for key in heads:
        server.model[key] = server.model[key] + 1.0
    download = algo.download(server)
    load_state(model.state_dict(), algo, download, client.private)
    return client, download, heads


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_every_method_adds_the_guide_to_its_loss_or_refuses_it_in_one_line(name, data_root, style_model):
    algo, model = _adapted(name, data_root, 0.5, **({"style_model": str(style_model)} if name == "ccst" else {}))
    if not algo.downloads_head():
        with pytest.raises(MpiflError, match=rf"^--guide-lambda: {name} keeps the classifier on each client"):
            check_guide(algo)
        return
    check_guide(algo)
    client, download, heads = _client_and_download(algo, model)
    x, y = torch.randn(4, 3, 28, 28), torch.arange(4)
    seen = []

    def loss(hold):
        net = copy.deepcopy(model)
        net.train()
        torch.manual_seed(0)
        algo.begin_local(client, net, download)
        if hold:
            assert algo._global_head is not None, f"{name}.begin_local does not hold the global head (super())"
            assert all(torch.equal(algo._global_head.state_dict()[k.rsplit(".", 1)[1]], download[k]) for k in heads)
            algo._global_head.register_forward_hook(lambda m, i, o: seen.append((i[0], o)))
        else:
            algo.release_global_head()
        torch.manual_seed(1)
        return algo.batch_loss(client, net, x, y)[0]

    difference = loss(True) - loss(False)
    assert len(seen) == 1, f"{name}: the guide ran {len(seen)} times on a mini-batch"
    features, logits = seen[0]
    assert features.shape == (4, model.classifier.in_features) and features.requires_grad
    assert torch.allclose(difference, 0.5 * F.cross_entropy(logits, y), atol=1e-5)


def test_rscs_guide_reads_the_unmasked_features_of_the_extractor(data_root):
    algo, model = _adapted("rsc", data_root, 0.5)
    algo.cfg.algo_options.update(rsc_drop=0.5, rsc_batch=1.0)
    x, y = torch.randn(8, 3, 28, 28), torch.arange(8)
    model.train()
    algo.begin_local(None, model, {})
    seen = []
    algo._global_head.register_forward_hook(lambda m, i, o: seen.append(i[0].detach()))
    _, logits = algo.batch_loss(None, model, x, y)
    unmasked = model.encode(x).detach()
    assert torch.allclose(seen[0], unmasked)
    assert not torch.allclose(logits, model.classifier(unmasked))  # the local head saw masked features


@pytest.mark.slow
def test_a_method_without_a_downloaded_head_refuses_the_guide_before_running(data_root, tmp_path):
    job = run_here("--data-root", str(data_root), "--model", "smallcnn", "--algo", "fedper", "--guide-lambda", "0.5",
                   "--out", str(tmp_path / "run"), "--rounds", "1")
    assert job.returncode != 0
    assert "--guide-lambda: fedper keeps the classifier on each client (it is not in the download)" in job.stderr
    assert "Traceback" not in job.stderr and not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_negative_lambda_is_refused():
    with pytest.raises(MpiflError, match=r"^--guide-lambda must be >= 0 \(0 = off\), got -0.1$"):
        make_algo("fedavg", guide_lambda=-0.1)


def test_gperxan_is_the_guide_on_by_default_and_help_says_so():
    algo, _ = make_algo("gperxan")
    assert algo.guide_lambda == 0.5 and make_algo("fedavg")[0].guide_lambda == 0.0
    assert "[every method; default 0.0, gperxan 0.5]" in " ".join(run_here("--help").stdout.split())


@pytest.mark.slow
def test_two_rounds_of_fedavg_with_the_guide_move_fedavgs_bytes_and_train_otherwise(data_root, tmp_path):
    common = ("--data-root", str(data_root), "--model", "smallcnn", "--algo", "fedavg", "--rounds", "2",
              "--threads", "1", "--lr", "0.05")
    plain = run_here(*common, "--out", str(tmp_path / "plain"))
    guided = run_here(*common, "--guide-lambda", "0.5", "--out", str(tmp_path / "guided"))
    assert plain.returncode == 0 and guided.returncode == 0, guided.stderr
    plain_rounds, guided_rounds = read_metrics(tmp_path / "plain"), read_metrics(tmp_path / "guided")
    assert [r["round"] for r in guided_rounds] == [1, 2]
    assert [r["bytes"] for r in guided_rounds] == [r["bytes"] for r in plain_rounds]
    assert guided_rounds[0]["train"]["loss"] > plain_rounds[0]["train"]["loss"]  # CE + a positive term
    assert guided_rounds[-1]["eval"] != plain_rounds[-1]["eval"]
