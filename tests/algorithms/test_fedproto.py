"""FedProto: models stay private; class prototypes go up, their count-weighted mean comes down."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mpifl.algorithms import ClientState, Uploads, get_algorithm
from mpifl.algorithms.fedproto import COUNTS, PRESENT, PROTOS, aggregate_prototypes
from mpifl.plan.clients import ClientSpec
from mpifl.plan.config import resolve
from mpifl.errors import MpiflError

from ..conftest import read_metrics
from .helpers import aggregate, client_meta, make_algo, run_two_rounds


def _algo(mu=1.0):
    algo, model = make_algo("fedproto", mu=mu)
    return algo, model


def _client(n=8):
    return ClientState(ClientSpec(id=0, domain="d", rows={s: np.arange(n) for s in ("train", "val", "test")}), {})


def _download(protos, present):
    return {PROTOS: torch.as_tensor(protos, dtype=torch.float32), PRESENT: torch.as_tensor(present, dtype=torch.float32)}


def test_policy_moves_only_prototypes_and_keeps_the_whole_model():
    algo, model = _algo()
    policy = algo.policy()
    assert [(s.name, s.shape, s.dtype) for s in policy.download] == [
        (PROTOS, (10, 64), torch.float32), (PRESENT, (10,), torch.float32)]
    assert [(s.name, s.shape, s.dtype) for s in policy.upload] == [
        (PROTOS, (10, 64), torch.float32), (COUNTS, (10,), torch.float32)]
    assert [s.name for s in policy.private] == list(model.state_dict())
    assert algo.evaluates == ("personal",)


def test_mu_defaults_to_fedrdn_value_while_fedprox_keeps_its_own():
    declared = {name: {o.name: o for o in get_algorithm(name).options} for name in ("fedproto", "fedprox")}
    assert resolve({}, {}, declared["fedproto"]).opt("mu") == 1.0  # each method resolves its own default
    assert resolve({}, {}, declared["fedprox"]).opt("mu") == 0.01
    assert resolve({"mu": 0.3}, {}, declared["fedproto"]).opt("mu") == 0.3
    assert "uniform_weights" not in declared["fedproto"]  # FedProto averages no model
    with pytest.raises(MpiflError, match="--mu"):
        make_algo("fedproto", mu=-1.0)
    with pytest.raises(MpiflError, match="--proto-epochs must be one of last, all"):
        make_algo("fedproto", proto_epochs="first")


def test_server_takes_the_count_weighted_mean_per_class_and_keeps_unreported_classes():
    protos = np.array([[[1.0, 2.0], [0.0, 0.0], [5.0, 5.0]],
                       [[4.0, -1.0], [0.0, 0.0], [9.0, 9.0]]])  # 2 clients, 3 classes, D = 2
    counts = np.array([[1.0, 0.0, 3.0], [2.0, 0.0, 0.0]])
    previous = torch.tensor([[7.0, 7.0], [8.0, 8.0], [6.0, 6.0]])
    new, present = aggregate_prototypes(protos, counts, previous, torch.tensor([0.0, 1.0, 0.0]))
    assert torch.allclose(new[0], torch.tensor([(1 * 1 + 2 * 4) / 3, (1 * 2 + 2 * -1) / 3]))
    assert torch.equal(new[1], previous[1])  # nobody had class 1 this round
    assert torch.allclose(new[2], torch.tensor([5.0, 5.0]))  # client 1's zero-count row is left out
    assert torch.equal(present, torch.tensor([1.0, 1.0, 1.0]))


def test_aggregate_through_uploads_updates_the_download():
    algo, model = _algo()
    server = algo.init_server(model.state_dict())
    assert server.model == {} and not algo.download(server)[PRESENT].any()
    up = np.zeros((2, 10, 64), np.float32)
    up[0, 3], up[1, 3] = 1.0, 4.0
    counts = np.zeros((2, 10), np.float32)
    counts[0, 3], counts[1, 3] = 3, 1
    aggregate(algo, server, Uploads(clients=np.arange(2), meta=client_meta([1, 1]),
                                   tensors={PROTOS: list(up), COUNTS: list(counts)}))
    down = algo.download(server)
    assert torch.allclose(down[PROTOS][3], torch.full((64,), 1.75)) and down[PRESENT].tolist()[3] == 1.0
    assert down[PRESENT].sum() == 1 and not down[PROTOS][4].any()


def test_without_global_prototypes_the_loss_is_cross_entropy():
    algo, model = _algo()
    x, y = torch.randn(6, 3, 28, 28), torch.tensor([0, 1, 2, 0, 1, 2])
    algo.begin_local(_client(), model, _download(torch.zeros(10, 64), torch.zeros(10)))
    loss, logits = algo.batch_loss(None, model, x, y)
    assert torch.allclose(loss, F.cross_entropy(logits, y))


def test_the_loss_adds_the_extra_loss_the_hook_contract_asks_for(monkeypatch):
    """Algorithm.batch_loss's contract: the task loss + extra_loss (latent while FedProto refuses the guide)."""
    algo, model = _algo()
    x, y = torch.randn(6, 3, 28, 28), torch.tensor([0, 1, 2, 0, 1, 2])
    algo.begin_local(_client(), model, _download(torch.zeros(10, 64), torch.zeros(10)))
    model.eval()  # the same features for both calls
    without, _ = algo.batch_loss(None, model, x, y)
    monkeypatch.setattr(algo, "extra_loss", lambda client, model, features, logits, labels: features.sum() * 0 + 7.0)
    with_extra, _ = algo.batch_loss(None, model, x, y)
    assert with_extra.item() == pytest.approx(without.item() + 7.0)


