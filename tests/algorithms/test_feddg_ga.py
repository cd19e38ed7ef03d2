"""FedDG-GA: client weights moved by the generalization gaps, by hand; step decay; clipping; wire; runs."""

import numpy as np
import pytest
import torch

from mpifl.algorithms import Uploads
from mpifl.algorithms.feddg_ga import SCORED_IN, SCORES, WEIGHTS, adjust_weights
from mpifl.client.training import client_round, evaluate, load_state
from mpifl.errors import MpiflError
from mpifl.plan.clients import ClientSpec
from mpifl.rundir.checkpoint import round_dir
from mpifl.rundir.names import SERVER_FILE

from ..conftest import read_metrics, run_here, untimed
from .helpers import aggregate, client_meta, make_algo


def _specs(n, val_rows=4):
    return [ClientSpec(id=i, domain=f"d{i}", rows={"train": np.arange(8), "val": np.arange(val_rows),
                                                   "test": np.arange(4)}) for i in range(n)]


def _algo(cfg_kw=None, n=3, **options):
    algo, model = make_algo("feddg-ga", {"rounds": 10, **(cfg_kw or {})}, **options)
    algo.bind_clients(_specs(n))
    return algo, model


def _uploads(model_state, clients, scores):
    """Client k uploads every model entry filled with k + 1, and its (downloaded, trained) scores."""
    per_client = [{**{key: np.full(v.shape, c + 1.0, dtype=np.float32) for key, v in model_state.items()},
                   SCORES: np.array(s, dtype=np.float64)} for c, s in zip(clients, scores)]
    return Uploads(clients=np.array(clients), meta=client_meta([10] * len(clients)),
                   tensors={k: [u[k] for u in per_client] for k in per_client[0]})


def _aggregate(algo, server, round_index, clients, scores):
    algo.enter_round(round_index)
    aggregate(algo, server, _uploads(server.model, clients, scores))
    return server.extra[WEIGHTS].numpy().copy()


def _model_value(server):
    return float(server.model["classifier.bias"][0])


def test_three_clients_two_adjustments_by_hand():
    """d = 0.3, R = 10, N = 3, loss gaps.  Round 1 keeps a = 1/3 (no gap yet); round 2 uses round 1's
    trained-model scores against the round-2 download's; round 3 likewise."""
    algo, model = _algo(ga_step=0.3, ga_metric="loss")
    server = algo.init_server(model.state_dict())
    a0 = _aggregate(algo, server, 1, [0, 1, 2], [(2.0, 1.0), (2.0, 1.5), (2.0, 0.8)])
    np.testing.assert_array_equal(a0, [1 / 3] * 3)
    assert _model_value(server) == pytest.approx(2.0)  # (1 + 2 + 3) / 3

    a1 = _aggregate(algo, server, 2, [0, 1, 2], [(1.4, 0.9), (1.6, 1.2), (1.6, 1.0)])
    # gaps of round 1: 1.4 - 1.0, 1.6 - 1.5, 1.6 - 0.8 = 0.4, 0.1, 0.8; / max 0.8 = 0.5, 0.125, 1
    # step: d (1 - (1 - 2)/R) / N = 0.3 * 1.1 / 3 = 0.11
    moved = np.array([1 / 3 + 0.055, 1 / 3 + 0.01375, 1 / 3 + 0.11])
    np.testing.assert_allclose(a1, moved / 1.17875, rtol=1e-12)
    np.testing.assert_allclose(a1, [0.329445, 0.294450, 0.376105], atol=1e-6)
    assert _model_value(server) == pytest.approx(float(a1 @ [1, 2, 3]), rel=1e-6)

    a2 = _aggregate(algo, server, 3, [0, 1, 2], [(1.0, 0.5), (1.5, 1.0), (1.1, 0.7)])
    # gaps of round 2: 1.0 - 0.9, 1.5 - 1.2, 1.1 - 1.0 = 0.1, 0.3, 0.1; / max 0.3 = 1/3, 1, 1/3
    # step: 0.3 * (1 - 0/10) / 3 = 0.1
    moved = a1 + 0.1 * np.array([1 / 3, 1, 1 / 3])  # 0.362778, 0.394450, 0.409438; sum 1 + 0.1 * 5/3
    np.testing.assert_allclose(a2, moved / moved.sum(), rtol=1e-12)
    np.testing.assert_allclose(a2, [0.310953, 0.338100, 0.350947], atol=1e-6)
    assert _model_value(server) == pytest.approx(float(a2 @ [1, 2, 3]), rel=1e-6)


