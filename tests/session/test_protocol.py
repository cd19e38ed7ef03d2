"""The round protocol: the header of every message, and every rank's part of it, from the same rules."""

from __future__ import annotations

import pytest

from mpifl.data import DatasetManifest
from mpifl.plan.config import RunConfig
from mpifl.session.protocol import RoundProtocol
from mpifl.session.session import make_session
from mpifl.transport.messages import FINAL, NO_EVAL, SAVE, STOP, TRAIN

MANIFEST = DatasetManifest(name="toy", domains=["a", "b", "c"], classes=["x", "y"], image_size=(8, 8), channels=3,
                           splits={d: {"train": 40 + 10 * i, "val": 5, "test": 5} for i, d in enumerate("abc")},
                           normalize={"mean": [0.5] * 3, "std": [0.5] * 3}, shards={}, source="", protocol={},
                           format_version=1)


def _protocol(start=0, hosts=2, **cfg):
    options = {"uniform_weights": False}
    session = make_session(RunConfig(model="smallcnn", algo_options=options, **cfg), MANIFEST, num_hosts=hosts)
    return RoundProtocol(session, start=start), session


def _headers(protocol, stop_at=None):
    return [(h.action, h.saves, h.evaluate) for h in
            (protocol.header(r, stop_requested=r == stop_at) for r in protocol.rounds())]


def test_a_run_is_one_message_per_round_then_a_final_one_evaluation_riding_on_the_next():
    protocol, _ = _protocol(rounds=5, eval_every=2, ckpt_every=2)
    assert list(protocol.rounds()) == [1, 2, 3, 4, 5, 6]
    assert _headers(protocol) == [(TRAIN, False, NO_EVAL), (TRAIN, False, NO_EVAL), (TRAIN, True, 2),
                                  (TRAIN, False, NO_EVAL), (TRAIN, True, 4), (FINAL, True, 5)]


def test_a_stop_saves_the_round_before_and_leaves_its_evaluation_to_the_resumed_run():
    protocol, _ = _protocol(rounds=5)
    assert _headers(protocol, stop_at=3)[2] == (STOP, True, NO_EVAL)
    assert _headers(protocol, stop_at=6)[5] == (FINAL, False, 5)  # after the last round: nothing to stop


def test_a_resumed_run_evaluates_the_checkpointed_round_and_does_not_save_it_again():
    protocol, _ = _protocol(start=2, rounds=4, ckpt_every=2)
    assert list(protocol.rounds()) == [3, 4, 5]
    assert _headers(protocol) == [(TRAIN, False, 2), (TRAIN, False, 3), (FINAL, True, 4)]


@pytest.mark.parametrize("algo,hosts", [("fedavg", 1), ("fedavg", 2), ("fedavg", 3), ("fedbn", 2)])
def test_every_rank_trains_its_sampled_clients_and_evaluates_its_part_when_asked(algo, hosts):
    """Its batches of the global model's evaluation (each batch on one rank), its clients' personal models."""
    protocol, session = _protocol(hosts=hosts, rounds=3, clients_per_domain=2, fraction=0.5, algo=algo)
    messages = protocol.open(2)
    plan = protocol.plan(protocol.header(2, stop_requested=False), messages)
    assert plan.uploads == tuple(int(c) for c in session.sampled(2)) and len(plan.uploads) == 3
    assert sorted(c for w in plan.work for c in w.trains) == list(plan.uploads)
    evaluation = session.evaluation()
    for rank, hosted in enumerate(session.placement, start=1):
        work = plan.of(rank)
        assert work.trains == work.uploads == tuple(c for c in hosted if c in plan.uploads) and work.holds == ()
        assert work.evaluates == (tuple(hosted) if algo == "fedbn" else ())
        assert work.scores == evaluation.scored_by(rank)
        assert plan.upload_bytes[rank] == (messages.rank.nbytes + 16 * len(work.scores)
                                           + len(work.evaluates) * messages.eval.nbytes
                                           + len(work.trains) * messages.client.nbytes)
    scored = sorted((b.client, b.split, b.start) for w in plan.work for b in w.scores)
    assert scored == sorted((b.client, b.split, b.start) for b in evaluation.batches)
    assert (len(scored) == 12) == (algo == "fedavg")  # 6 clients x (val, test), one batch each
    assert plan.upload_bytes[0] == 0
    final = protocol.plan(protocol.header(4, stop_requested=False), messages)
    assert final.uploads == () and all(w.trains == () and (w.evaluates or w.scores) for w in final.work)
    stop = protocol.plan(protocol.header(2, stop_requested=True), messages)
    assert all(w.trains == () == w.evaluates == w.scores for w in stop.work)
    assert stop.upload_bytes[1:] == (messages.rank.nbytes,) * hosts


def test_the_header_travels_with_its_flags():
    protocol, _ = _protocol(rounds=2, ckpt_every=1)
    header = protocol.header(2, stop_requested=False)
    assert header.command == TRAIN | SAVE and header.round == 2 and header.evaluate == 1