def test_loss_adds_mu_times_the_mse_to_the_label_prototypes_where_they_exist():
    algo, model = _algo(mu=0.5)
    torch.manual_seed(0)
    protos, present = torch.randn(10, 64), torch.zeros(10)
    present[[0, 2]] = 1.0  # class 1 has no global prototype
    x, y = torch.randn(6, 3, 28, 28), torch.tensor([0, 1, 2, 0, 1, 2])
    algo.begin_local(_client(), model, _download(protos, present))
    loss, logits = algo.batch_loss(None, model, x, y)
    features = model.encode(x)  # train mode: batch statistics, the same features again
    squared = sum(((features[i] - protos[y[i]]) ** 2).sum() for i in range(6) if y[i] != 1)
    expected = F.cross_entropy(logits, y) + 0.5 * squared / (6 * 64)
    assert torch.allclose(loss, expected, atol=1e-6)


def test_uploaded_prototypes_are_class_means_of_every_training_batch_features():
    algo, model = _algo()
    algo.begin_local(_client(), model, _download(torch.zeros(10, 64), torch.zeros(10)))
    torch.manual_seed(1)
    batches = [(torch.randn(4, 3, 28, 28), torch.tensor([1, 1, 5, 7])),
               (torch.randn(4, 3, 28, 28), torch.tensor([5, 1, 5, 5]))]
    feats = []
    for x, y in batches:
        algo.batch_loss(None, model, x, y)
        feats.append(model.encode(x).detach())
    up = algo.end_local(None, model)
    features, labels = torch.cat(feats), torch.cat([y for _, y in batches])
    assert up[COUNTS].tolist() == [0, 3, 0, 0, 0, 4, 0, 1, 0, 0]
    for c in (1, 5, 7):
        assert torch.allclose(up[PROTOS][c], features[labels == c].mean(0), atol=1e-6)
    assert not up[PROTOS][0].any()  # a class the client lacks uploads zeros with count 0


@pytest.mark.parametrize("rule", ["last", "all"])
def test_prototypes_come_from_the_last_local_epoch_by_default_or_from_all(rule):
    """8 samples, B = 4, E = 2: batches 1-2 are epoch 1, 3-4 epoch 2 (the authors' code keeps epoch 2 only)."""
    options = {} if rule == "last" else {"proto_epochs": "all"}
    algo, model = make_algo("fedproto", {"local_epochs": 2, "batch_size": 4}, **options)
    assert algo.cfg.opt("proto_epochs") == rule
    algo.begin_local(_client(8), model, _download(torch.zeros(10, 64), torch.zeros(10)))
    torch.manual_seed(2)
    batches = [(torch.randn(4, 3, 28, 28), torch.tensor([3, 3, 3, 3])) for _ in range(4)]
    feats = []
    for x, y in batches:
        algo.batch_loss(None, model, x, y)
        feats.append(model.encode(x).detach())
    up = algo.end_local(None, model)
    used = feats[2:] if rule == "last" else feats
    assert up[COUNTS][3] == 4 * len(used)
    assert torch.allclose(up[PROTOS][3], torch.cat(used).mean(0), atol=1e-6)
    assert not torch.allclose(torch.cat(feats[2:]).mean(0), torch.cat(feats).mean(0), atol=1e-3)


@pytest.mark.slow
def test_two_rounds_move_only_prototypes_and_report_personal_models(data_root, tmp_path):
    run = tmp_path / "proto"
    run_two_rounds(data_root, run, "fedproto")
    records = read_metrics(run)
    assert [r["round"] for r in records] == [1, 2]
    per_client = (10 * 64 + 10) * 4
    for record in records:
        assert record["bytes"]["down"] == record["bytes"]["up"] == 5 * per_client
        assert set(record["eval"]) == {"personal"}
        assert np.isfinite(record["train"]["loss"])