def test_accuracy_gaps_are_local_minus_global_and_the_paper_rule_centres_them():
    algo, model = _algo(ga_step=0.3, ga_rule="paper")  # --ga-metric acc
    server = algo.init_server(model.state_dict())
    _aggregate(algo, server, 1, [0, 1, 2], [(0.1, 0.9), (0.1, 0.8), (0.1, 0.6)])
    a1 = _aggregate(algo, server, 2, [0, 1, 2], [(0.5, 0.9), (0.6, 0.9), (0.6, 0.9)])
    # gaps acc(local) - acc(global) = 0.4, 0.2, 0.0; centred 0.2, 0, -0.2; / 0.2 = 1, 0, -1
    # step: d (1 - 1/R) / N = 0.3 * 0.9 / 3 = 0.09; the moves sum to 0, nothing clips: no renormalisation
    np.testing.assert_allclose(a1, [1 / 3 + 0.09, 1 / 3, 1 / 3 - 0.09], rtol=1e-12)


def test_step_decays_linearly_over_the_stored_schedule_rounds_and_stops_at_zero():
    algo, _ = _algo({"rounds": 30, "schedule_rounds": 10}, ga_step=0.3)
    assert [algo.step(q) for q in (1, 2, 7)] == pytest.approx([0.11, 0.1, 0.05])  # d (1 - (q - 2)/10) / 3
    assert algo.step(12) == 0.0 and algo.step(20) == 0.0  # past R: clamped, never negative
    paper, _ = _algo({"rounds": 30, "schedule_rounds": 10}, ga_step=0.3, ga_rule="paper")
    assert [paper.step(q) for q in (1, 5, 10, 15)] == pytest.approx([0.09, 0.05, 0.0, 0.0])  # d (1 - q/10) / 3


def test_clipping_at_zero_then_renormalising():
    weights = np.array([0.02, 0.49, 0.49])
    # -0.08, 0.54, 0.54 -> clipped 0, 0.54, 0.54 -> / 1.08
    out = adjust_weights(weights, np.arange(3), np.array([-1.0, 0.5, 0.5]), 0.1, centre=False)
    np.testing.assert_allclose(out, [0.0, 0.5, 0.5], rtol=1e-12)


def test_equal_gaps():
    weights = np.array([0.5, 0.3, 0.2])
    who = np.arange(3)
    with np.errstate(all="raise"):  # no 0/0
        for gaps, centre in ((np.full(3, 0.7), True), (np.zeros(3), False)):
            np.testing.assert_array_equal(adjust_weights(weights, who, gaps, 0.1, centre), weights)
    # the code's rule does not centre: equal non-zero gaps move every weight by +step, then renormalise
    np.testing.assert_allclose(adjust_weights(weights, who, np.full(3, 0.7), 0.1, centre=False),
                               np.array([0.6, 0.4, 0.3]) / 1.3, rtol=1e-12)


def test_a_step_that_clips_every_weight_to_zero_is_refused_in_one_line():
    with pytest.raises(MpiflError, match="--ga-step"):
        adjust_weights(np.array([0.5, 0.5]), np.arange(2), np.array([-1.0, -1.0]), 0.6, centre=False)


def test_partial_participation_moves_only_clients_that_trained_in_the_previous_round():
    algo, model = _algo(ga_step=0.3, ga_metric="loss")
    server = algo.init_server(model.state_dict())
    _aggregate(algo, server, 1, [0, 1], [(2.0, 1.0), (2.0, 1.0)])
    a1 = _aggregate(algo, server, 2, [1, 2], [(1.5, 1.0), (1.5, 1.0)])
    # only client 1 has a gap (0.5, normalised 1): a_1 = 1/3 + 0.11, then / (1 + 0.11)
    np.testing.assert_allclose(a1, np.array([1 / 3, 1 / 3 + 0.11, 1 / 3]) / 1.11, rtol=1e-12)
    assert _model_value(server) == pytest.approx((a1[1] * 2 + a1[2] * 3) / (a1[1] + a1[2]), rel=1e-6)
    assert server.extra[SCORED_IN].tolist() == [1, 2, 2]
    a2 = _aggregate(algo, server, 3, [0, 1], [(3.0, 1.0), (1.2, 1.0)])
    # client 0's kept score is of round 1, not 2: no gap; client 1: 1.2 - 1.0, normalised 1, step 0.1
    np.testing.assert_allclose(a2, (a1 + [0, 0.1, 0]) / 1.1, rtol=1e-12)


