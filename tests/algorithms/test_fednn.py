"""FedNN: WN conv + AGN model, linear tau schedule, frozen-choice aggregation, FedAvg/FedProx base."""

from functools import partial

import numpy as np
import pytest
import torch

from mpifl.algorithms import ClientState, Uploads
from mpifl.plan.clients import ClientSpec
from mpifl.plan.seeding import personalization_seeds
from mpifl.algorithms.fednn import aggregate_choice, fednn_tau
from mpifl.errors import MpiflError
from mpifl.models import AdaptiveGroupNorm, WNConv2d

from .helpers import aggregate, client_meta, gradients_after_shift, make_algo


_algo = partial(make_algo, "fednn")


def _tau(model):
    taus = {m.tau for m in model.modules() if isinstance(m, AdaptiveGroupNorm)}
    assert len(taus) == 1
    return taus.pop()


def test_model_and_policy_share_the_whole_state():
    algo, model = _algo()
    assert all(isinstance(m, WNConv2d) for m in (model.conv1, model.conv2, model.conv3))
    assert isinstance(model.norm1, AdaptiveGroupNorm)
    policy = algo.policy()
    names = set(model.state_dict())
    assert {s.name for s in policy.download} == names == {s.name for s in policy.upload}
    assert {"norm1.choice", "norm1.select_logits", "norm1.running_mean", "norm3.running_var"} <= names
    assert policy.private == [] and algo.evaluates == ("global",)
    assert algo.choice_keys == {"norm1.choice", "norm2.choice", "norm3.choice"}


def test_tau_schedule_is_the_authors_linear_decay():
    rounds = 200
    assert fednn_tau(5.0, 1, rounds) == pytest.approx(5.0 * (200.001 / 200))
    assert fednn_tau(5.0, 100, rounds) == pytest.approx(5.0 * 101.001 / 200)  # about half-way
    assert fednn_tau(5.0, rounds, rounds) == pytest.approx(5.0 * 1.001 / 200)  # about 0
    # identical to the authors' temperature_list = (arange(0.001, T + 1) / T)[::-1] * tau
    code = (np.arange(0.001, rounds + 1) / rounds)[::-1] * 5.0
    assert np.allclose([fednn_tau(5.0, r, rounds) for r in range(1, rounds + 1)], code[:rounds])
    steps = np.diff([fednn_tau(5.0, r, rounds) for r in range(1, rounds + 1)])
    assert np.allclose(steps, -5.0 / rounds)


def test_tau_is_set_on_the_model_before_training_and_evaluation():
    algo, model = _algo({"rounds": 10}, tau0=2.0)
    algo.begin_round(1)
    algo.begin_local(None, model, {})
    assert _tau(model) == pytest.approx(2.0 * 10.001 / 10)
    algo.begin_round(6)
    algo.begin_local(None, model, {})
    assert _tau(model) == pytest.approx(2.0 * 5.001 / 10)
    algo.begin_eval(model, 10)
    assert _tau(model) == pytest.approx(2.0 * 1.001 / 10)


def test_choice_rule_frozen_only_when_every_participant_froze():
    w = np.array([1.0, 1.0, 1.0])
    as_uploads = lambda *c: [np.array(x, dtype=np.int64) for x in c]  # noqa: E731
    assert int(aggregate_choice(as_uploads(-1, -1, -1), w)) == -1
    assert int(aggregate_choice(as_uploads(0, 0, -1), w)) == -1  # the authors' truncated mean of 0/1 flags
    assert int(aggregate_choice(as_uploads(1, 1, 1), w)) == 1
    assert int(aggregate_choice(as_uploads(0, 0, 0), w)) == 0
    assert int(aggregate_choice(as_uploads(0, 1, 1), w)) == 1  # weighted majority
    assert int(aggregate_choice(as_uploads(0, 1, 1), np.array([5.0, 1.0, 1.0]))) == 0
    assert int(aggregate_choice(as_uploads(0, 1), np.array([2.0, 2.0]))) == -1  # tie: free again
    assert aggregate_choice(as_uploads(1), np.ones(1)).dtype == torch.int64


