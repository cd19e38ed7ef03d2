"""SCAFFOLD: corrected local steps, option II variates, server rule, partial participation, wire."""

import math

import numpy as np
import pytest
import torch

from mpifl.algorithms import Uploads
from mpifl.algorithms.scaffold import C_GLOBAL, C_LOCAL, DELTA_C
from mpifl.errors import MpiflError
from mpifl.plan.clients import ClientSpec
from mpifl.models import build_model, state_entries

from ..conftest import read_metrics
from .helpers import aggregate, client_meta, local_round, make_algo, run_two_rounds


def _spec(cid, n=64):
    return ClientSpec(id=cid, domain="mono", rows={s: np.arange(n) for s in ("train", "val", "test")})


def _scaffold(cfg_kw=None, n_clients=5, **options):
    algo, model = make_algo("scaffold", cfg_kw, **options)
    algo.bind_clients([_spec(i) for i in range(n_clients)])
    return algo, model


def _uploads(per_client, clients, samples, steps):
    return Uploads(clients=np.array(clients), meta=client_meta(samples, steps),
                   tensors={name: [u[name] for u in per_client] for name in per_client[0]})


def test_manifest_lists_model_and_variates():
    algo, model = _scaffold()
    entries = state_entries(model)
    params = [(e.key, e.shape) for e in entries if e.is_param]
    model_keys = [(e.key, e.shape) for e in entries if e.attr != "num_batches_tracked"]
    policy = algo.policy()
    assert [(s.name, s.shape) for s in policy.download] == model_keys + [(C_GLOBAL + k, s) for k, s in params]
    assert [(s.name, s.shape) for s in policy.upload] == model_keys + [(DELTA_C + k, s) for k, s in params]
    assert [(s.name, s.shape) for s in policy.private] == (
        [(e.key, e.shape) for e in entries if e.attr == "num_batches_tracked"] + [(C_LOCAL + k, s) for k, s in params])
    assert len(params) == 14 and not any("running" in k for k, _ in params)  # no variate for BN statistics


def test_with_zero_variates_scaffold_trains_and_aggregates_as_fedavg():
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 3, 16, 16, generator=gen), torch.randint(0, 10, (8,), generator=gen)
    initial = {k: v.clone() for k, v in build_model("smallcnn", num_classes=10).state_dict().items()}
    results = {}
    for name in ("scaffold", "fedavg"):
        algo, model = make_algo(name, {"lr": 0.05, "momentum": 0.9})
        algo.bind_clients([_spec(i) for i in range(5)])
        model.load_state_dict(initial)
        server = algo.init_server(initial)
        client = algo.init_client(_spec(0), initial)
        up = local_round(algo, model, client, algo.download(server), 3, batch=(x, y))
        other = {k: np.asarray(v) * 0.5 for k, v in up.items()}
        aggregate(algo, server, _uploads([up, other], [0, 1], [10, 30], [3, 3]))
        results[name] = (up, server.model)
    (sc_up, sc_model), (fa_up, fa_model) = results["scaffold"], results["fedavg"]
    for k, v in fa_up.items():
        assert np.array_equal(sc_up[k], v), k  # same trained model, bit for bit
    for k, v in fa_model.items():
        assert torch.equal(sc_model[k], v), k
    assert np.abs(sc_up[DELTA_C + "conv1.weight"]).max() > 0  # while the variates moved