def test_a_held_out_domain_weighs_nothing():
    algo, model = make_algo("feddg-ga")
    specs = _specs(3)
    specs[1] = ClientSpec(id=1, domain="d1", rows=specs[1].rows, trains=False)
    algo.bind_clients(specs)
    np.testing.assert_array_equal(algo.init_server(model.state_dict()).extra[WEIGHTS].numpy(), [0.5, 0.0, 0.5])


def test_a_client_without_validation_rows_is_refused():
    algo, _ = make_algo("feddg-ga")
    with pytest.raises(MpiflError, match="validation split"):
        algo.bind_clients(_specs(2, val_rows=0))


def test_the_wire_is_fedavgs_plus_two_data_derived_scalars_up():
    algo, _ = make_algo("feddg-ga")
    avg, _ = make_algo("fedavg")
    policy, base = algo.policy(), avg.policy()
    assert policy.download == base.download and policy.private == base.private
    assert policy.upload[:-1] == base.upload
    scores = policy.upload[-1]
    assert (scores.name, tuple(scores.shape), scores.dtype) == (SCORES, (2,), torch.float64)
    assert "validation accuracy" in scores.derived
    assert "cross-entropy" in make_algo("feddg-ga", ga_metric="loss")[0].policy().upload[-1].derived


class _Data:
    """One training batch and one validation batch."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def train_batches(self, rng, batch_size):
        return iter([(self.x, self.y)])

    def eval_batches(self, split, batch_size):
        assert split == "val"
        return iter([(self.x, self.y)])

    def size(self, split):
        return len(self.y)


@pytest.mark.parametrize("metric", ["acc", "loss"])
def test_a_client_round_uploads_the_val_score_of_the_download_and_of_the_trained_model(metric):
    torch.manual_seed(0)
    algo, model = make_algo("feddg-ga", {"lr": 0.5}, ga_metric=metric)
    algo.bind_clients(_specs(1))
    data = _Data(torch.randn(16, 3, 28, 28), torch.randint(0, 10, (16,)))
    client = algo.init_client(_specs(1)[0], model.state_dict())
    download = {k: v.clone() for k, v in model.state_dict().items() if k in algo.shared_keys}

    def score():
        loss_sum, correct, count = evaluate(model, data, "val", 512)
        return (correct if metric == "acc" else loss_sum) / count

    slots = model.state_dict()
    load_state(slots, algo, download, client.private)
    before = score()
    upload, _ = client_round(model, slots, algo, client, data, download, 1, algo.cfg)
    after = score()
    assert upload[SCORES].tolist() == [before, after]
    if metric == "loss":
        assert after != before  # the model trained in between


def _run(data_root, out, *extra):
    return run_here("--data-root", str(data_root), "--model", "smallcnn", "--algo", "feddg-ga", "--out", str(out),
                    "--clients-per-domain", "1", "--threads", "1", "--lr", "0.05", "--ga-metric", "loss",
                    "--eval-every", "1", *extra)


def _server_extra(run, round_index):
    return torch.load(round_dir(run, round_index) / SERVER_FILE)["extra"]


@pytest.mark.slow
def test_two_rounds_in_process_move_the_weights(data_root, tmp_path):
    job = _run(data_root, tmp_path / "run", "--rounds", "2", "--ckpt-every", "1")
    assert job.returncode == 0, job.stderr
    records = read_metrics(tmp_path / "run")
    fedavg_up = sum(s.nbytes for s in make_algo("fedavg")[0].policy().upload)
    assert records[0]["bytes"]["up"] == len(records[0]["clients"]) * (fedavg_up + 16)
    extra = _server_extra(tmp_path / "run", 2)
    n = len(records[0]["clients"])
    assert extra[SCORED_IN].tolist() == [2] * n
    weights = extra[WEIGHTS].numpy()
    assert weights.sum() == pytest.approx(1.0) and np.abs(weights - 1 / n).max() > 1e-4  # moved in round 2


@pytest.mark.slow
def test_a_resumed_run_repeats_the_uninterrupted_one_bit_for_bit(data_root, tmp_path):
    full, cut = tmp_path / "full", tmp_path / "cut"
    assert _run(data_root, full, "--rounds", "4", "--ckpt-every", "4").returncode == 0
    first = _run(data_root, cut, "--rounds", "2", "--schedule-rounds", "4", "--ckpt-every", "2")
    assert first.returncode == 0, first.stderr
    resumed = run_here("--resume", str(cut), "--rounds", "4", "--ckpt-every", "4")
    assert resumed.returncode == 0, resumed.stderr
    assert untimed(read_metrics(cut)) == untimed(read_metrics(full))
    for key, value in _server_extra(full, 4).items():
        assert torch.equal(_server_extra(cut, 4)[key], value), key
