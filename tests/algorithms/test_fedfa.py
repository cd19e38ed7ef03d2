"""FedFA: FedAvg plus FFA layers whose clients' statistics go up and whose variance over clients comes down."""

import numpy as np
import pytest
import torch

from mpifl.algorithms import Uploads, get_algorithm
from mpifl.algorithms.fedfa import FedFA
from mpifl.plan.config import RunConfig
from mpifl.errors import MpiflError
from mpifl.models import build_model, state_entries
from mpifl.models.fedfa import FeatureAugmentation, fusion_gamma

from ..conftest import read_metrics
from .helpers import aggregate, client_meta, run_two_rounds

SHARED = [f"fedfa.{i}.shared_var_{k}" for i in range(3) for k in ("mean", "std")]


def _fedfa(**options):
    cls = get_algorithm("fedfa")
    cfg = RunConfig(algo="fedfa", algo_options={**{o.name: o.default for o in cls.options}, **options})
    torch.manual_seed(0)
    model = cls.adapt_model(build_model("smallcnn", num_classes=10), cfg)
    return cls(cfg, state_entries(model)), model


def test_ffa_layers_follow_every_stage_and_draw_no_random_numbers_when_built():
    cfg = RunConfig(algo="fedfa", algo_options={o.name: o.default for o in FedFA.options})
    torch.manual_seed(3)
    build_model("smallcnn", num_classes=10)
    plain_next = torch.rand(3)
    torch.manual_seed(3)
    model = FedFA.adapt_model(build_model("smallcnn", num_classes=10), cfg)
    assert torch.equal(torch.rand(3), plain_next)
    assert [(type(m), m.channels, m.p, m.momentum) for m in model.fedfa] == [
        (FeatureAugmentation, c, 0.5, 0.99) for c in (16, 32, 64)]


def test_policy_sends_shared_variances_down_only_and_client_statistics_up():
    algo, model = _fedfa()
    fedavg_keys = [k for k in model.state_dict() if not k.endswith("num_batches_tracked")]
    policy = algo.policy()
    assert [s.name for s in policy.download] == fedavg_keys + ["fedfa.running/0", "fedfa.running/1", "fedfa.running/2"]
    assert [s.shape for s in policy.download[-3:]] == [(2, 16), (2, 32), (2, 64)]
    assert [s.name for s in _fedfa(fedfa_stats="reset")[0].policy().download] == fedavg_keys
    assert [s.name for s in policy.upload] == [k for k in fedavg_keys if k not in SHARED] + [
        "fedfa.stats/0", "fedfa.stats/1", "fedfa.stats/2"]
    assert [s.shape for s in policy.upload[-3:]] == [(2, 16), (2, 32), (2, 64)]
    assert algo.adopted_keys == SHARED


@pytest.mark.parametrize("rule", ["layer", "channel"])
def test_server_averages_the_model_and_takes_the_variance_of_client_statistics(rule):
    algo, model = _fedfa(fedfa_var=rule)
    server = algo.init_server(model.state_dict())
    assert all(torch.equal(server.model[k], torch.ones_like(server.model[k])) for k in SHARED)
    rng = np.random.default_rng(0)
    stats = {f"fedfa.stats/{i}": [rng.normal(size=(2, c)).astype(np.float32) for _ in range(3)]
             for i, c in enumerate((16, 32, 64))}
    weights = {k: [np.full(server.model[k].shape, v, np.float32) for v in (1.0, 2.0, 4.0)]
               for k in algo.uploaded_keys}
    meta = client_meta([10, 10, 20])
    aggregate(algo, server, Uploads(clients=np.arange(3), meta=meta, tensors={**weights, **stats}))
    assert torch.allclose(server.model["conv1.weight"], torch.full_like(server.model["conv1.weight"], 2.75))
    for i in range(3):
        s = np.stack(stats[f"fedfa.stats/{i}"])
        for row, kind in enumerate(("mean", "std")):
            values = s[:, row, :]
            if rule == "channel":  # the paper: per channel, 1/K over the clients, unweighted
                expected = ((values - values.mean(0)) ** 2).mean(0)
            else:  # the code: torch.var of the (K, C) stack, one unbiased value in every channel
                expected = np.full(values.shape[1], ((values - values.mean()) ** 2).sum() / (values.size - 1))
            shared = server.model[f"fedfa.{i}.shared_var_{kind}"]
            assert np.allclose(shared.numpy(), expected, atol=1e-6)
            gamma = fusion_gamma(shared)
            assert torch.allclose(gamma, torch.ones_like(gamma)) == (rule == "layer")
    down = algo.download(server)
    assert torch.equal(down["fedfa.1.shared_var_std"], server.model["fedfa.1.shared_var_std"])


