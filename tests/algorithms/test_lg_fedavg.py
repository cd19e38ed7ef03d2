"""LG-FedAvg: the last N layers are global (averaged), the rest of each model stays on its client."""

import numpy as np
import pytest
import torch

from mpifl.algorithms import Uploads
from mpifl.algorithms.lg_fedavg import layer_modules
from mpifl.errors import MpiflError

from ..conftest import read_metrics
from .helpers import client_meta, make_algo, run_two_rounds

SMALLCNN_LAYERS = ["conv1", "norm1", "conv2", "norm2", "conv3", "norm3", "classifier"]


def _uploads(tensors, samples):
    return Uploads(clients=np.arange(len(samples)), meta=client_meta(samples),
                   tensors=tensors)


def test_layers_are_parametrized_modules_in_state_dict_order():
    algo, _ = make_algo("lg-fedavg")
    assert layer_modules(algo.entries) == SMALLCNN_LAYERS


def test_default_shares_only_the_classifier_and_keeps_the_rest_private():
    algo, model = make_algo("lg-fedavg")
    policy = algo.policy()
    assert [(s.name, s.shape) for s in policy.download] == [("classifier.weight", (10, 64)), ("classifier.bias", (10,))]
    assert [(s.name, s.shape) for s in policy.upload] == [("classifier.weight", (10, 64)), ("classifier.bias", (10,))]
    assert {s.name for s in policy.private} == set(model.state_dict()) - {"classifier.weight", "classifier.bias"}
    assert algo.evaluates == ("personal",)


def test_three_global_layers_include_a_norm_with_its_statistics_but_not_its_step_counter():
    algo, _ = make_algo("lg-fedavg", lg_global_layers=3)
    assert algo.shared_keys == ["conv3.weight", "conv3.bias", "norm3.weight", "norm3.bias", "norm3.running_mean",
                                "norm3.running_var", "classifier.weight", "classifier.bias"]
    assert "norm3.num_batches_tracked" in algo.private_keys and "conv2.weight" in algo.private_keys


def test_all_layers_global_is_fedavg():
    lg, _ = make_algo("lg-fedavg", lg_global_layers=len(SMALLCNN_LAYERS))
    fedavg, _ = make_algo("fedavg")
    assert lg.policy() == fedavg.policy()


@pytest.mark.parametrize("n", [0, len(SMALLCNN_LAYERS) + 1])
def test_bad_number_of_global_layers(n):
    with pytest.raises(MpiflError, match="--lg-global-layers"):
        make_algo("lg-fedavg", lg_global_layers=n)


@pytest.mark.parametrize("uniform,expected", [(False, 0.25 * 2.0 + 0.75 * -6.0), (True, -2.0)])
def test_server_averages_the_global_layers_by_sample_count(uniform, expected):
    algo, model = make_algo("lg-fedavg", uniform_weights=uniform)
    server = algo.init_server(model.state_dict())
    assert set(server.model) == {"classifier.weight", "classifier.bias"}
    tensors = {k: [np.full(v.shape, 2.0, np.float32), np.full(v.shape, -6.0, np.float32)]
               for k, v in server.model.items()}
    algo.aggregate(server, _uploads(tensors, [10, 30]))
    for value in algo.download(server).values():
        assert torch.allclose(value, torch.full_like(value, expected))


def test_private_layers_start_from_the_initial_model_and_belong_to_the_client():
    algo, model = make_algo("lg-fedavg")
    initial = model.state_dict()
    client = algo.init_client(None, initial)
    assert torch.equal(client.private["conv1.weight"], initial["conv1.weight"])
    client.private["conv1.weight"].add_(1.0)
    assert not torch.equal(client.private["conv1.weight"], initial["conv1.weight"])  # a copy, not an alias


def test_two_rounds_move_only_the_classifier_and_report_personal_models(data_root, tmp_path):
    run = tmp_path / "lg"
    run_two_rounds(data_root, run, "lg-fedavg")
    records = read_metrics(run)
    assert [r["round"] for r in records] == [1, 2]
    head = (10 * 64 + 10) * 4
    for record in records:
        assert len(record["clients"]) == 5
        assert record["bytes"]["down"] == record["bytes"]["up"] == 5 * head
        assert set(record["eval"]) == {"personal"}
        assert len(record["eval"]["personal"]["test"]["domains"]) == 5
