"""COPA: averaged body, every client's head stacked in client-id order and sent to all, frozen-head
collaboration in the local loss, global model = body + ensemble of the heads."""

import contextlib
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mpifl.algorithms import Uploads
from mpifl.algorithms.copa import ensemble_logits, heads_logits
from mpifl.analysis import load_checkpointed
from mpifl.errors import MpiflError
from mpifl.plan.clients import ClientSpec

from ..conftest import read_metrics, run_here
from ..rundir.test_checkpoint import numbers
from .helpers import aggregate, client_meta, make_algo

HEAD = ("classifier.weight", "classifier.bias")
WEIGHT, BIAS = "copa.heads/classifier.weight", "copa.heads/classifier.bias"


def _spec(cid, trains=True):
    none = np.arange(0)
    return ClientSpec(id=cid, domain="d", rows={"train": np.arange(4), "val": none, "test": none}, trains=trains)


def _algo(ids=(0, 1, 2, 3), held_out=(2,), **options):
    """COPA on SmallCNN (10 classes, 64 features) bound to clients ``ids``, ``held_out`` not training."""
    algo, model = make_algo("copa", **options)
    algo.bind_clients([_spec(c, c not in held_out) for c in ids])
    return algo, model


def test_the_body_travels_the_head_stays_and_all_n_heads_come_down():
    algo, model = _algo()
    policy = algo.policy()
    body = [k for k in model.state_dict() if k not in HEAD and not k.endswith("num_batches_tracked")]
    assert [s.name for s in policy.upload] == body + ["copa.head/classifier.weight", "copa.head/classifier.bias"]
    assert [s.name for s in policy.download] == body + [WEIGHT, BIAS]
    assert {s.name: s.shape for s in policy.download[-2:]} == {WEIGHT: (3, 10, 64), BIAS: (3, 10)}
    assert set(HEAD) <= {s.name for s in policy.private} and algo.evaluates == ("global", "personal")
    body_bytes = sum(model.state_dict()[k].numel() * 4 for k in body)
    head_bytes = (10 * 64 + 10) * 4
    assert sum(s.nbytes for s in policy.upload) == body_bytes + head_bytes
    assert sum(s.nbytes for s in policy.download) == body_bytes + 3 * head_bytes  # N = 3 training clients


def test_ensemble_of_probabilities_and_of_logits_by_hand():
    """Two heads on the feature (log 3, 0): logits (log 3, 0) and (0, 0), i.e. probabilities (3/4, 1/4) and
    (1/2, 1/2); their mean (5/8, 3/8); the mean logit (log 3 / 2, 0)."""
    weight = torch.tensor([[[1.0, 0.0], [0.0, 1.0]], [[0.0, 0.0], [0.0, 0.0]]])
    bias = torch.zeros(2, 2)
    logits = heads_logits(torch.tensor([[math.log(3.0), 0.0]]), weight, bias)
    assert torch.allclose(logits, torch.tensor([[[math.log(3.0), 0.0]], [[0.0, 0.0]]]))
    prob = ensemble_logits(logits, "prob")
    assert torch.allclose(prob, torch.log(torch.tensor([[5 / 8, 3 / 8]])))
    assert torch.allclose(F.cross_entropy(prob, torch.tensor([1])), torch.tensor(-math.log(3 / 8)))
    assert torch.allclose(ensemble_logits(logits, "logit"), torch.tensor([[math.log(3.0) / 2, 0.0]]))


@pytest.mark.parametrize("rule", ["prob", "logit"])
def test_the_global_model_is_the_ensemble_of_the_downloaded_heads_and_the_personal_one_its_own_head(rule):
    torch.manual_seed(0)
    algo, model = _algo(copa_ensemble=rule)
    model.eval()
    client = algo.init_client(_spec(1), model.state_dict())
    weight, bias = torch.randn(3, 10, 64), torch.randn(3, 10)
    download = {WEIGHT: weight, BIAS: bias}
    x = torch.randn(2, 3, 28, 28)
    features = model.encode(x)
    algo.begin_eval(model, 1)
    algo.begin_eval(model, 2)  # hooked once
    algo.global_private(client, download)
    per_head = [F.linear(features, weight[j], bias[j]) for j in range(3)]
    if rule == "prob":
        expected = torch.log(sum(F.softmax(z, 1) for z in per_head) / 3)
    else:
        expected = sum(per_head) / 3
    assert torch.allclose(model(x), expected, atol=1e-5)
    algo.personalize(client, model, fit=None)
    assert torch.allclose(model(x), model.classifier(features)) and torch.equal(model(x), F.linear(
        features, model.classifier.weight, model.classifier.bias))


