"""FedBuff and FedAsync by hand: the update each client uploads, the staleness weights of their papers, the server
step from the buffer (FedBuff) and the mix of one arrival (FedAsync)."""

import numpy as np
import pytest
import torch

from mpifl.algorithms import Uploads
from mpifl.algorithms.core.asynchronous import staleness_weights
from mpifl.plan.clients import ClientSpec

from .helpers import aggregate, client_meta, local_round, make_algo, moved_models


def _uploads(per_client, staleness):
    return Uploads(clients=np.arange(len(staleness)), meta=client_meta([10] * len(staleness)),
                   tensors={k: [u[k] for u in per_client] for k in per_client[0]},
                   staleness=np.array(staleness, dtype=np.int64))


def test_staleness_weights_are_the_papers():
    tau = np.array([0, 1, 3, 8])
    assert np.allclose(staleness_weights("polynomial", tau, 0.5, 4), 1 / np.sqrt(1 + tau))  # FedBuff's
    assert np.allclose(staleness_weights("hinge", tau, 10, 4), [1, 1, 1, 1 / (10 * 4 + 1)])
    assert np.array_equal(staleness_weights("constant", tau, 0.5, 4), np.ones(4))


def test_a_fedbuff_client_uploads_its_update_trained_minus_downloaded():
    algo, model = make_algo("fedbuff")
    spec = ClientSpec(0, "d", {"train": np.arange(8)})
    algo.bind_clients([spec])
    download = {k: v.detach().clone() for k, v in model.state_dict().items() if k in algo.shared_keys}
    client = algo.init_client(spec, model.state_dict())
    upload = local_round(algo, model, client, download, steps=3,
                         loss_fn=lambda m: sum((p ** 2).sum() for p in m.parameters()))
    trained = model.state_dict()
    for key in algo.uploaded_keys:
        assert np.allclose(upload[key], (trained[key] - download[key]).numpy())
    assert any(np.abs(upload[k]).max() > 0 for k in algo.uploaded_keys)


@pytest.mark.parametrize("server_lr", [1.0, 0.5])
def test_fedbuff_steps_by_the_staleness_weighted_mean_of_its_k_updates(server_lr):
    algo, model = make_algo("fedbuff", buffer_size=3, server_lr=server_lr)
    server = algo.init_server(model.state_dict())
    before = {k: v.clone() for k, v in server.model.items()}
    deltas = moved_models({k: torch.zeros_like(v) for k, v in server.model.items()}, 3, np.random.default_rng(0))
    staleness = [0, 2, 5]
    aggregate(algo, server, _uploads(deltas, staleness), window=1)
    s = 1 / np.sqrt(1 + np.array(staleness))
    for key in algo.uploaded_keys:
        expected = before[key].double().numpy() + server_lr * sum(w * d[key] for w, d in zip(s, deltas)) / 3
        assert np.allclose(server.model[key].double().numpy(), expected, atol=1e-6)


def test_fedasync_mixes_one_arrival_in_by_alpha_times_its_staleness_weight():
    algo, model = make_algo("fedasync", fedasync_alpha=0.6)
    server = algo.init_server(model.state_dict())
    before = {k: v.clone() for k, v in server.model.items()}
    new = moved_models(server.model, 1, np.random.default_rng(1))
    aggregate(algo, server, _uploads(new, [2]))
    alpha = 0.6 * (2 + 1 + 1) ** -0.5  # the paper's t - tau = the steps since the download + 1
    for key in algo.uploaded_keys:
        expected = (1 - alpha) * before[key].double().numpy() + alpha * new[0][key].astype(np.float64)
        assert np.allclose(server.model[key].double().numpy(), expected, atol=1e-6)
