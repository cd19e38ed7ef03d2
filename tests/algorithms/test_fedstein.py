"""FedStein: BN affine stays local, BN running statistics are James-Stein-shrunk means (eq. 9)."""

from functools import partial

import numpy as np
import pytest
import torch

from mpifl.errors import MpiflError
from mpifl.algorithms import Uploads
from mpifl.models.jsbn import JSBatchNorm2d
from mpifl.plan.clients import ClientSpec
from mpifl.client.training import load_state
from mpifl.models import build_model, state_entries

from .helpers import aggregate, client_meta, local_round, make_algo


_algo = partial(make_algo, "fedstein")


def test_policy_keeps_bn_affine_and_counters_and_sends_running_stats():
    algo, model = _algo()
    entries = {e.key: e for e in state_entries(model)}
    policy = algo.policy()
    down, up = {s.name for s in policy.download}, {s.name for s in policy.upload}
    assert down == up
    bn = {k for k, e in entries.items() if e.module_kind == "bn"}
    assert bn and not any(entries[k].is_param for k in down & bn)  # no BN weight/bias on the wire
    assert {"norm1.running_mean", "norm1.running_var", "norm3.running_var"} <= down
    kept = {k for k in bn if entries[k].is_param or k.endswith("num_batches_tracked")}
    assert {s.name for s in policy.private} == kept
    assert {k for k, e in entries.items() if e.module_kind in ("conv", "linear")} <= down
    assert algo.evaluates == ("personal",)
    assert _algo({"holdout": "mono"})[0].evaluates == ("global", "personal")  # the paper's unseen-domain test


def _client_uploads(server, n_clients, seed):
    """Each entry: a common per-channel value plus client noise (so neither rule's factor is clamped)."""
    rng = np.random.default_rng(seed)
    out = {}
    for k, v in server.model.items():
        if k.endswith("running_var"):
            base = rng.uniform(0.5, 2.0, v.shape)
            out[k] = [(base * rng.uniform(0.8, 1.2, v.shape)).astype(np.float32) for _ in range(n_clients)]
        else:
            base = rng.normal(0.3, 1.0, v.shape)
            out[k] = [(base + rng.normal(0.0, 0.3, v.shape)).astype(np.float32) for _ in range(n_clients)]
    return out


def _sigma2_by_hand(rule, values, weights, mean):
    if rule == "channels":
        return mean.var()  # biased, across the c channels
    p = weights / weights.sum()
    spread = sum(pk * np.square(v.astype(np.float64) - mean) for pk, v in zip(p, values))
    return spread.mean() * np.square(p).sum() / (1 - np.square(p).sum())  # Var of the weighted mean


@pytest.mark.parametrize("rule", ["sampling", "channels"])
def test_aggregate_js_shrinks_the_weighted_mean_of_running_stats_and_averages_the_rest(rule):
    for uniform in (False, True):
        algo, model = _algo(uniform_weights=uniform, js_sigma2=rule)
        server = algo.init_server(model.state_dict())
        tensors = _client_uploads(server, 3, seed=4)
        samples = [10, 30, 60]
        meta = client_meta(samples)
        aggregate(algo, server, Uploads(clients=np.arange(3), meta=meta, tensors=tensors))
        weights = np.ones(3) if uniform else np.array(samples, dtype=np.float64)
        shrunk = 0
        for key, values in tensors.items():
            mean = sum(w * v.astype(np.float64) for w, v in zip(weights, values)) / weights.sum()
            if key.endswith(("running_mean", "running_var")):
                c = mean.size
                sigma2 = _sigma2_by_hand(rule, values, weights, mean)
                factor = 1 - (c - 2) * sigma2 / np.square(mean).sum()  # eq. (9), by hand
                assert 0 < factor < 1
                expected = torch.from_numpy(factor * mean).float()
                shrunk += 1
            else:
                expected = torch.from_numpy(mean).float()
            assert server.model[key].dtype == torch.float32
            torch.testing.assert_close(server.model[key], expected, rtol=1e-6, atol=1e-7)
        assert shrunk == 6  # 3 BN layers x (mean, var)


def test_running_stats_equal_to_a_plain_mean_only_where_js_leaves_them():
    key = "norm2.running_mean"
    algo, model = _algo(js_sigma2="channels")
    server = algo.init_server(model.state_dict())
    tensors = {k: [v.numpy().copy(), v.numpy().copy()] for k, v in server.model.items()}
    tensors[key] = [np.full(32, 2.0, np.float32), np.full(32, 4.0, np.float32)]  # no spread across channels
    aggregate(algo, server, Uploads(clients=np.arange(2), meta=client_meta([1, 1]), tensors=tensors))
    torch.testing.assert_close(server.model[key], torch.full((32,), 3.0))
    torch.testing.assert_close(server.model["norm2.running_var"], torch.ones(32))  # initial ones: no spread either
    algo, model = _algo(js_sigma2="sampling")
    server = algo.init_server(model.state_dict())
    values = np.linspace(-1, 2, 32).astype(np.float32)
    tensors[key] = [values, values.copy()]  # the clients agree: the mean has no sampling variance
    aggregate(algo, server, Uploads(clients=np.arange(2), meta=client_meta([1, 3]), tensors=tensors))
    torch.testing.assert_close(server.model[key], torch.from_numpy(values))
    tensors[key] = [values, values + 1]  # they disagree: shrunk
    aggregate(algo, server, Uploads(clients=np.arange(2), meta=client_meta([1, 3]), tensors=tensors))
    assert server.model[key].norm() < torch.from_numpy(values + 0.75).norm()