def test_aggregate_averages_everything_and_applies_the_choice_rule():
    algo, model = _algo()
    server = algo.init_server(model.state_dict())
    tensors = {}
    for k, v in server.model.items():
        if k in algo.choice_keys:
            tensors[k] = [np.array(1, np.int64), np.array(1 if k == "norm1.choice" else -1, np.int64)]
        else:
            tensors[k] = [np.full(v.shape, 1.0, np.float32), np.full(v.shape, 5.0, np.float32)]
    meta = client_meta([10, 30])
    aggregate(algo, server, Uploads(clients=np.arange(2), meta=meta, tensors=tensors))
    for k, v in server.model.items():
        if k in algo.choice_keys:
            assert v.dtype == torch.int64 and int(v) == (1 if k == "norm1.choice" else -1)
        else:
            assert v.dtype == torch.float32
            torch.testing.assert_close(v, torch.full_like(v, 4.0))


def test_tau_spans_the_stored_schedule_rounds_not_a_resumed_runs_rounds():
    """Started with 10 rounds, resumed to 20: tau keeps T = 10 and stays at tau_10 after it (not T = 20)."""
    algo, model = _algo({"rounds": 20, "schedule_rounds": 10}, tau0=2.0)
    assert algo.tau(6) == pytest.approx(2.0 * 5.001 / 10)
    assert algo.tau(15) == pytest.approx(2.0 * 1.001 / 10)


def test_base_fedavg_ignores_mu_fedprox_adds_the_proximal_gradient():
    for base, expected in (("fedavg", 0.0), ("fedprox", 0.5)):
        algo, model = _algo(fednn_base=base, mu=0.5)
        algo.begin_round(1)
        for grad in gradients_after_shift(algo, model):
            torch.testing.assert_close(grad, torch.full_like(grad, expected))


def test_a_round_of_training_freezes_at_low_tau_and_uploads_int_choices():
    torch.manual_seed(0)  # Gumbel draws: a pair closer than ~17 tau is not one-hot in float32
    algo, model = _algo({"rounds": 1000})
    algo.begin_round(1000)  # tau = 5 * 1.001 / 1000: draws are one-hot
    algo.begin_local(None, model, {})
    x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 10, (4,))
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    algo.after_backward(None, model)
    assert all(int(model.state_dict()[k]) in (0, 1) for k in algo.choice_keys)


def _adapted(**options):
    algo, model = _algo(**options)
    return algo, type(algo).adapt_model(model, algo.cfg)


def test_agn_mix_and_evaluation_noise_default_to_the_authors_code():
    for options, mix, noise in (({}, "var", True), ({"agn_mix": "std", "agn_eval": "softmax"}, "std", False)):
        _, model = _adapted(**options)
        layers = [m for m in model.modules() if isinstance(m, AdaptiveGroupNorm)]
        assert layers and all(m.mix == mix and m.eval_noise == noise for m in layers)


def test_evaluation_draws_are_seeded_per_client_and_round_evaluated():
    algo, model = _adapted()
    model.eval()
    x = torch.randn(2, 3, 28, 28)
    client = ClientState(ClientSpec(id=4, domain="d", rows={}), {})
    algo.begin_eval(model, 3)
    outputs = []
    for junk in (1, 2):  # whatever the generator's state before, the same draws
        torch.manual_seed(junk)
        algo.global_private(client, {})
        outputs.append(model(x))
    torch.manual_seed(personalization_seeds(0, 4, 3)[1])
    torch.testing.assert_close(outputs[0], outputs[1], rtol=0, atol=0)
    torch.testing.assert_close(model(x), outputs[0], rtol=0, atol=0)
    algo.begin_eval(model, 4)
    algo.global_private(client, {})
    assert not torch.equal(model(x), outputs[0])


@pytest.mark.parametrize("bad", [{"fednn_base": "scaffold"}, {"tau0": 0.0}, {"agn_mix": "sd"}, {"agn_eval": "noisy"}])
def test_bad_options(bad):
    with pytest.raises(MpiflError):
        _adapted(**bad)
