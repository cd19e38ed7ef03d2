"""LG-FedAvg: the last N blocks are global (averaged), the rest of each model stays on its client."""

import numpy as np
import pytest
import torch

from mpifl.algorithms import Uploads
from mpifl.models import MODEL_NAMES
from mpifl.errors import MpiflError

from ..conftest import read_metrics
from ..models.helpers import input_size
from .helpers import aggregate, client_meta, make_algo, run_two_rounds

SMALLCNN_BLOCKS = ["conv1", "conv2", "conv3", "classifier"]


def _uploads(tensors, samples):
    return Uploads(clients=np.arange(len(samples)), meta=client_meta(samples),
                   tensors=tensors)


def test_blocks_are_layers_with_their_norms_in_forward_order():
    algo, _ = make_algo("lg-fedavg")
    assert list(dict.fromkeys(e.block for e in algo.entries)) == SMALLCNN_BLOCKS


@pytest.mark.parametrize("model", MODEL_NAMES)
def test_one_global_layer_is_exactly_the_classifier_on_every_model(model):
    """LeNet registers bn1 and bn2 after its classifier: counting from the state dict's end would share bn2."""
    size = input_size(model)
    algo, net = make_algo("lg-fedavg", {"model": model}, model=model, image_size=size)
    head = {f"{name}.{p}" for name, module in net.named_modules() if module is net.classifier for p in ("weight", "bias")}
    assert set(algo.shared_keys) == head


def test_default_shares_only_the_classifier_and_keeps_the_rest_private():
    algo, model = make_algo("lg-fedavg")
    policy = algo.policy()
    assert [(s.name, s.shape) for s in policy.download] == [("classifier.weight", (10, 64)), ("classifier.bias", (10,))]
    assert [(s.name, s.shape) for s in policy.upload] == [("classifier.weight", (10, 64)), ("classifier.bias", (10,))]
    assert {s.name for s in policy.private} == set(model.state_dict()) - {"classifier.weight", "classifier.bias"}
    assert algo.evaluates == ("personal",)


def test_two_global_blocks_include_a_norm_with_its_statistics_but_not_its_step_counter():
    algo, _ = make_algo("lg-fedavg", lg_global_layers=2)
    assert algo.shared_keys == ["conv3.weight", "conv3.bias", "norm3.weight", "norm3.bias", "norm3.running_mean",
                                "norm3.running_var", "classifier.weight", "classifier.bias"]
    assert "norm3.num_batches_tracked" in algo.private_keys and "conv2.weight" in algo.private_keys


def test_all_layers_global_is_fedavg():
    lg, _ = make_algo("lg-fedavg", lg_global_layers=len(SMALLCNN_BLOCKS))
    fedavg, _ = make_algo("fedavg")
    assert lg.policy() == fedavg.policy()


@pytest.mark.parametrize("n", [0, len(SMALLCNN_BLOCKS) + 1])
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
    aggregate(algo, server, _uploads(tensors, [10, 30]))
    for value in algo.download(server).values():
        assert torch.allclose(value, torch.full_like(value, expected))


def test_private_layers_start_from_the_initial_model_and_belong_to_the_client():
    algo, model = make_algo("lg-fedavg")
    initial = model.state_dict()
    client = algo.init_client(None, initial)
    assert torch.equal(client.private["conv1.weight"], initial["conv1.weight"])
    client.private["conv1.weight"].add_(1.0)
    assert not torch.equal(client.private["conv1.weight"], initial["conv1.weight"])  # a copy, not an alias


@pytest.mark.slow
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
