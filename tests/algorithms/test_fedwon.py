"""FedWon: no norm layer, WSConv, FedAvg sharing, AGC (eq. 4) with the paper's thresholds."""

from functools import partial

import numpy as np
import pytest
import torch
from torch import nn

from mpifl.algorithms import Uploads
from mpifl.algorithms.fedwon import auto_agc_clip
from mpifl.plan.config import RunConfig
from mpifl.errors import MpiflError
from mpifl.models import WSConv2d, adaptive_clip_, state_entries

from .helpers import aggregate, client_meta, make_algo


_algo = partial(make_algo, "fedwon")


def test_model_has_no_norm_and_ws_convs_and_everything_is_shared():
    algo, model = _algo()
    entries = state_entries(model)
    assert not any(e.is_norm for e in entries)
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    assert convs and all(isinstance(m, WSConv2d) for m in convs)
    assert "conv1.gain" in model.state_dict()
    policy = algo.policy()
    names = set(model.state_dict())
    assert {s.name for s in policy.download} == names == {s.name for s in policy.upload}
    assert policy.private == [] and algo.evaluates == ("global",)


@pytest.mark.parametrize("data,batch,expected", [
    ("styledigits", 32, 0.64), ("digits", 64, 0.64), ("office_caltech", 32, 1.28), ("domainnet10", 32, 1.28),
    ("styledigits", 31, 0.0), ("office_caltech", 4, 0.0), ("digits", 1, 0.0)])
def test_auto_threshold_follows_the_paper(data, batch, expected):
    cfg = RunConfig(data=data, batch_size=batch, algo_options={"agc_clip": None})
    assert auto_agc_clip(cfg) == expected
    algo, _ = _algo({"data": data, "batch_size": batch})
    assert algo.agc_clip == expected


def test_explicit_threshold_wins_and_zero_or_negative():
    assert _algo({"batch_size": 1}, agc_clip=0.5)[0].agc_clip == 0.5
    assert _algo({"batch_size": 32}, agc_clip=0.0)[0].agc_clip == 0.0
    with pytest.raises(MpiflError, match="agc-clip"):
        _algo(agc_clip=-1.0)


def _grads(model, scale):
    torch.manual_seed(1)
    for p in model.parameters():
        p.grad = scale * torch.randn_like(p)


def test_after_backward_is_adaptive_clip_except_the_classifier():
    algo, model = _algo({"batch_size": 32, "data": "styledigits"})
    _grads(model, 5.0)  # large enough that most rows are clipped
    original = {n: p.grad.clone() for n, p in model.named_parameters()}
    body = [p.detach().clone().requires_grad_() for n, p in model.named_parameters()
            if not n.startswith("classifier.")]
    for q, (n, _) in zip(body, [(n, p) for n, p in model.named_parameters() if not n.startswith("classifier.")]):
        q.grad = original[n].clone()
    adaptive_clip_(body, 0.64)  # the reference: eq. (4) at Digits' lambda on every non-classifier tensor
    algo.after_backward(None, model)
    expected = iter(body)
    for name, p in model.named_parameters():
        if name.startswith("classifier."):
            assert torch.equal(p.grad, original[name]), name  # never touched
        else:
            assert torch.equal(p.grad, next(expected).grad), name
    assert not torch.equal(model.conv2.weight.grad, original["conv2.weight"])  # clipping happened
    w = model.conv2.weight
    ratio = w.grad.flatten(1).norm(dim=1) / w.detach().flatten(1).norm(dim=1).clamp(min=1e-3)
    assert float(ratio.max()) <= 0.64 * (1 + 1e-5)


def test_no_clipping_when_off():
    algo, model = _algo({"batch_size": 2})
    _grads(model, 5.0)
    before = [p.grad.clone() for p in model.parameters()]
    algo.after_backward(None, model)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), before))


def test_batch_of_one_trains():
    algo, model = _algo({"batch_size": 1}, agc_clip=1.28)
    x, y = torch.randn(1, 3, 8, 8), torch.tensor([3])
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    algo.after_backward(None, model)
    with torch.no_grad():
        for p in model.parameters():
            p.sub_(0.01 * p.grad)
    assert torch.isfinite(model(x)).all()


def test_aggregate_is_the_weighted_mean_of_everything():
    algo, model = _algo()
    server = algo.init_server(model.state_dict())
    uploads = {k: [np.full(v.shape, 1.0, np.float32), np.full(v.shape, 5.0, np.float32)]
               for k, v in server.model.items()}
    aggregate(algo, server, Uploads(clients=np.arange(2), meta=client_meta([10, 30]),
                                   tensors=uploads))
    for tensor in server.model.values():
        torch.testing.assert_close(tensor, torch.full_like(tensor, 4.0))
