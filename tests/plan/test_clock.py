"""The simulated clock's rules, by hand: deadlines (dropped, or cut to exactly the steps that fit), dropouts,
over-selection, availability, today's sample without conditions, and FedBuff's schedule (K arrivals a step, each
task's staleness, held uploads)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from mpifl.plan.clock import AsyncClock, SyncClock, Work
from mpifl.plan.profiles import Profiles
from mpifl.plan.seeding import sample_clients
from mpifl.plan.traces import Intervals

MB = 1e6


def _profiles(speed, online=None, active=None, bandwidth=MB):
    n = len(speed)
    return Profiles(speed=np.array(speed, dtype=float), down=np.full(n, bandwidth), up=np.full(n, bandwidth),
                    online=np.ones(n) if online is None else np.array(online, dtype=float),
                    active=tuple(active or [None] * n))


def _work(n, steps=10, batch=2, wire=(MB, MB)):
    return Work(np.arange(n), np.full(n, steps), batch, lambda r: wire)


def test_a_client_past_the_deadline_is_dropped_or_cut_to_exactly_the_steps_that_fit():
    # transfer 1 s down + 1 s up; 10 steps of 2 images: 0.2, 0.4, 2 and 20 s a step
    profiles = _profiles([10, 5, 1, 0.1])
    finish = [2 + 10 * 2 / s for s in (10, 5, 1, 0.1)]
    assert finish == [4, 6, 22, 202]
    dropped = SyncClock(profiles, _work(4), seed=0, fraction=1.0, deadline=8).fate(1)
    assert dropped.trains == {0: None, 1: None} and dropped.uploads == (0, 1)
    assert dropped.missing["late"] == (2, 3) and dropped.seconds == 8  # the server waits to the deadline
    partial = SyncClock(profiles, _work(4), seed=0, fraction=1.0, deadline=8, late="partial").fate(1)
    assert partial.trains == {0: None, 1: None, 2: math.floor((8 - 2) / 2.0)}  # 3 steps of 2 s fit, not 4
    assert partial.uploads == (0, 1, 2) and partial.missing["late"] == (3,)  # not one 20 s step fits
    assert partial.seconds == 8  # client 2 ends its 3 steps at 2 + 6 = 8
    waiting = SyncClock(profiles, _work(4), seed=0, fraction=1.0).fate(2)
    assert waiting.start == 202 and waiting.seconds == 202 and waiting.uploads == (0, 1, 2, 3)


def test_rounds_follow_one_another_on_the_clock_and_repeat_whatever_order_they_are_asked_in():
    profiles = _profiles(np.linspace(5, 50, 8))
    kw = dict(seed=4, fraction=0.5, deadline=3.0, late="partial", drop_before=0.2, drop_after=0.2, over_select=1.5)
    clock = SyncClock(profiles, _work(8), **kw)
    fates = [clock.fate(r) for r in range(1, 13)]
    assert fates[7] == SyncClock(profiles, _work(8), **kw).fate(8)
    for before, after in zip(fates, fates[1:]):
        assert after.start == before.start + before.seconds
    assert {why for f in fates for why, who in f.missing.items() if who} == {"dropped_before", "lost",
                                                                           "over_selected"}


def test_dropouts_before_training_do_no_work_and_after_training_train_without_uploading():
    clock = SyncClock(_profiles([10] * 20), _work(20), seed=1, fraction=1.0, drop_before=0.3, drop_after=0.3)
    for r in range(1, 6):
        fate = clock.fate(r)
        before, lost = set(fate.missing["dropped_before"]), set(fate.missing["lost"])
        assert before and lost
        assert not before & set(fate.trains) and not before & set(fate.uploads)
        assert lost <= set(fate.trains) and not lost & set(fate.uploads)
        assert set(fate.trains) == set(fate.uploads) | lost and set(fate.uploads) | before | lost == set(range(20))


def test_over_selection_keeps_the_first_k_uploads_to_arrive_and_cancels_the_others():
    speeds = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    fate = SyncClock(_profiles(speeds), _work(10), seed=0, fraction=0.3, over_select=2.0).fate(1)
    sampled = set(fate.uploads) | set(fate.missing["over_selected"])
    assert len(sampled) == 6 and len(fate.uploads) == 3  # K = 3, 2K sampled
    assert set(fate.trains) == set(fate.uploads)  # the others do not train
    fastest = sorted(sampled, key=lambda c: -speeds[c])[:3]
    assert sorted(fastest) == list(fate.uploads)
    assert fate.seconds == pytest.approx(2 + 20 / speeds[fastest[-1]])  # the K-th arrival ends the round


def test_a_round_samples_among_the_clients_online_at_its_start():
    online = [1.0] * 5 + [1e-9] * 5  # clients 5..9 (almost) never online
    clock = SyncClock(_profiles([10] * 10, online=online), _work(10), seed=2, fraction=0.4)
    for r in range(1, 20):
        assert set(clock.fate(r).uploads) <= set(range(5)) and len(clock.fate(r).uploads) == 4
    # a trace's intervals: client 1 is away until second 10, and each round lasts 4 s
    away = [None, Intervals(starts=(10.0,), ends=(1e9,))]
    clock = SyncClock(_profiles([10, 10], active=away), _work(2), seed=0, fraction=1.0)
    assert [clock.fate(r).uploads for r in (1, 2, 3, 4)] == [(0,), (0,), (0,), (0, 1)]


def test_without_conditions_a_round_samples_todays_clients():
    clock = SyncClock(_profiles(np.full(13, 25.0)), _work(13), seed=7, fraction=0.3)
    for r in range(1, 30):
        assert clock.fate(r).uploads == tuple(sample_clients(7, r, 13, 0.3))
        assert all(steps is None for steps in clock.fate(r).trains.values())


@pytest.mark.parametrize("buffer", [1, 3])
def test_fedbuff_steps_take_k_arrivals_each_with_the_staleness_of_its_download(buffer):
    clock = AsyncClock(_profiles(np.linspace(2, 40, 12)), _work(12), seed=5, concurrency=6, buffer=buffer,
                       drop_after=0.1)
    fates = [clock.fate(j) for j in range(1, 31)]
    started = {}  # client -> the version of its task in flight
    held = set()
    for j, fate in enumerate(fates, start=1):
        assert len(fate.uploads) == buffer and len(set(fate.uploads)) == buffer
        for client, staleness in zip(fate.uploads, fate.staleness):
            version = j - 1 if client in fate.trains and client not in fate.holds else started.pop(client)
            assert staleness == j - 1 - version
            held.discard(client)
        for client in fate.holds:
            assert client in fate.trains and client not in fate.uploads
            started[client] = j - 1
            held.add(client)
        assert set(fate.trains) <= set(fate.uploads) | set(fate.holds) | set(fate.missing["lost"])
        assert not set(fate.trains) & held - set(fate.holds)  # one task per client at a time
        assert len(started) <= 6  # no more than the concurrency in flight
        assert fate.start + fate.seconds == fates[j].start if j < len(fates) else True
    assert any(s > 0 for f in fates for s in f.staleness)


def test_a_lost_task_is_not_trained_and_its_client_may_start_again_on_the_same_version():
    # two clients, both needed for a step: a lost upload must not leave the buffer waiting for ever
    clock = AsyncClock(_profiles([10, 20]), _work(2), seed=0, concurrency=2, buffer=2, drop_after=0.5)
    fates = [clock.fate(j) for j in range(1, 41)]
    lost = [c for f in fates for c in f.missing["lost"]]
    assert lost and all(len(f.uploads) == 2 for f in fates)
    assert all(not set(f.missing["lost"]) & set(f.trains) - set(f.uploads) - set(f.holds) for f in fates)


def test_over_selection_cancels_a_lost_client_still_training_at_the_kth_arrival():
    speeds = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    clock = SyncClock(_profiles(speeds), _work(10), seed=0, fraction=0.3, over_select=3.0, drop_after=0.5)
    checked = 0
    for r in range(1, 30):
        fate = clock.fate(r)
        assert not set(fate.missing["over_selected"]) & set(fate.trains)
        if fate.missing["over_selected"]:  # K uploads arrived: a lost client trained only if it ended by then
            checked += 1
            assert all(c in fate.trains and 2 + 20 / speeds[c] <= fate.seconds + 1e-9 for c in fate.missing["lost"])
    assert checked
