"""FedAvgM: server momentum on the averaged update; FedAvg at beta = 0, eta_s = 1; wire unchanged."""

import numpy as np
import pytest
import torch

from mpifl.errors import MpiflError

from ..conftest import read_metrics
from .helpers import aggregate, make_algo, model_uploads, moved_models, run_two_rounds


def test_wire_is_fedavgs_and_the_momentum_stays_on_the_server():
    algo, model = make_algo("fedavgm")
    avg, _ = make_algo("fedavg")
    for direction in ("download", "upload", "private"):
        assert getattr(algo.policy(), direction) == getattr(avg.policy(), direction)
    server = algo.init_server(model.state_dict())
    params = {n: p.shape for n, p in model.named_parameters()}
    assert {k: v.shape for k, v in server.extra.items()} == {algo.slot("momentum", k): s for k, s in params.items()}
    assert set(algo.download(server)) == set(server.model)  # v is never sent
    assert algo.cfg.opt("server_momentum") == 0.9 and algo.cfg.opt("server_lr") == 1.0  # FedRDN A.2


def test_without_momentum_and_unit_server_lr_fedavgm_is_fedavg():
    rng = np.random.default_rng(0)
    initial = make_algo("fedavg")[1].state_dict()
    servers = {}
    for name, options in (("fedavgm", {"server_momentum": 0.0, "server_lr": 1.0}), ("fedavg", {})):
        algo, _ = make_algo(name, **options)
        servers[name] = (algo, algo.init_server(initial))
    for _ in range(3):  # several rounds: no state may build up
        ups = moved_models(servers["fedavg"][1].model, 3, rng)
        for algo, server in servers.values():
            aggregate(algo, server, model_uploads(ups, [10, 30, 60]))
    for k, v in servers["fedavg"][1].model.items():
        torch.testing.assert_close(servers["fedavgm"][1].model[k], v, rtol=0, atol=2e-7)


def _losses(record):
    return [d["loss"] for split in ("val", "test") for d in record["eval"]["global"][split]["domains"].values()]


@pytest.mark.slow
def test_over_mpi_momentum_acts_from_the_second_round(data_root, tmp_path):
    """Round 1: v = Delta, so x - v is FedAvg's average; round 2 adds beta v and differs from FedAvg."""
    records = {}
    for algo in ("fedavgm", "fedavg"):
        run_two_rounds(data_root, tmp_path / algo, algo)
        records[algo] = read_metrics(tmp_path / algo)
    (m1, m2), (a1, a2) = records["fedavgm"], records["fedavg"]
    assert m1["clients"] == a1["clients"] and m2["clients"] == a2["clients"] and len(m1["clients"]) == 5
    assert m1["bytes"] == a1["bytes"]  # the same wire
    np.testing.assert_allclose(_losses(m1), _losses(a1), rtol=1e-6)
    assert np.abs(np.array(_losses(m2)) - np.array(_losses(a2))).max() > 1e-4


@pytest.mark.parametrize("options,words", [
    ({"server_lr": -1.0}, "--server-lr must be > 0, got -1.0"),
    ({"server_lr": 0.0}, "--server-lr must be > 0, got 0.0"),
    ({"server_momentum": -0.1}, r"--server-momentum must be in \[0, 1\), got -0.1"),
    ({"server_momentum": 1.0}, r"--server-momentum must be in \[0, 1\), got 1.0"),
])
def test_a_server_step_or_momentum_out_of_range_is_refused_in_one_line(options, words):
    with pytest.raises(MpiflError, match=f"^{words}$"):
        make_algo("fedavgm", **options)
