"""FedNova: updates normalized by local step counts; FedAvg when steps are equal; the runtime's step counts."""

import numpy as np
import pytest
import torch

from mpifl.algorithms import Uploads
from mpifl.algorithms.core.deltas import local_steps, solver_norm
from mpifl.client.client_data import load_client_data
from mpifl.client.training import train_local
from mpifl.data import ensure_dataset
from mpifl.plan.config import RunConfig
from mpifl.plan.seeding import client_rng
from mpifl.session.session import make_session, read_labels

from ..conftest import read_metrics, run_here
from .helpers import aggregate, client_meta, make_algo


def _uploads(per_client, samples, steps):
    return Uploads(clients=np.arange(len(samples)),
                   meta=client_meta(samples, steps),
                   tensors={k: [u[k] for u in per_client] for k in per_client[0]})


def _client_models(server, n, seed):
    rng = np.random.default_rng(seed)
    return [{k: (v.numpy() + rng.normal(0, 0.1, v.shape)).astype(np.float32) for k, v in server.model.items()}
            for _ in range(n)]


def test_manifest_is_fedavgs():
    nova, _ = make_algo("fednova")
    avg, _ = make_algo("fedavg")
    for direction in ("download", "upload", "private"):
        assert getattr(nova.policy(), direction) == getattr(avg.policy(), direction)


def test_solver_norm_is_how_far_momentum_sgd_moves_per_unit_gradient():
    for rho in (0.0, 0.5, 0.9):
        for tau in (1, 3, 7):
            by_hand = sum((1 - rho ** t) / (1 - rho) for t in range(1, tau + 1)) if rho else tau
            p = torch.zeros(1, requires_grad=True)
            opt = torch.optim.SGD([p], lr=1.0, momentum=rho)
            for _ in range(tau):
                p.grad = torch.ones(1)
                opt.step()
            assert abs(float(solver_norm(tau, rho)) - by_hand) < 1e-12
            assert abs(-float(p.detach()) - by_hand) < 1e-5
    assert np.allclose(solver_norm(np.array([2.0, 4.0]), 0.5), [2.5, 6.125])


def test_with_equal_steps_fednova_is_fedavg_with_or_without_momentum():
    initial = make_algo("fedavg")[1].state_dict()
    for momentum in (0.0, 0.9):
        results = []
        for name in ("fednova", "fedavg"):
            algo, _ = make_algo(name, {"momentum": momentum})
            server = algo.init_server(initial)
            aggregate(algo, server, _uploads(_client_models(server, 3, seed=1), [10, 30, 60], [5, 5, 5]))
            results.append(server.model)
        for k, v in results[1].items():
            torch.testing.assert_close(results[0][k], v, rtol=0, atol=2e-7)


def test_unequal_steps_by_hand_and_unlike_fedavg():
    for momentum in (0.0, 0.5):
        algo, model = make_algo("fednova", {"momentum": momentum})
        server = algo.init_server(model.state_dict())
        x = {k: v.double().numpy() for k, v in server.model.items()}
        ups = _client_models(server, 2, seed=2)
        aggregate(algo, server, _uploads(ups, [100, 300], [2, 6]))
        p = np.array([0.25, 0.75])
        a = np.array([2.0, 6.0])
        if momentum:  # a_tau = [tau - rho (1 - rho^tau) / (1 - rho)] / (1 - rho), by hand for rho = 0.5
            a = np.array([(2 - 0.5 * (1 - 0.25) / 0.5) / 0.5, (6 - 0.5 * (1 - 0.5 ** 6) / 0.5) / 0.5])
        tau_eff = (p * a).sum()
        for k, value in server.model.items():
            fedavg = p[0] * ups[0][k] + p[1] * ups[1][k]
            if k.endswith(("running_mean", "running_var")):
                np.testing.assert_allclose(value.numpy(), fedavg, rtol=1e-6, atol=1e-7)  # buffers: FedAvg
                continue
            d = sum(p[i] * (x[k] - ups[i][k]) / a[i] for i in range(2))
            np.testing.assert_allclose(value.numpy(), x[k] - tau_eff * d, rtol=1e-6, atol=1e-7)
            assert np.abs(value.numpy() - fedavg).max() > 1e-3


def test_the_runtime_takes_more_steps_on_larger_clients(data_root):
    cfg = RunConfig(data_root=str(data_root), model="smallcnn", clients_per_domain=2, dirichlet=0.5, batch_size=64,
                    algo="fednova", algo_options={"uniform_weights": False})
    manifest = ensure_dataset(data_root, "styledigits")
    session = make_session(cfg, manifest, 1, labels=read_labels(cfg, manifest))
    by_size = sorted(session.clients, key=lambda c: c.num_train)
    specs = [by_size[0], by_size[-1]]
    data = load_client_data(data_root, manifest, specs, torch.device("cpu"))
    model, steps = session.build_model(), []
    for spec in specs:
        client = session.algo.init_client(spec, session.initial)
        stats = train_local(model, session.algo, client, data[spec.id], session.algo.make_optimizer(model, cfg.lr),
                            1, cfg.batch_size, client_rng(cfg.seed, spec.id, 1), 1)
        assert stats.steps == local_steps(spec.num_train, cfg.batch_size, 1)
        steps.append(stats.steps)
    assert steps[0] < steps[1], steps


def _args(data_root, out, algo, rounds):
    return ["--data-root", str(data_root), "--model", "smallcnn", "--out", str(out), "--algo", algo, "--rounds", rounds,
            "--fraction", "0.5", "--clients-per-domain", "2", "--dirichlet", "0.5", "--momentum", "0", "--lr", "0.05",
            "--threads", "1"]


@pytest.mark.slow
def test_in_a_real_run_fednova_differs_from_fedavg_when_steps_differ(data_root, tmp_path):
    cfg = RunConfig(data_root=str(data_root), model="smallcnn", clients_per_domain=2, dirichlet=0.5, fraction=0.5,
                    algo="fednova", algo_options={"uniform_weights": False})
    manifest = ensure_dataset(data_root, "styledigits")
    session = make_session(cfg, manifest, 2, labels=read_labels(cfg, manifest))
    steps = {local_steps(session.clients[c].num_train, cfg.batch_size, 1) for c in session.sampled(1)}
    assert len(steps) > 1, steps  # the round's clients take different numbers of local steps
    records = {}
    for algo, rounds in (("fednova", "2"), ("fedavg", "1")):  # FedAvg: round 1 is enough to compare
        job = run_here(*_args(data_root, tmp_path / algo, algo, rounds))
        assert job.returncode == 0, job.stderr
        records[algo] = read_metrics(tmp_path / algo)
    nova, avg = records["fednova"], records["fedavg"]
    assert len(nova) == 2 and all(len(r["clients"]) == 5 for r in nova) and nova[0]["clients"] == avg[0]["clients"]
    assert nova[0]["train"] == avg[0]["train"]  # round 1 trains from the same model
    assert nova[0]["eval"]["global"]["val"]["mean"]["loss"] != avg[0]["eval"]["global"]["val"]["mean"]["loss"]
