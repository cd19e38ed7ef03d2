"""FedDC: drift penalty and gradient correction, drift/last-update state, theta + h up, server rule, wire."""

import math

import numpy as np
import pytest
import torch

from mpifl.algorithms import Uploads
from mpifl.algorithms.core.deltas import local_steps
from mpifl.algorithms.feddc import (CONTROL, CONTROL_DELTA, DRIFT, GLOBAL_CONTROL, GLOBAL_UPDATE, LAST, MEAN_DRIFT,
                                    THETA_PLUS_DRIFT, UPDATE)
from mpifl.errors import MpiflError
from mpifl.models import build_model, state_entries
from mpifl.plan.clients import ClientSpec

from ..conftest import read_metrics
from .helpers import aggregate, client_meta, local_round, make_algo, run_two_rounds


def _spec(cid, n=64):
    return ClientSpec(id=cid, domain="mono", rows={s: np.arange(n) for s in ("train", "val", "test")})


def _download(algo, server):
    return {k: v.clone() for k, v in algo.download(server).items()}


def test_manifest_model_and_global_update_down_theta_plus_drift_and_update_up():
    algo, model = make_algo("feddc", feddc_rule="paper")
    entries = state_entries(model)
    params = [(e.key, e.shape) for e in entries if e.is_param]
    stats = [(e.key, e.shape) for e in entries if e.attr in ("running_mean", "running_var")]
    model_keys = [(e.key, e.shape) for e in entries if e.attr != "num_batches_tracked"]
    policy = algo.policy()
    assert [(s.name, s.shape) for s in policy.download] == model_keys + [(GLOBAL_UPDATE + k, s) for k, s in params]
    assert [(s.name, s.shape) for s in policy.upload] == (
        stats + [(THETA_PLUS_DRIFT + k, s) for k, s in params] + [(UPDATE + k, s) for k, s in params])
    assert [(s.name, s.shape) for s in policy.private] == (
        [(e.key, e.shape) for e in entries if e.attr == "num_batches_tracked"]
        + [(DRIFT + k, s) for k, s in params] + [(LAST + k, s) for k, s in params])
    assert algo.adopted_keys == [] and algo.cfg.opt("alpha") == 0.01


def test_with_alpha_zero_and_no_history_the_local_model_is_fedavgs_and_the_state_is_its_update():
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 3, 16, 16, generator=gen), torch.randint(0, 10, (8,), generator=gen)
    initial = {k: v.clone() for k, v in build_model("smallcnn", num_classes=10).state_dict().items()}
    trained = {}
    for name, options in (("feddc", {"alpha": 0.0, "feddc_rule": "paper"}), ("fedavg", {})):
        algo, model = make_algo(name, {"lr": 0.05, "momentum": 0.9}, **options)
        model.load_state_dict(initial)
        client = algo.init_client(_spec(0), initial)
        local_round(algo, model, client, _download(algo, algo.init_server(initial)), 3, batch=(x, y))
        trained[name] = ({k: v.clone() for k, v in model.state_dict().items()}, client, algo)
    (dc_model, dc_client, dc), (avg_model, _, _) = trained["feddc"], trained["fedavg"]
    for k, v in avg_model.items():
        assert torch.equal(dc_model[k], v), k
    for k in dc.params:  # h_i = g_i = theta_i - w after a first round
        torch.testing.assert_close(dc_client.private[DRIFT + k], avg_model[k] - initial[k])
        torch.testing.assert_close(dc_client.private[LAST + k], avg_model[k] - initial[k])