def test_corrected_steps_and_option_ii_by_hand():
    """Constant gradient G: y = x - eta a_K (G + c - c_i) and option II gives c_i+ = G exactly."""
    for rho, steps, a_k in ((0.0, 3, 3.0), (0.9, 2, 2.9)):  # a_2 = 2 + rho for momentum SGD
        algo, model = _scaffold({"lr": 0.1, "momentum": rho})
        initial = {k: v.clone() for k, v in model.state_dict().items()}
        client = algo.init_client(_spec(0), initial)
        gen = torch.Generator().manual_seed(1)
        names = algo.params
        grad = {k: torch.randn(initial[k].shape, generator=gen) for k in names}
        for k in names:
            client.private[C_LOCAL + k].copy_(torch.randn(initial[k].shape, generator=gen))
        download = {**{k: initial[k] for k in algo.shared_keys},
                    **{C_GLOBAL + k: torch.randn(initial[k].shape, generator=gen) for k in names}}
        c_i = {k: client.private[C_LOCAL + k].clone() for k in names}
        named = dict(model.named_parameters())
        def loss(m, grad=grad, named=named, names=names):
            return sum((grad[k] * named[k]).sum() for k in names)

        up = local_round(algo, model, client, download, steps, loss)
        for k in names:
            corrected = grad[k] + download[C_GLOBAL + k] - c_i[k]
            expected_y = initial[k] - 0.1 * a_k * corrected
            torch.testing.assert_close(torch.from_numpy(up[k]), expected_y, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(torch.from_numpy(up[DELTA_C + k]), grad[k] - c_i[k], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(client.private[C_LOCAL + k], grad[k], rtol=1e-4, atol=1e-4)


def test_server_rule_by_hand():
    algo, model = _scaffold(n_clients=5, server_lr=0.5)
    server = algo.init_server(model.state_dict())
    rng = np.random.default_rng(2)
    for k in algo.params:
        server.extra[C_GLOBAL + k] = torch.from_numpy(rng.normal(size=server.model[k].shape).astype(np.float32))
    x = {k: v.double().numpy() for k, v in server.model.items()}
    c = {k: v.double().numpy() for k, v in server.extra.items()}
    ups = [{**{k: rng.normal(size=v.shape).astype(np.float32) for k, v in server.model.items()},
            **{DELTA_C + k: rng.normal(size=server.model[k].shape).astype(np.float32) for k in algo.params}}
           for _ in range(2)]
    aggregate(algo, server, _uploads(ups, [1, 4], [10, 30], [5, 5]))
    for k in server.model:
        mean = 0.25 * ups[0][k] + 0.75 * ups[1][k]
        expected = x[k] + 0.5 * (mean - x[k]) if k in algo.params else mean  # BN statistics: plain FedAvg
        np.testing.assert_allclose(server.model[k].numpy(), expected, rtol=1e-6, atol=1e-6)
    for k in algo.params:
        expected = c[C_GLOBAL + k] + (ups[0][DELTA_C + k] + ups[1][DELTA_C + k]) / 5  # (|S|/N) mean
        np.testing.assert_allclose(server.extra[C_GLOBAL + k].numpy(), expected, rtol=1e-6, atol=1e-6)


def test_partial_participation_keeps_unsampled_variates_and_c_stays_their_mean():
    algo, model = _scaffold({"lr": 0.05}, n_clients=4)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    server = algo.init_server(initial)
    clients = [algo.init_client(_spec(i), initial) for i in range(4)]
    gen = torch.Generator().manual_seed(3)
    targets = [[torch.randn(p.shape, generator=gen) for p in model.parameters()] for _ in range(4)]
    for sampled in ([0, 1], [1, 3], [1]):
        before = [{k: v.clone() for k, v in c.private.items()} for c in clients]
        download = {k: v.clone() for k, v in algo.download(server).items()}
        ups = [local_round(algo, model, clients[i], download, 2 + i,
                           lambda m, t=targets[i]: sum(((p - q) ** 2).sum() for p, q in zip(m.parameters(), t)))
               for i in sampled]
        aggregate(algo, server, _uploads(ups, sampled, [64] * len(sampled), [2 + i for i in sampled]))
        for i in set(range(4)) - set(sampled):
            assert all(torch.equal(clients[i].private[k], before[i][k]) for k in before[i])
        for k in algo.params:
            everyone = sum(c.private[C_LOCAL + k] for c in clients) / 4
            torch.testing.assert_close(server.extra[C_GLOBAL + k], everyone, rtol=1e-5, atol=1e-6)
    assert all(not v.any() for k, v in clients[2].private.items() if k.startswith(C_LOCAL))  # never sampled
    assert all(clients[1].private[C_LOCAL + k].abs().max() > 0 for k in algo.params)


@pytest.mark.slow
def test_two_rounds_over_mpi_carry_the_variates(data_root, tmp_path):
    run = tmp_path / "scaffold"
    run_two_rounds(data_root, run, "scaffold")
    entries = state_entries(build_model("smallcnn", num_classes=10))
    params = sum(e.nbytes for e in entries if e.is_param)
    stats = sum(e.nbytes for e in entries if e.attr in ("running_mean", "running_var"))
    records = read_metrics(run)
    assert [r["round"] for r in records] == [1, 2]
    for record in records:
        assert len(record["clients"]) == 5  # 10 clients, fraction 0.5
        assert record["bytes"]["down"] == record["bytes"]["up"] == 5 * (2 * params + stats)  # model + c / Delta c
        assert math.isfinite(record["train"]["loss"])


@pytest.mark.parametrize("server_lr", [-1.0, 0.0])
def test_a_server_learning_rate_not_above_zero_is_refused_in_one_line(server_lr):
    with pytest.raises(MpiflError, match=f"^--server-lr must be > 0, got {server_lr}$"):
        make_algo("scaffold", server_lr=server_lr)
