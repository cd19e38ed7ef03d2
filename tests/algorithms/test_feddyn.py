"""FedDyn: dynamic regularizer as a gradient correction, client and server state, partial participation, wire."""


import numpy as np
import pytest
import torch

from mpifl.algorithms import Uploads
from mpifl.algorithms.feddyn import GRAD, H
from mpifl.plan.clients import ClientSpec
from mpifl.errors import MpiflError
from mpifl.models import state_entries

from .helpers import aggregate, client_meta, make_algo


def _spec(cid, n=64):
    return ClientSpec(id=cid, domain="mono", rows={s: np.arange(n) for s in ("train", "val", "test")})


def _feddyn(cfg_kw=None, n_clients=5, **options):
    algo, model = make_algo("feddyn", cfg_kw, **options)
    algo.bind_clients([_spec(i) for i in range(n_clients)])
    return algo, model


def _uploads(per_client, clients, samples):
    return Uploads(clients=np.array(clients), meta=client_meta(samples, steps=3),
                   tensors={k: [u[k] for u in per_client] for k in per_client[0]})


def _correction(algo, model, client, shift):
    """The gradient after_backward leaves with zero loss gradients, parameters moved ``shift`` from the download."""
    algo.begin_local(client, model, {})
    with torch.no_grad():
        for p in model.parameters():
            p.add_(shift)
            p.grad = torch.zeros_like(p)
    algo.after_backward(client, model)
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_wire_is_fedavgs_and_the_client_state_is_private():
    algo, model = _feddyn()
    avg, _ = make_algo("fedavg")
    assert algo.policy().download == avg.policy().download and algo.policy().upload == avg.policy().upload
    params = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    counters = [(e.key, e.shape) for e in state_entries(model) if e.attr == "num_batches_tracked"]
    assert [(s.name, s.shape) for s in algo.policy().private] == counters + [(GRAD + n, s) for n, s in params]
    server = algo.init_server(model.state_dict())
    assert set(server.extra) == {H + n for n, _ in params} and set(algo.download(server)) == set(server.model)
    assert algo.alpha == 0.01
    with pytest.raises(MpiflError, match="alpha"):
        make_algo("feddyn", alpha=0.0)
    with pytest.raises(MpiflError, match="--feddyn-alpha must be one of client, global"):
        make_algo("feddyn", feddyn_alpha="paper")
    with pytest.raises(MpiflError, match="--feddyn-max-grad-norm must be >= 0"):
        make_algo("feddyn", feddyn_max_grad_norm=-1.0)


def test_first_round_correction_is_fedprox_with_mu_alpha():
    """With g_k = 0 the dynamic regularizer is alpha/2 ||theta - theta_t||^2: FedProx's gradient with mu = alpha."""
    dyn, model = _feddyn(alpha=0.3)
    prox, model2 = make_algo("fedprox", mu=0.3)
    model2.load_state_dict(model.state_dict())
    client = dyn.init_client(_spec(0), model.state_dict())
    got = _correction(dyn, model, client, 0.5)
    prox.begin_local(None, model2, {})
    with torch.no_grad():
        for p in model2.parameters():
            p.add_(0.5)
            p.grad = torch.zeros_like(p)
    prox.after_backward(None, model2)
    for n, p in model2.named_parameters():
        torch.testing.assert_close(got[n], p.grad)
        torch.testing.assert_close(got[n], torch.full_like(p, 0.15))


def test_client_correction_and_state_update_by_hand():
    alpha = 0.2
    algo, model = _feddyn(alpha=alpha, feddyn_max_grad_norm=0.0)
    client = algo.init_client(_spec(0), model.state_dict())
    gen = torch.Generator().manual_seed(0)
    for k in algo.params:
        client.private[GRAD + k].copy_(torch.randn(client.private[GRAD + k].shape, generator=gen))
    g_before = {k: client.private[GRAD + k].clone() for k in algo.params}
    got = _correction(algo, model, client, 0.5)
    for k in algo.params:
        torch.testing.assert_close(got[k], -g_before[k] + alpha * 0.5)  # -g_k + alpha (theta - theta_t)
    assert algo.end_local(client, model) == {}
    for k in algo.params:  # g_k <- g_k - alpha (theta_k - theta_t)
        torch.testing.assert_close(client.private[GRAD + k], g_before[k] - alpha * 0.5)


@pytest.mark.parametrize("rule", ["client", "global"])
def test_alpha_is_scaled_per_client_by_mean_size_over_its_size_by_default(rule):
    """Sizes 32 and 96 (mean 64): the authors' code trains them with alpha * 2 and alpha * 2/3."""
    options = {} if rule == "client" else {"feddyn_alpha": "global"}
    algo, model = make_algo("feddyn", alpha=0.3, feddyn_max_grad_norm=0.0, **options)
    assert algo.cfg.opt("feddyn_alpha") == rule
    algo.bind_clients([_spec(0, 32), _spec(1, 96)])
    for cid, n, scale in ((0, 32, 2.0), (1, 96, 2 / 3)):
        initial = {k: v.clone() for k, v in model.state_dict().items()}
        client = algo.init_client(_spec(cid, n), initial)
        alpha_k = 0.3 * (scale if rule == "client" else 1.0)
        for k, grad in _correction(algo, model, client, 0.5).items():
            torch.testing.assert_close(grad, torch.full_like(grad, alpha_k * 0.5))
        algo.end_local(client, model)
        for k in algo.params:  # g_k <- g_k - alpha_k (theta_k - theta_t)
            torch.testing.assert_close(client.private[GRAD + k], torch.full_like(initial[k], -alpha_k * 0.5))
        model.load_state_dict(initial)