def test_heads_are_stacked_in_client_id_order_and_an_unsampled_clients_head_is_kept():
    algo, model = _algo()  # training clients 0, 1, 3 -> rows 0, 1, 2; client 2 held out
    initial = model.state_dict()
    server = algo.init_server(initial)
    for key in HEAD:
        assert all(torch.equal(row, initial[key]) for row in server.extra["copa.heads/" + key])
    names = [s.name for s in algo.policy().upload]

    def uploads(clients, values):
        shapes = {s.name: s.shape for s in algo.policy().upload}
        return Uploads(clients=np.array(clients), meta=client_meta([1] * len(clients)),
                       tensors={n: [np.full(shapes[n], v, np.float32) for v in values] for n in names})

    aggregate(algo, server, uploads([1, 3], [1.0, 3.0]))
    down = algo.download(server)
    assert torch.equal(down[WEIGHT][0], initial["classifier.weight"])  # client 0 not sampled yet
    assert (down[WEIGHT][1] == 1.0).all() and (down[WEIGHT][2] == 3.0).all() and (down[BIAS][2] == 3.0).all()
    assert (down["conv1.weight"] == 2.0).all()  # the bodies' mean
    aggregate(algo, server, uploads([0], [5.0]))
    down = algo.download(server)
    assert (down[WEIGHT][0] == 5.0).all() and (down[WEIGHT][1] == 1.0).all() and (down[WEIGHT][2] == 3.0).all()


def test_local_loss_is_own_head_ce_plus_lambda_times_the_frozen_other_heads_ce():
    torch.manual_seed(0)
    algo, model = _algo(copa_frozen_weight=0.5)
    client = algo.init_client(_spec(3), model.state_dict())  # row 2
    weight, bias = torch.randn(3, 10, 64), torch.randn(3, 10)
    weight[2] += 100.0  # client 3's own row: never a frozen term
    algo.begin_local(client, model, {WEIGHT: weight, BIAS: bias})
    x, y = torch.randn(4, 3, 28, 28), torch.tensor([0, 1, 2, 3])
    loss, logits = algo.batch_loss(client, model, x, y)
    features = model.encode(x)
    frozen = sum(F.cross_entropy(F.linear(features, weight[j], bias[j]), y) for j in (0, 1))
    assert torch.allclose(logits, model.classifier(features))
    assert torch.allclose(loss, F.cross_entropy(model.classifier(features), y) + 0.5 * frozen, atol=1e-5)
    loss.backward()
    assert model.classifier.weight.grad.abs().sum() > 0 and model.conv1.weight.grad.abs().sum() > 0


def test_bad_options_are_one_line_errors():
    with pytest.raises(MpiflError, match="--copa-ensemble must be one of prob, logit"):
        make_algo("copa", copa_ensemble="vote")
    with pytest.raises(MpiflError, match="--copa-frozen-weight must be >= 0"):
        make_algo("copa", copa_frozen_weight=-1.0)


def _args(data_root, out, *extra):
    return ["--data-root", str(data_root), "--model", "smallcnn", "--algo", "copa", "--holdout", "street",
            "--clients-per-domain", "2", "--fraction", "0.5", "--samples-per-client", "64", "--threads", "1",
            "--lr", "0.05", "--out", str(out), *extra]


