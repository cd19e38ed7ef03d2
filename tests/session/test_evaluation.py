"""The global model's evaluation spread over the client ranks: the same batches for any number of ranks, each on
one rank, the load even; rank 0 adds a split's batches in batch order, so the sums do not depend on who scored
what."""

from __future__ import annotations

import numpy as np
import pytest

from mpifl.algorithms import get_algorithm
from mpifl.data import DatasetManifest
from mpifl.plan.config import RunConfig
from mpifl.session.evaluation import EvalBatch, EvalPlan
from mpifl.session.session import make_session

MANIFEST = DatasetManifest(name="toy", domains=["a", "b", "c"], classes=["x", "y"], image_size=(8, 8), channels=3,
                           splits={d: {"train": 40 + 10 * i, "val": 5, "test": 5} for i, d in enumerate("abc")},
                           normalize={"mean": [0.5] * 3, "std": [0.5] * 3}, shards={}, source="", protocol={},
                           format_version=1)


def _plan(hosts, algo="fedavg", **cfg):
    options = {o.name: o.default for o in get_algorithm(algo).options}
    return make_session(RunConfig(model="smallcnn", algo=algo, algo_options=options, eval_batch_size=4, **cfg),
                        MANIFEST, num_hosts=hosts)


@pytest.mark.parametrize("algo", ["fedavg", "gperxan"])
def test_a_held_out_domain_is_scored_by_every_rank_in_the_same_batches_for_any_number_of_ranks(algo):
    sessions = {hosts: _plan(hosts, algo, holdout="c") for hosts in (1, 2, 3)}
    plans = {hosts: session.evaluation() for hosts, session in sessions.items()}
    held_out = 2  # a: client 0, b: client 1, c (all 70 rows test): client 2
    assert all(plan.batches == plans[1].batches for plan in plans.values())
    batches = plans[1].batches
    assert [(b.start, b.stop) for b in batches if b.client == held_out and b.split == 1] == [
        (start, min(start + 4, 70)) for start in range(0, 70, 4)]
    assert not [b for b in batches if b.client == held_out and b.split == 0]  # its val split is empty
    for hosts, plan in plans.items():
        assert {r for b, r in zip(plan.batches, plan.rank_of) if b.client == held_out} == set(range(1, hosts + 1))
        assert max(plan.images) - min(plan.images) <= 4  # within a batch
        personal = tuple(tuple(c for c in hosted if c != held_out) for hosted in sessions[hosts].placement)
        assert plan.personal == (personal if algo == "gperxan" else ((),) * hosts)
        assert sum(plan.images) == 90 + 20 * (algo == "gperxan")  # and the source clients' personal models


def test_a_batch_stays_on_its_clients_host_while_the_host_is_within_the_mean_load():
    session = _plan(2, clients_per_domain=2)
    plan = session.evaluation()
    host = {c: h + 1 for h, hosted in enumerate(session.placement) for c in hosted}
    moved = [b for b, r in zip(plan.batches, plan.rank_of) if r != host[b.client]]
    assert len(moved) <= 1 and max(plan.images) - min(plan.images) <= 4


def test_what_only_the_host_can_score_stays_there_and_a_drawing_method_places_a_client_whole():
    own_statistics = _plan(3, holdout="c", aug="norm")
    plan, placement = own_statistics.evaluation(), own_statistics.placement
    host = {c: h + 1 for h, hosted in enumerate(placement) for c in hosted}
    assert all(r == host[b.client] for b, r in zip(plan.batches, plan.rank_of))  # its own input statistics
    gumbel = _plan(3, "fednn", holdout="c").evaluation()
    for client in range(3):
        assert len({r for b, r in zip(gumbel.batches, gumbel.rank_of) if b.client == client}) == 1
    assert len({r for b, r in zip(gumbel.batches, gumbel.rank_of)}) > 1  # clients still go to several ranks


def test_personal_models_stay_with_their_hosts_and_nothing_of_the_global_model_is_scored_without_one():
    session = _plan(2, "fedbn")
    plan = session.evaluation()
    assert plan.batches == () and plan.personal == tuple(tuple(h) for h in session.placement)
    assert plan.images == tuple(10 * len(hosted) for hosted in session.placement)  # val 5 + test 5 each


def test_a_splits_sums_are_added_in_batch_order_whoever_scored_them():
    """1 + 1e16 - 1e16 is 0 in float64 in batch order; rank 1's batches first would give 1."""
    batches = (EvalBatch(0, 1, 0, 4), EvalBatch(0, 1, 4, 8), EvalBatch(0, 1, 8, 10))
    plan = EvalPlan(kinds=("global", "personal"), num_clients=2, batches=batches, rank_of=(2, 1, 1),
                    personal=((0,), (1,)), images=(0, 0))
    rank1 = np.array([[1e16, 2.0], [-1e16, 1.0]])  # batches 1 and 2
    rank2 = np.array([[1.0, 3.0]])  # batch 0
    personal = {0: np.full((1, 2, 3), 7.0), 1: np.full((1, 2, 3), 8.0)}
    out = plan.add_up([rank1, rank2], personal)
    assert out[0][0, 1].tolist() == [(1.0 + 1e16) - 1e16, 6.0, 10.0] == [0.0, 6.0, 10.0]
    assert (1e16 - 1e16) + 1.0 == 1.0  # the order of the ranks' parts would not give it
    assert out[0][0, 0].tolist() == [0.0, 0.0, 0.0] and out[1][0].tolist() == [[0.0] * 3] * 2
    assert (out[0][1] == 7.0).all() and (out[1][1] == 8.0).all()