def test_penalty_correction_and_state_by_hand():
    """One SGD step with a constant loss gradient G: theta = w - eta (G + alpha (w + h - w) + (g_i - g)/(eta K))."""
    alpha, eta, n, batch = 0.3, 0.1, 96, 32
    algo, model = make_algo("feddc", {"lr": eta, "batch_size": batch}, alpha=alpha, feddc_rule="paper")
    k_steps = local_steps(n, batch, 1)
    assert k_steps == 3
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    client = algo.init_client(_spec(0, n), initial)
    gen = torch.Generator().manual_seed(1)
    rand = {k: lambda k=k: torch.randn(initial[k].shape, generator=gen) for k in algo.params}
    grad = {k: rand[k]() for k in algo.params}
    for k in algo.params:
        client.private[DRIFT + k].copy_(rand[k]())
        client.private[LAST + k].copy_(rand[k]())
    h = {k: client.private[DRIFT + k].clone() for k in algo.params}
    g_i = {k: client.private[LAST + k].clone() for k in algo.params}
    download = {**{k: initial[k] for k in algo.shared_keys}, **{GLOBAL_UPDATE + k: rand[k]() for k in algo.params}}
    named = dict(model.named_parameters())
    up = local_round(algo, model, client, download, 1, lambda m: sum((grad[k] * named[k]).sum() for k in algo.params))
    for k in algo.params:
        w = initial[k]
        step = grad[k] + alpha * h[k] + (g_i[k] - download[GLOBAL_UPDATE + k]) / (eta * k_steps)
        theta = w - eta * step
        torch.testing.assert_close(torch.from_numpy(up[UPDATE + k]), theta - w, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(client.private[DRIFT + k], h[k] + theta - w, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(client.private[LAST + k], theta - w, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(torch.from_numpy(up[THETA_PLUS_DRIFT + k]), theta + h[k] + theta - w,
                                   rtol=1e-5, atol=1e-5)


def test_server_rule_by_hand():
    algo, model = make_algo("feddc", feddc_rule="paper")
    server = algo.init_server(model.state_dict())
    rng = np.random.default_rng(2)
    ups = [{**{k: rng.normal(size=v.shape).astype(np.float32) for k, v in server.model.items()
               if k in algo.uploaded_keys},
            **{p + k: rng.normal(size=server.model[k].shape).astype(np.float32)
               for k in algo.params for p in (THETA_PLUS_DRIFT, UPDATE)}} for _ in range(2)]
    aggregate(algo, server, Uploads(clients=np.array([0, 2]), meta=client_meta([10, 30], steps=3),
                                   tensors={k: [u[k] for u in ups] for k in ups[0]}))
    for k in algo.params:
        np.testing.assert_allclose(server.model[k].numpy(),
                                   0.25 * ups[0][THETA_PLUS_DRIFT + k] + 0.75 * ups[1][THETA_PLUS_DRIFT + k],
                                   rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(server.extra[GLOBAL_UPDATE + k].numpy(),
                                   0.25 * ups[0][UPDATE + k] + 0.75 * ups[1][UPDATE + k], rtol=1e-6, atol=1e-7)
    for k in algo.uploaded_keys:  # BN running statistics
        np.testing.assert_allclose(server.model[k].numpy(), 0.25 * ups[0][k] + 0.75 * ups[1][k],
                                   rtol=1e-6, atol=1e-7)
    assert set(algo.download(server)) == set(algo.shared_keys) | {GLOBAL_UPDATE + k for k in algo.params}


def test_unsampled_clients_keep_their_drift():
    algo, model = make_algo("feddc", {"lr": 0.05})
    algo.bind_clients([_spec(i) for i in range(3)])
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    server = algo.init_server(initial)
    clients = [algo.init_client(_spec(i), initial) for i in range(3)]
    target = [torch.ones_like(p) for p in model.parameters()]

    def quadratic(m):
        return sum(((p - t) ** 2).sum() for p, t in zip(m.parameters(), target))

    for sampled in ([0, 1], [1]):
        before = [{k: v.clone() for k, v in c.private.items()} for c in clients]
        download = _download(algo, server)
        ups = [local_round(algo, model, clients[i], download, 2, quadratic) for i in sampled]
        meta = client_meta([64] * len(sampled), steps=2)
        aggregate(algo, server, Uploads(clients=np.array(sampled), meta=meta,
                                       tensors={k: [u[k] for u in ups] for k in ups[0]}))
        for i in set(range(3)) - set(sampled):
            assert all(torch.equal(clients[i].private[k], before[i][k]) for k in before[i])
    assert clients[0].private[DRIFT + "conv1.weight"].abs().max() > 0
    assert not any(v.any() for k, v in clients[2].private.items() if k.startswith(DRIFT))  # never sampled


def test_code_rule_manifest_theta_and_control_delta_up_control_down():
    algo, model = make_algo("feddc")
    assert algo.cfg.opt("feddc_rule") == "code"
    entries = state_entries(model)
    params = [(e.key, e.shape) for e in entries if e.is_param]
    model_keys = [(e.key, e.shape) for e in entries if e.attr != "num_batches_tracked"]
    policy = algo.policy()
    assert [(s.name, s.shape) for s in policy.download] == model_keys + [(GLOBAL_CONTROL + k, s) for k, s in params]
    assert [(s.name, s.shape) for s in policy.upload] == model_keys + [(CONTROL_DELTA + k, s) for k, s in params]
    assert [(s.name, s.shape) for s in policy.private][-2 * len(params):] == (
        [(DRIFT + k, s) for k, s in params] + [(CONTROL + k, s) for k, s in params])


def test_code_rule_server_adds_the_mean_drift_of_all_clients_by_hand():
    """N = 4 clients of 10, 30, 20, 20 samples (n_bar 20): w = (1/2, 3/2, 1, 1), q = w / 4; clients 0 and 1 upload."""
    algo, model = make_algo("feddc")
    algo.bind_clients([_spec(i, n) for i, n in enumerate((10, 30, 20, 20))])
    server = algo.init_server(model.state_dict())
    rng = np.random.default_rng(3)
    for k in algo.params:
        for prefix in (MEAN_DRIFT, GLOBAL_CONTROL):
            server.extra[prefix + k] = torch.from_numpy(rng.normal(size=server.model[k].shape).astype(np.float32))
    w = {k: v.double().numpy() for k, v in server.model.items()}
    before = {k: v.double().numpy() for k, v in server.extra.items()}
    ups = [{**{k: rng.normal(size=v.shape).astype(np.float32) for k, v in server.model.items()},
            **{CONTROL_DELTA + k: rng.normal(size=server.model[k].shape).astype(np.float32) for k in algo.params}}
           for _ in range(2)]
    aggregate(algo, server, Uploads(clients=np.array([0, 1]), meta=client_meta([10, 30]),
                                   tensors={k: [u[k] for u in ups] for k in ups[0]}))
    q = (0.5 / 4, 1.5 / 4)
    for k in algo.params:
        drift = before[MEAN_DRIFT + k] + q[0] * (ups[0][k] - w[k]) + q[1] * (ups[1][k] - w[k])
        np.testing.assert_allclose(server.extra[MEAN_DRIFT + k].numpy(), drift, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(server.model[k].numpy(), 0.25 * ups[0][k] + 0.75 * ups[1][k] + drift,
                                   rtol=1e-5, atol=1e-5)
        control = before[GLOBAL_CONTROL + k] + q[0] * ups[0][CONTROL_DELTA + k] + q[1] * ups[1][CONTROL_DELTA + k]
        np.testing.assert_allclose(server.extra[GLOBAL_CONTROL + k].numpy(), control, rtol=1e-5, atol=1e-5)
    assert set(algo.download(server)) == set(algo.shared_keys) | {GLOBAL_CONTROL + k for k in algo.params}


@pytest.mark.parametrize("momentum, a_k", [(0.0, 3.0), (0.5, 4.25)])
def test_code_rule_client_step_and_variates_by_hand(momentum, a_k):
    """n = 48 of n_bar 64 (w = 3/4), B = 16, K = 3 steps; a_K = [K - rho (1 - rho^K) / (1 - rho)] / (1 - rho).
    One step with a constant loss gradient G: theta = w - eta (G + alpha/w_i h + c/w_i - c_i);
    c_i <- c_i - c/w_i - (theta - w) / (eta a_K)."""
    alpha, eta, n, weight = 0.3, 0.1, 48, 0.75
    algo, model = make_algo("feddc", {"lr": eta, "batch_size": 16, "momentum": momentum}, alpha=alpha)
    algo.bind_clients([_spec(0, 48), _spec(1, 80)])
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    client = algo.init_client(_spec(0, n), initial)
    gen = torch.Generator().manual_seed(4)
    rand = {k: lambda k=k: torch.randn(initial[k].shape, generator=gen) for k in algo.params}
    grad = {k: rand[k]() for k in algo.params}
    for k in algo.params:
        client.private[DRIFT + k].copy_(rand[k]())
        client.private[CONTROL + k].copy_(rand[k]())
    h = {k: client.private[DRIFT + k].clone() for k in algo.params}
    c_i = {k: client.private[CONTROL + k].clone() for k in algo.params}
    download = {**{k: initial[k] for k in algo.shared_keys}, **{GLOBAL_CONTROL + k: rand[k]() for k in algo.params}}
    named = dict(model.named_parameters())
    up = local_round(algo, model, client, download, 1, lambda m: sum((grad[k] * named[k]).sum() for k in algo.params))
    for k in algo.params:
        c = download[GLOBAL_CONTROL + k]
        theta = initial[k] - eta * (grad[k] + alpha / weight * h[k] + c / weight - c_i[k])
        new_c = c_i[k] - c / weight - (theta - initial[k]) / (eta * a_k)
        torch.testing.assert_close(torch.from_numpy(up[k]), theta, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(client.private[DRIFT + k], h[k] + theta - initial[k], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(client.private[CONTROL + k], new_c, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(torch.from_numpy(up[CONTROL_DELTA + k]), new_c - c_i[k], rtol=1e-4, atol=1e-4)


def test_paper_rule_momentum_scales_the_correction_by_a_k():
    """--momentum 0.5, K = 3: (g_i - g) / (eta a_K) with a_K = 4.25, not K = 3 (no drift, theta at w)."""
    algo, model = make_algo("feddc", {"lr": 0.1, "batch_size": 16, "momentum": 0.5}, feddc_rule="paper")
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    client = algo.init_client(_spec(0, 48), initial)
    for k in algo.params:
        client.private[LAST + k].fill_(1.0)
    download = {**initial, **{GLOBAL_UPDATE + k: torch.zeros_like(initial[k]) for k in algo.params}}
    algo.begin_local(client, model, download)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    algo.after_backward(client, model)
    for p in model.parameters():
        torch.testing.assert_close(p.grad, torch.full_like(p, 1.0 / (0.1 * 4.25)))


def test_bad_rule():
    with pytest.raises(MpiflError, match="--feddc-rule must be one of code, paper"):
        make_algo("feddc", feddc_rule="cvpr")


@pytest.mark.slow
def test_two_rounds_over_mpi(data_root, tmp_path):
    run = tmp_path / "feddc"
    run_two_rounds(data_root, run, "feddc")
    entries = state_entries(build_model("smallcnn", num_classes=10))
    params = sum(e.nbytes for e in entries if e.is_param)
    stats = sum(e.nbytes for e in entries if e.attr in ("running_mean", "running_var"))
    records = read_metrics(run)
    assert [r["round"] for r in records] == [1, 2]
    for record in records:
        assert len(record["clients"]) == 5
        assert record["bytes"]["down"] == 5 * (2 * params + stats)  # w (model) + g
        assert record["bytes"]["up"] == 5 * (2 * params + stats)  # theta + h, Delta theta, BN statistics
        assert math.isfinite(record["train"]["loss"])


def test_a_negative_drift_penalty_is_refused_in_one_line():
    with pytest.raises(MpiflError, match=r"^--alpha must be >= 0, got -0.5$"):
        make_algo("feddc", alpha=-0.5)