def test_identical_client_statistics_leave_fusion_uniform():
    algo, model = _fedfa()
    server = algo.init_server(model.state_dict())
    same = {f"fedfa.stats/{i}": [np.ones((2, c), np.float32)] * 2 for i, c in enumerate((16, 32, 64))}
    weights = {k: [server.model[k].numpy()] * 2 for k in algo.uploaded_keys}
    aggregate(algo, server, Uploads(clients=np.arange(2), meta=client_meta([1, 1]), tensors={**weights, **same}))
    assert not server.model["fedfa.0.shared_var_mean"].any()
    assert torch.allclose(fusion_gamma(server.model["fedfa.0.shared_var_mean"]), torch.ones(16))


def test_server_carries_the_weighted_mean_of_the_clients_statistics_by_default():
    """The authors' code averages the statistics buffers with the model (weights 1/4, 1/4, 1/2 here)."""
    algo, model = _fedfa()
    assert algo.cfg.opt("fedfa_stats") == "carry"
    server = algo.init_server(model.state_dict())
    start = algo.download(server)["fedfa.running/1"]
    assert torch.equal(start, torch.stack([torch.zeros(32), torch.ones(32)]))  # (0, 1) before any upload
    stats = {f"fedfa.stats/{i}": [np.full((2, c), v, np.float32) for v in (1.0, 2.0, 4.0)]
             for i, c in enumerate((16, 32, 64))}
    weights = {k: [server.model[k].numpy()] * 3 for k in algo.uploaded_keys}
    aggregate(algo, server, Uploads(clients=np.arange(3), meta=client_meta([10, 10, 20]),
                                   tensors={**weights, **stats}))
    down = algo.download(server)
    assert torch.allclose(down["fedfa.running/2"], torch.full((2, 64), 2.75))  # 1/4 + 2/4 + 4/2
    algo.begin_local(None, model, down)
    assert torch.allclose(model.fedfa[0].client_stats(), torch.full((2, 16), 2.75))


@pytest.mark.parametrize("rule", ["carry", "reset"])
def test_client_starts_its_statistics_from_the_download_or_resets_them_and_uploads_them(rule):
    algo, model = _fedfa(fedfa_p=1.0, fedfa_stats=rule)
    model.train()
    model(torch.randn(8, 3, 28, 28))
    assert model.fedfa[0].running_mean.abs().sum() > 0
    carried = {f"fedfa.running/{i}": torch.full((2, m.channels), 3.0) for i, m in enumerate(model.fedfa)}
    algo.begin_local(None, model, carried if rule == "carry" else {})
    start = [torch.full((2, m.channels), 3.0) if rule == "carry"
             else torch.stack([torch.zeros(m.channels), torch.ones(m.channels)]) for m in model.fedfa]
    assert all(torch.equal(m.client_stats(), s) for m, s in zip(model.fedfa, start))
    x = torch.randn(8, 3, 28, 28)
    loss, _ = algo.batch_loss(None, model, x, torch.arange(8))
    loss.backward()
    up = algo.end_local(None, model)
    assert list(up) == ["fedfa.stats/0", "fedfa.stats/1", "fedfa.stats/2"]
    assert torch.equal(up["fedfa.stats/2"], model.fedfa[2].client_stats())
    assert not torch.equal(up["fedfa.stats/0"], start[0])


@pytest.mark.parametrize("bad", [{"fedfa_p": 1.5}, {"fedfa_momentum": 1.0}, {"fedfa_stats": "keep"},
                                 {"fedfa_var": "client"}])
def test_bad_options(bad):
    """Refused in one line before the network is built (the method's options' ranges)."""
    cls = get_algorithm("fedfa")
    cfg = RunConfig(algo="fedfa", model="smallcnn", algo_options={**{o.name: o.default for o in cls.options}, **bad})
    with pytest.raises(MpiflError, match=f"^--{next(iter(bad)).replace('_', '-')} must be "):
        cls.network(cfg, num_classes=10)


@pytest.mark.slow
def test_two_rounds_add_only_the_statistics_to_fedavgs_wire(data_root, tmp_path):
    run = tmp_path / "fa"
    run_two_rounds(data_root, run, "fedfa")
    entries = state_entries(build_model("smallcnn", num_classes=10))
    model = sum(e.nbytes for e in entries if e.attr != "num_batches_tracked")
    stats = 2 * 4 * (16 + 32 + 64)  # two vectors of C float32 per FFA layer: shared variances, statistics
    for record in read_metrics(run):
        assert record["bytes"]["down"] == 5 * (model + 2 * stats)  # + the carried statistics
        assert record["bytes"]["up"] == 5 * (model + stats)
        assert set(record["eval"]) == {"global"}
        assert np.isfinite(record["train"]["loss"])


def test_with_p_zero_training_is_fedavgs():
    algo, model = _fedfa(fedfa_p=0.0)
    torch.manual_seed(0)
    plain = build_model("smallcnn", num_classes=10)
    plain.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("fedfa.")})
    model.train(), plain.train()
    x, y = torch.randn(8, 3, 28, 28), torch.arange(8)
    loss, _ = algo.batch_loss(None, model, x, y)
    assert torch.equal(loss, torch.nn.functional.cross_entropy(plain(x), y))
