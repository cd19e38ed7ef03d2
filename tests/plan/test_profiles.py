"""Client profiles: each form of the options, draws from (seed, client) alone, a trace's values over the options',
and a refusal in one line for every bad value."""

from __future__ import annotations

import numpy as np
import pytest

from mpifl.errors import MpiflError
from mpifl.plan.clients import ClientSpec
from mpifl.plan.profiles import DEFAULT_BANDWIDTH, DEFAULT_SPEED, MB, client_profiles, parse_spread

DOMAINS = ["photo", "sketch"]


def _clients(n=6):
    return [ClientSpec(id=k, domain=DOMAINS[k % 2], rows={}) for k in range(n)]


def _profiles(speed="", bandwidth="", upload="", availability="", trace="", seed=0, clients=None):
    return client_profiles(speed, bandwidth, upload, availability, trace, seed, clients or _clients(), DOMAINS)


def test_each_form_gives_every_clients_value():
    assert np.array_equal(_profiles().speed, np.full(6, DEFAULT_SPEED))
    assert np.array_equal(_profiles().down, np.full(6, DEFAULT_BANDWIDTH * MB))
    assert np.array_equal(_profiles(speed="30").speed, np.full(6, 30.0))
    assert list(_profiles(speed="sketch=5").speed) == [DEFAULT_SPEED, 5] * 3
    assert list(_profiles(availability="photo=0.25").online) == [0.25, 1.0] * 3
    uniform = _profiles(speed="uniform:10,20").speed
    assert np.all((uniform >= 10) & (uniform <= 20)) and len(set(uniform)) == 6
    spread = _profiles(speed="lognormal:50,1", clients=_clients(400)).speed
    assert abs(np.median(spread) / 50 - 1) < 0.15 and abs(np.std(np.log(spread)) - 1) < 0.1
    both = _profiles(bandwidth="2", upload="0.5")
    assert np.array_equal(both.down, np.full(6, 2 * MB)) and np.array_equal(both.up, np.full(6, 0.5 * MB))
    assert np.array_equal(_profiles(bandwidth="3").up, np.full(6, 3 * MB))  # upload follows download


def test_a_clients_draw_depends_on_the_seed_and_the_client_only():
    some = _profiles(speed="lognormal:50,1", clients=_clients(10)).speed
    assert np.array_equal(_profiles(speed="lognormal:50,1", clients=_clients(4)).speed, some[:4])
    assert not np.array_equal(_profiles(speed="lognormal:50,1", clients=_clients(10), seed=1).speed, some)
    # speed and bandwidth are drawn apart: the same form gives them other values
    assert not np.array_equal(_profiles(bandwidth="lognormal:50,1", clients=_clients(10)).down / MB, some)


def test_a_traces_values_replace_the_options_for_the_clients_it_names(tmp_path):
    trace = tmp_path / "trace.csv"
    trace.write_text("client,speed,down,up,active\n1,7,,,\n3,,2,0.5,10-20\n")
    profiles = _profiles(speed="30", trace=str(trace))
    assert list(profiles.speed) == [30, 7, 30, 30, 30, 30]
    assert profiles.down[3] == 2 * MB and profiles.up[3] == 0.5 * MB and profiles.down[1] == DEFAULT_BANDWIDTH * MB
    draws = np.zeros(6)
    assert list(profiles.available(np.arange(6), draws, 5.0)) == [True, True, True, False, True, True]
    assert profiles.available(np.array([3]), draws, 15.0)[0]
    assert profiles.next_start(np.array([3]), 5.0) == 10.0


@pytest.mark.parametrize("flag, text, match", [
    ("--client-speed", "-3", "--client-speed: the value -3 must be a finite number positive"),
    ("--client-speed", "nan", "must be a finite number"),
    ("--client-speed", "inf", "must be a finite number"),
    ("--client-speed", "fast", "'fast' is not a number"),
    ("--client-speed", "lognormal:50", "takes a number, lognormal:MEDIAN,SIGMA"),
    ("--client-speed", "gamma:1,2", "takes a number, lognormal:MEDIAN,SIGMA"),
    ("--client-speed", "lognormal:50,-1", "sigma -1 must be a finite number at least 0"),
    ("--client-speed", "uniform:5,2", "LOW is above HIGH"),
    ("--client-bandwidth", "quickdraw=3", "'quickdraw=3' names no domain of this run"),
    ("--client-bandwidth", "photo=1,photo=2", "a domain is given twice"),
    ("--availability", "1.5", "must be a finite number in \\(0, 1\\]"),
    ("--availability", "0", "must be a finite number in \\(0, 1\\]"),
])
def test_a_bad_value_is_refused_in_one_line(flag, text, match):
    with pytest.raises(MpiflError, match=match) as refused:
        parse_spread(flag, text, DOMAINS, **({"most": 1.0} if flag == "--availability" else {}))
    assert "\n" not in str(refused.value) and flag in str(refused.value)