def test_an_unknown_sigma2_rule_is_refused_in_one_line():
    with pytest.raises(MpiflError, match="--js-sigma2 must be one of sampling, channels"):
        _algo(js_sigma2="across")


def test_held_out_global_model_takes_the_clients_averaged_bn_affine_personal_models_their_own():
    algo, model = _algo({"holdout": "mono"})
    entries = {e.key: e for e in state_entries(model)}
    affine = sorted(k for k, e in entries.items() if e.module_kind == "bn" and e.is_param)
    policy = algo.policy()
    assert sorted(s.name for s in policy.upload if s.name.startswith("fedstein.bn/")) == \
        sorted("fedstein.bn/" + k for k in affine)
    assert not any(s.name.startswith("fedstein.bn/") for s in _algo()[0].policy().upload)  # only with --holdout
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    server = algo.init_server(initial)
    tensors = {k: [v.numpy().copy()] * 2 for k, v in server.model.items()}
    tensors.update({"fedstein.bn/" + k: [np.full(initial[k].shape, 1.0, np.float32),
                                         np.full(initial[k].shape, 5.0, np.float32)] for k in affine})
    aggregate(algo, server, Uploads(clients=np.arange(2), meta=client_meta([3, 1]), tensors=tensors))
    download = algo.download(server)
    client = algo.init_client(ClientSpec(id=0, domain="mono", rows={"train": np.arange(10)}), initial)
    client.private["norm1.weight"].fill_(3.0)
    client.private["norm1.num_batches_tracked"].fill_(7)
    glob = algo.global_private(client, download)
    assert set(glob) == set(client.private)
    assert torch.equal(glob["norm1.weight"], torch.full((16,), 2.0))  # (3 * 1 + 1 * 5) / 4
    assert int(glob["norm1.num_batches_tracked"]) == 7
    assert torch.equal(client.private["norm1.weight"], torch.full((16,), 3.0))  # the personal model keeps its own


def test_the_model_is_built_with_jsnorm_layers():
    _, model = _algo()
    assert isinstance(model.norm1, JSBatchNorm2d)
    assert {e.module_kind for e in state_entries(model)} == {"conv", "bn", "linear"}


def test_a_personal_model_evaluates_with_the_servers_shrunk_statistics_and_its_own_affine():
    """After a round, a client's personal model (download + its private entries) in evaluation mode normalizes
    with eq. (9) applied to the clients' weighted mean running statistics, and its own trained BN affine."""
    algo, model = _algo(js_sigma2="sampling")
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    server = algo.init_server(initial)
    download = algo.download(server)
    torch.manual_seed(0)
    clients, uploads = [], []
    for cid, (scale, shift) in enumerate([(1.0, 0.0), (3.0, 2.0), (0.5, -1.0)]):  # three feature-shifted domains
        client = algo.init_client(ClientSpec(id=cid, domain=f"d{cid}", rows={"train": np.arange(8)}), initial)
        batch = (torch.randn(8, 3, 28, 28) * scale + shift, torch.randint(0, 10, (8,)))
        uploads.append(local_round(algo, model, client, download, steps=3, batch=batch))
        clients.append(client)
    samples = [8, 24, 16]
    tensors = {k: [u[k] for u in uploads] for k in uploads[0]}
    aggregate(algo, server, Uploads(clients=np.arange(3), meta=client_meta(samples), tensors=tensors))
    download = algo.download(server)

    p = np.array(samples, dtype=np.float64) / sum(samples)
    x = torch.randn(4, 3, 28, 28) * 3.0 + 2.0
    for client, own in zip(clients, uploads):
        load_state(model.state_dict(), algo, download, client.private)
        model.eval()
        with torch.no_grad():
            got = model(x)
        reference = build_model("smallcnn", num_classes=10, image_size=(28, 28), norm="bn").eval()
        expected_state, factors = {}, []
        for key in model.state_dict():
            if key.endswith(("running_mean", "running_var")):
                stacked = np.stack([t[key].astype(np.float64) for t in uploads])
                mean = np.tensordot(p, stacked, axes=1)
                spread = np.tensordot(p, np.square(stacked - mean), axes=1).mean()
                sigma2 = spread * np.square(p).sum() / (1 - np.square(p).sum())  # eq. (9)'s sigma^2, by hand
                factor = max(1 - (len(mean) - 2) * sigma2 / np.square(mean).sum(), 0.0)  # positive part
                factors.append(factor)
                expected_state[key] = torch.from_numpy(factor * mean).float()
            elif key in client.private:
                expected_state[key] = client.private[key]  # BN affine and counter: the client's own
            else:
                stacked = np.stack([t[key] for t in uploads])
                expected_state[key] = torch.from_numpy(np.tensordot(p, stacked, axes=1)).float()
        assert any(0 < f < 1 for f in factors)
        reference.load_state_dict(expected_state)
        with torch.no_grad():
            torch.testing.assert_close(got, reference(x), rtol=1e-4, atol=1e-5)
            own_stats = {**expected_state, **{k: torch.from_numpy(own[k]) for k in expected_state
                                               if k.endswith(("running_mean", "running_var"))}}
            reference.load_state_dict(own_stats)
            assert not torch.allclose(got, reference(x), rtol=1e-3, atol=1e-3)  # not the client's own statistics