@contextlib.contextmanager
def _one_thread():
    """Torch on one thread for the hand computations, as the runs (``--threads 1``): small tensors on shared
    cores go several times faster."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _features(ckpt, cid, state):
    """The body's features of client ``cid``'s test split (in the run's evaluation batches) and the labels."""
    model = ckpt.build(state)
    batches = list(ckpt.client_data(cid).eval_batches("test", ckpt.cfg.eval_batch_size))
    with torch.no_grad():
        return torch.cat([model.encode(x) for x, _ in batches]), torch.cat([y for _, y in batches])


def _accuracy(reported, scores, y):
    """The reported accuracy is the hand one, up to the images whose two best scores tie within 1e-6 (either
    may win between two computations)."""
    top = scores.topk(2, dim=1).values
    ties = int(((top[:, 0] - top[:, 1]) < 1e-6).sum())
    assert abs(reported - float((scores.argmax(1) == y).double().mean())) <= ties / len(y) + 1e-12


def _heads_are_the_participants_own(ckpt, participants):
    """After round 1: a participant's row of the server's stack is the head it kept (bit for bit), every other
    training client's row still the seeded initial head (heads are assembled, never averaged)."""
    for key in HEAD:
        stack, initial = ckpt.extra["copa.heads/" + key], ckpt.session.initial[key]
        for cid, row in ckpt.algo.row.items():
            if cid in participants:
                assert torch.equal(stack[row], ckpt.private[cid][key]), (cid, key)
                assert not torch.allclose(stack[row], initial, rtol=0, atol=1e-4), (cid, key)  # it trained
            else:
                assert torch.equal(stack[row], initial), (cid, key)


def _evaluation_by_hand(ckpt, evaluated):
    """The round's reported test metrics, from the checkpoint by hand: the global model is the averaged body
    under the mean softmax probability of the server's N stacked heads (``--copa-ensemble prob``), the
    personal model the body under the client's own head."""
    assert ckpt.cfg.opt("copa_ensemble") == "prob"
    weight, bias = ckpt.extra[WEIGHT], ckpt.extra[BIAS]
    assert len(weight) == 8  # every training client's head, also the ones not sampled yet
    margins = {"own head": [], "mean logit": []}
    for cid in range(len(ckpt.session.clients)):
        state = ckpt.personal_state(cid)
        features, y = _features(ckpt, cid, state)
        probs = torch.stack([F.softmax(F.linear(features, weight[j], bias[j]), 1) for j in range(8)]).mean(0)
        own = F.linear(features, state["classifier.weight"], state["classifier.bias"])
        reported = evaluated["global"]["test"]["clients"][str(cid)]
        assert reported["n"] == len(y)
        _accuracy(reported["acc"], probs, y)
        assert reported["loss"] == pytest.approx(-float(probs[torch.arange(len(y)), y].double().log().mean()), abs=1e-6)
        mean_logit = F.cross_entropy(F.linear(features, weight.mean(0), bias.mean(0)), y)
        margins["own head"].append(abs(reported["loss"] - float(F.cross_entropy(own, y))))
        margins["mean logit"].append(abs(reported["loss"] - float(mean_logit)))
        if ckpt.session.clients[cid].trains:
            reported = evaluated["personal"]["test"]["clients"][str(cid)]
            _accuracy(reported["acc"], own, y)
            assert reported["loss"] == pytest.approx(float(F.cross_entropy(own, y)), abs=1e-6)
    # the check tells the rules apart: the own head or the mean logit would miss some client by far more than 1e-6
    assert all(max(m) > 1e-5 for m in margins.values()), margins


def _round_by_hand(before, after, participants):
    """One round from the checkpoint ``before`` to ``after``, by hand: each participant's local model
    (:meth:`Checkpointed.local_state`, trained as its rank trains it); the server's body is their mean
    weighted by training samples, its stack holds each participant's trained head in the participant's row."""
    local = {cid: before.local_state(cid) for cid in participants}
    samples = {cid: before.client_data(cid).size("train") for cid in participants}
    total = sum(samples.values())
    spread = 0.0
    for key in before.algo.shared_keys:
        assert key not in HEAD and after.server[key].is_floating_point()
        mean = sum(samples[c] * local[c][key].double() for c in participants) / total
        assert torch.allclose(after.server[key].double(), mean, rtol=0, atol=1e-6), key
        spread = max(spread, max(float((local[c][key] - mean).abs().max()) for c in participants))
    assert spread > 1e-3  # the local bodies differ: a single client's body would not pass for the mean
    for key in HEAD:
        stack = after.extra["copa.heads/" + key]
        for cid, row in after.algo.row.items():
            if cid in participants:
                assert torch.allclose(stack[row], local[cid][key], rtol=0, atol=1e-6), (cid, key)
                assert not torch.allclose(stack[row], before.extra["copa.heads/" + key][row], rtol=0, atol=1e-4)
            else:
                assert torch.equal(stack[row], before.extra["copa.heads/" + key][row]), (cid, key)


@pytest.mark.slow
def test_two_rounds_in_process_with_a_held_out_domain_and_a_bit_identical_resume(data_root, tmp_path):
    full = run_here(*_args(data_root, tmp_path / "full", "--rounds", "2"))
    assert full.returncode == 0, full.stderr
    records = read_metrics(tmp_path / "full")
    # SmallCNN's conv weight and bias, float32, and its norms: COPA's IBN-a in the first two stages (IN weight
    # and bias on half the channels, BN weight, bias, running mean and variance on the other half: 3 c), BN
    # in the last (4 c)
    body = 4 * sum(c_out * (c_in * 9 + 1) + norm * c_out for c_in, c_out, norm in ((3, 16, 3), (16, 32, 3), (32, 64, 4)))
    head = 4 * (10 * 64 + 10)
    for record in records:  # 8 training clients (4 domains x 2), 4 sampled a round
        assert len(record["clients"]) == 4
        assert record["bytes"]["down"] == 4 * (body + 8 * head) and record["bytes"]["up"] == 4 * (body + head)
    evaluated = records[-1]["eval"]
    assert 0 <= evaluated["global"]["test"]["domains"]["street"]["acc"] <= 1
    assert set(evaluated["personal"]["test"]["domains"]) >= {"mono", "paper"}
    run = tmp_path / "run"
    first = run_here(*_args(data_root, run, "--rounds", "1", "--ckpt-every", "1"))
    assert first.returncode == 0, first.stderr
    # round 1 by hand from its checkpoint: the heads assembled, the reported metrics the ensemble's
    one = load_checkpointed(run)
    assert one.round == 1
    _heads_are_the_participants_own(one, read_metrics(run)[0]["clients"])
    with _one_thread():
        _evaluation_by_hand(one, read_metrics(run)[0]["eval"])
    resumed = run_here("--resume", str(run), "--rounds", "2")
    assert resumed.returncode == 0, resumed.stderr
    assert numbers(run) == numbers(tmp_path / "full")
    # round 2 by hand: from round 1's checkpoint to round 2's
    two = load_checkpointed(run)
    assert two.round == 2
    with _one_thread():
        _round_by_hand(one, two, records[1]["clients"])