def test_code_clip_bounds_the_loss_and_linear_gradient_before_the_quadratic():
    """grad = clip_10(G - g_k - alpha theta_t) + alpha theta: G = 1 everywhere, g_k = 0, theta = theta_t + 0.5."""
    alpha = 0.2
    algo, model = _feddyn(alpha=alpha)
    assert algo.clip == 10.0
    client = algo.init_client(_spec(0), model.state_dict())
    anchor = {n: p.detach().clone() for n, p in model.named_parameters()}
    algo.begin_local(client, model, {})
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5)
            p.grad = torch.ones_like(p)
    algo.after_backward(client, model)
    unclipped = {n: 1.0 - alpha * a for n, a in anchor.items()}
    norm = float(torch.linalg.vector_norm(torch.cat([u.flatten() for u in unclipped.values()])))
    assert norm > 10  # the clip acts
    for n, p in model.named_parameters():
        expected = unclipped[n] * (10.0 / (norm + 1e-6)) + alpha * (anchor[n] + 0.5)
        torch.testing.assert_close(p.grad, expected, rtol=1e-5, atol=1e-6)


def test_server_rule_by_hand():
    alpha, m = 0.1, 5
    algo, model = _feddyn(n_clients=m, alpha=alpha)
    server = algo.init_server(model.state_dict())
    rng = np.random.default_rng(1)
    for k in algo.params:
        server.extra[H + k] = torch.from_numpy(rng.normal(0, 0.01, server.model[k].shape).astype(np.float32))
    x = {k: v.double().numpy() for k, v in server.model.items()}
    h = {k: v.double().numpy() for k, v in server.extra.items()}
    ups = [{k: (x[k] + rng.normal(0, 0.1, x[k].shape)).astype(np.float32) for k in x} for _ in range(2)]
    aggregate(algo, server, _uploads(ups, [0, 3], [10, 30]))
    for k in x:
        mean = 0.25 * ups[0][k] + 0.75 * ups[1][k]
        if k in algo.params:
            h_new = h[H + k] - alpha / m * ((ups[0][k] - x[k]) + (ups[1][k] - x[k]))
            np.testing.assert_allclose(server.extra[H + k].numpy(), h_new, rtol=1e-5, atol=1e-7)
            np.testing.assert_allclose(server.model[k].numpy(), mean - h_new / alpha, rtol=1e-5, atol=1e-5)
        else:
            np.testing.assert_allclose(server.model[k].numpy(), mean, rtol=1e-6, atol=1e-7)  # BN statistics


def test_partial_participation_keeps_unsampled_state_and_h_is_the_mean_of_all_g():
    algo, model = _feddyn({"lr": 0.05}, n_clients=4, alpha=0.1)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    server = algo.init_server(initial)
    clients = [algo.init_client(_spec(i), initial) for i in range(4)]
    gen = torch.Generator().manual_seed(2)
    targets = [[torch.randn(p.shape, generator=gen) for p in model.parameters()] for _ in range(4)]
    for sampled in ([0, 1], [1, 3], [1]):
        before = [{k: v.clone() for k, v in c.private.items()} for c in clients]
        download = {k: v.clone() for k, v in algo.download(server).items()}
        ups = []
        for i in sampled:
            with torch.no_grad():
                for k in algo.shared_keys:
                    model.state_dict()[k].copy_(download[k])
            algo.begin_local(clients[i], model, download)
            opt = algo.make_optimizer(model, algo.lr)
            for _ in range(3):
                opt.zero_grad()
                sum(((p - t) ** 2).sum() for p, t in zip(model.parameters(), targets[i])).backward()
                algo.after_backward(clients[i], model)
                opt.step()
            algo.end_local(clients[i], model)
            ups.append({k: v.detach().numpy().copy() for k, v in model.state_dict().items() if k in algo.uploaded_keys})
        aggregate(algo, server, _uploads(ups, sampled, [64] * len(sampled)))
        for i in set(range(4)) - set(sampled):
            assert all(torch.equal(clients[i].private[k], before[i][k]) for k in before[i])
        for k in algo.params:
            torch.testing.assert_close(server.extra[H + k], sum(c.private[GRAD + k] for c in clients) / 4,
                                       rtol=1e-5, atol=1e-6)
    assert all(not v.any() for k, v in clients[2].private.items() if k.startswith(GRAD))  # never sampled
