"""The server optimizers (Reddi et al., ICLR 2021): each rule against the paper's equations by hand, the wire is
FedAvg's, the server state stays on the server, and bad option values are refused in one line."""

import numpy as np
import pytest
import torch

from mpifl.algorithms import ALGORITHMS
from mpifl.algorithms.core.server_opt import ServerOptimizer
from mpifl.errors import MpiflError

from .helpers import aggregate, make_algo, model_uploads, moved_models

FAMILY = ("fedavg-slr", "fedavgm", "fedadam", "fedyogi", "fedadagrad")
ADAPTIVE = ("fedadam", "fedyogi", "fedadagrad")
BETA1, BETA2, TAU, ETA = 0.8, 0.95, 1e-2, 0.05


def _paper(name):
    """Algorithm 2's m and v updates (Algorithm 1 with server SGD for fedavg-slr, Hsu et al. for fedavgm), from
    Delta = mean - x, and the new x: (x, m, v, Delta) -> (x, m, v)."""
    def adaptive(second):
        def step(x, m, v, d):
            m = BETA1 * m + (1 - BETA1) * d
            v = second(v, d * d)
            return x + ETA * m / (np.sqrt(v) + TAU), m, v
        return step

    return {"fedavg-slr": lambda x, m, v, d: (x + ETA * d, m, v),
            "fedavgm": lambda x, m, v, d: (x - ETA * (BETA1 * m - d), BETA1 * m - d, v),
            "fedadam": adaptive(lambda v, d2: BETA2 * v + (1 - BETA2) * d2),
            "fedyogi": adaptive(lambda v, d2: v - (1 - BETA2) * d2 * np.sign(v - d2)),
            "fedadagrad": adaptive(lambda v, d2: v + d2)}[name]


def _options(name):
    own = {"fedavgm": {"server_momentum": BETA1}, "fedadam": {"beta1": BETA1, "beta2": BETA2, "tau": TAU},
           "fedyogi": {"beta1": BETA1, "beta2": BETA2, "tau": TAU}, "fedadagrad": {"beta1": BETA1, "tau": TAU}}
    return {"server_lr": ETA, **own.get(name, {})}


@pytest.mark.parametrize("name", FAMILY)
def test_three_rounds_of_each_rule_by_hand_from_the_initial_state(name):
    algo, model = make_algo(name, **_options(name))
    server = algo.init_server(model.state_dict())
    params = set(dict(model.named_parameters()))
    x = {k: v.double().numpy() for k, v in server.model.items()}
    m = {k: np.zeros(x[k].shape) for k in params}  # m_{-1} = 0 (FedAvgM: its momentum v)
    v = {k: np.full(x[k].shape, TAU ** 2) for k in params}  # v_{-1} = tau^2
    state = {"fedavgm": {"momentum": m}, "fedadam": {"m": m, "v": v}, "fedyogi": {"m": m, "v": v},
             "fedadagrad": {"m": m, "v": v}}.get(name, {})  # the rule's server state by hand, as m and v go
    rng = np.random.default_rng(3)
    for _ in range(3):
        ups = moved_models(server.model, 2, rng)
        aggregate(algo, server, model_uploads(ups, [10, 30]))
        for k in x:
            mean = 0.25 * ups[0][k] + 0.75 * ups[1][k]
            if k in params:
                x[k], m[k], v[k] = _paper(name)(x[k], m[k], v[k], mean - x[k])
                assert np.abs(x[k] - mean).max() > 1e-3  # a step, not the mean
            else:
                x[k] = mean  # BN running statistics: FedAvg
            np.testing.assert_allclose(server.model[k].numpy(), x[k], rtol=1e-5, atol=1e-6)
        for slot, values in state.items():  # every round's state, not only the last
            for k in params:
                np.testing.assert_allclose(server.extra[algo.slot(slot, k)].numpy(), values[k], rtol=1e-5, atol=1e-7)
    assert set(server.extra) == {algo.slot(s, k) for s in state for k in params}


def test_fedavg_with_the_default_server_lr_is_fedavg_bit_for_bit():
    initial = make_algo("fedavg")[1].state_dict()
    algos = [make_algo(name)[0] for name in ("fedavg-slr", "fedavg")]
    servers = [algo.init_server(initial) for algo in algos]
    rng = np.random.default_rng(0)
    for _ in range(2):
        ups = moved_models(servers[1].model, 3, rng)
        for algo, server in zip(algos, servers):
            aggregate(algo, server, model_uploads(ups, [10, 30, 60]))
    assert all(torch.equal(servers[0].model[k], v) for k, v in servers[1].model.items())


@pytest.mark.parametrize("name", FAMILY)
def test_every_member_is_registered_its_wire_is_fedavgs_and_its_state_is_never_sent(name):
    assert issubclass(ALGORITHMS[name], ServerOptimizer)
    algo, model = make_algo(name)
    avg, _ = make_algo("fedavg")
    for direction in ("download", "upload", "private"):
        assert getattr(algo.policy(), direction) == getattr(avg.policy(), direction)
    server = algo.init_server(model.state_dict())
    assert set(algo.download(server)) == set(server.model)


@pytest.mark.parametrize("name,eta,beta1", [("fedadam", 1e-2, 0.9), ("fedyogi", 1e-2, 0.9), ("fedadagrad", 1e-1, 0.0)])
def test_adaptive_defaults_are_the_authors_and_v_starts_at_tau_squared(name, eta, beta1):
    algo, model = make_algo(name)
    assert (algo.cfg.opt("server_lr"), algo.cfg.opt("beta1"), algo.cfg.opt("tau")) == (eta, beta1, 1e-3)
    assert ("beta2" in algo.cfg.algo_options) == (name != "fedadagrad")  # Adagrad's v has no decay
    if name != "fedadagrad":
        assert algo.cfg.opt("beta2") == 0.99
    server = algo.init_server(model.state_dict())
    for k, p in model.named_parameters():
        assert torch.equal(server.extra[algo.slot("m", k)], torch.zeros_like(p))
        assert torch.equal(server.extra[algo.slot("v", k)], torch.full_like(p, 1e-6))


@pytest.mark.parametrize("name,options,words", [
    *[(n, {"server_lr": 0.0}, "--server-lr must be > 0, got 0.0") for n in FAMILY],
    *[(n, {"tau": t}, f"--tau must be > 0, got {t}") for n in ADAPTIVE for t in (0.0, -1e-3)],
    *[(n, {"beta1": b}, rf"--beta1 must be in \[0, 1\), got {b}") for n in ADAPTIVE for b in (-0.1, 1.0)],
    *[(n, {"beta2": b}, rf"--beta2 must be in \[0, 1\), got {b}") for n in ("fedadam", "fedyogi") for b in (-0.1, 1.0)],
])
def test_an_option_out_of_range_is_refused_in_one_line(name, options, words):
    with pytest.raises(MpiflError, match=f"^{words}$"):
        make_algo(name, **options)
