import os
import pickle

import numpy as np
import pytest

from mpifl.errors import MpiflError
from mpifl.plan.traces import Intervals, Trace, read_traces

HEADER = "client,speed,down,up,active\n"


def _csv(tmp_path, rows: str, name: str = "trace.csv") -> str:
    path = tmp_path / name
    path.write_text(HEADER + rows)
    return str(path)


def _pickle(tmp_path, data, name: str) -> str:
    path = tmp_path / name
    path.write_bytes(pickle.dumps(data))
    return str(path)


def _behaviour(active, inactive, finish_time=100):
    return {"active": active, "inactive": inactive, "finish_time": finish_time, "duration": 50, "model": "x"}


# Reading back


def test_csv_is_read_back_in_its_units(tmp_path):
    path = _csv(tmp_path, "# speeds measured on a phone\n\n2,80,,,\n0,120.5,12.5,2.5,0-3600;7200-10800\n")
    trace = read_traces(path, 4)
    assert trace == Trace(speed=[120.5, None, 80.0, None], down=[12.5e6, None, None, None],
                          up=[2.5e6, None, None, None],
                          active=[Intervals((0.0, 7200.0), (3600.0, 10800.0)), None, None, None])


def test_csv_interval_bounds_may_be_written_in_exponent_form(tmp_path):
    assert read_traces(_csv(tmp_path, "0,,,,1e-3-2.5e+3\n"), 1).active == [Intervals((1e-3,), (2.5e3,))]


def test_fedscale_capacity_is_converted_and_keys_map_sorted_with_wraparound(tmp_path):
    data = {7: {"computation": 10.0, "communication": 1000.0}, 3: {"computation": 50, "communication": 8}}
    trace = read_traces(_pickle(tmp_path, data, "client_device_capacity"), 3)
    assert trace.speed == pytest.approx([1000 / 150, 1000 / 30, 1000 / 150])  # keys 3, 7, 3
    assert trace.down == trace.up == [8 * 128, 1000 * 128, 8 * 128]
    assert trace.active == [None] * 3


def test_fedscale_behaviour_repeats_every_finish_time(tmp_path):
    data = {2: _behaviour([10, 50], [20, 100]), 1: _behaviour([0], [5], finish_time=10)}
    trace = read_traces(_pickle(tmp_path, data, "client_behave_trace"), 3)
    assert trace.active == [Intervals((0.0,), (5.0,), 10.0), Intervals((10.0, 50.0), (20.0, 100.0), 100.0),
                            Intervals((0.0,), (5.0,), 10.0)]
    assert trace.speed == trace.down == trace.up == [None] * 3


def test_numpy_values_in_a_pickle_are_numbers(tmp_path):
    data = {0: {"computation": np.float64(10.0), "communication": np.int64(2)}}
    assert read_traces(_pickle(tmp_path, data, "cap.pkl"), 1).speed == pytest.approx([1000 / 30])


def test_a_capacity_and_a_behaviour_pickle_combine(tmp_path):
    capacity = _pickle(tmp_path, {0: {"computation": 1.0, "communication": 1.0}}, "cap.pkl")
    behaviour = _pickle(tmp_path, {0: _behaviour([0], [5])}, "behave.pkl")
    trace = read_traces(f"{capacity}, {behaviour}", 2)
    assert trace.speed == pytest.approx([1000 / 3] * 2)
    assert trace.active == [Intervals((0.0,), (5.0,), 100.0)] * 2


def test_a_csv_saying_nothing_of_a_quantity_combines_with_a_file_that_gives_it(tmp_path):
    csv = _csv(tmp_path, "0,5,,,\n")
    behaviour = _pickle(tmp_path, {0: _behaviour([0], [5])}, "behave.pkl")
    trace = read_traces(f"{csv},{behaviour}", 1)
    assert trace.speed == [5.0] and trace.active == [Intervals((0.0,), (5.0,), 100.0)]


# Intervals


def test_intervals_are_half_open_and_next_start_finds_the_next_one():
    once = Intervals((10.0, 30.0), (20.0, 40.0))
    assert [once.available(t) for t in (0, 10, 19.5, 20, 30, 40)] == [False, True, True, False, True, False]
    assert [once.next_start(t) for t in (0, 15, 20, 35, 40)] == [10, 15, 30, 35, None]
    assert Intervals((), ()).next_start(0) is None


def test_periodic_intervals_repeat_and_next_start_wraps_into_the_next_period():
    daily = Intervals((10.0, 30.0), (20.0, 40.0), period=50.0)
    assert [daily.available(t) for t in (60, 75, 85, 95, 110)] == [True, False, True, False, True]
    assert [daily.next_start(t) for t in (45, 62, 75, 95, 140)] == [60, 62, 80, 110, 160]
    assert Intervals((), (), period=50.0).next_start(3) is None


# Refusals: CSV


@pytest.mark.parametrize("rows, message", [
    ("0,-2,,,\n", r"trace.csv line 2: speed -2 is negative; every speed must be a positive number of images"),
    ("0,,0,,\n", r"line 2: down 0 is zero; every down must be a positive number of MB"),
    ("0,,,nan,\n", r"line 2: up nan is not finite"),
    ("0,inf,,,\n", r"line 2: speed inf is not finite"),
    ("0,fast,,,\n", r"line 2: speed 'fast' is not a number"),
    ("4,1,,,\n", r"line 2: client '4' is not a client of this run; client ids are integers 0\.\.3"),
    ("1.0,1,,,\n", r"line 2: client '1.0' is not a client"),
    ("-1,1,,,\n", r"line 2: client '-1' is not a client"),
    ("1,1,,,\n\n1,2,,,\n", r"line 4: client 1 already has a row \(line 2\)"),
    ("0,,,,0-10;5-20\n", r"line 2: active interval 5-20 overlaps the one preceding it"),
    ("0,,,,20-30;0-10\n", r"line 2: active interval 0-10 comes before the one preceding it"),
    ("0,,,,10-10\n", r"line 2: active interval 10-10 is empty \(start >= end\)"),
    ("0,,,,-5-10\n", r"line 2: active interval -5-10 starts before 0"),
    ("0,,,,10\n", r"line 2: active interval '10' is not start-end"),
    ("0,,,,0-x\n", r"line 2: active bound 'x' is not a number"),
    ("0,1,,\n", r"line 2 has 4 fields; every row has 5: client,speed,down,up,active"),
])
def test_csv_refusals_name_the_line(tmp_path, rows, message):
    with pytest.raises(MpiflError, match=message):
        read_traces(_csv(tmp_path, rows), 4)


def test_csv_with_another_header_is_refused_showing_the_expected_one(tmp_path):
    path = tmp_path / "trace.csv"
    path.write_text("# my trace\nclient,speed,up,down,active\n")
    with pytest.raises(MpiflError, match=r"trace.csv line 2: the header is 'client,speed,up,down,active'; .* "
                                         r"must be exactly client,speed,down,up,active$"):
        read_traces(str(path), 1)


# Refusals: FedScale


@pytest.mark.parametrize("entry, message", [
    ({"computation": 1.0}, r"cap.pkl key 5 has no 'communication'; every entry of FedScale's client_device"),
    ({"computation": -1.0, "communication": 1.0}, r"key 5: computation -1.0 is negative"),
    ({"computation": 1.0, "communication": 0}, r"key 5: communication 0 is zero"),
    ({"computation": float("nan"), "communication": 1.0}, r"key 5: computation nan is not finite"),
    ({"computation": "1", "communication": 1.0}, r"key 5: computation '1' is not a number"),
    ({"computation": True, "communication": 1.0}, r"key 5: computation True is not a number"),
])
def test_capacity_refusals_name_the_key(tmp_path, entry, message):
    with pytest.raises(MpiflError, match=message):
        read_traces(_pickle(tmp_path, {5: entry}, "cap.pkl"), 2)


@pytest.mark.parametrize("entry, message", [
    ({"active": [0], "finish_time": 10}, r"behave.pkl key 5 has no 'inactive'; every entry of FedScale's "
                                         r"client_behave_trace holds 'active', 'inactive', 'finish_time'"),
    (_behaviour([0, 20], [10]), r"key 5 has 2 active but 1 inactive times"),
    (_behaviour([0], [10], finish_time=0), r"key 5: finish_time 0 is zero"),
    (_behaviour([0], [10], finish_time=-3), r"key 5: finish_time -3 is negative"),
    (_behaviour([50], [150]), r"key 5: active interval 50-150 ends after finish_time 100"),
    (_behaviour([0, 5], [10, 20]), r"key 5: active interval 5-20 overlaps the one preceding it"),
    (_behaviour([30, 0], [40, 10]), r"key 5: active interval 0-10 comes before the one preceding it"),
    (_behaviour([10], [10]), r"key 5: active interval 10-10 is empty"),
    (_behaviour([-1], [10]), r"key 5: active interval -1-10 starts before 0"),
    (_behaviour([0], [float("inf")]), r"key 5: inactive time inf is not finite"),
    (_behaviour(0, [10]), r"key 5: active is a int; active must be a list"),
])
def test_behaviour_refusals_name_the_key(tmp_path, entry, message):
    with pytest.raises(MpiflError, match=message):
        read_traces(_pickle(tmp_path, {5: entry}, "behave.pkl"), 2)


# Refusals: files


@pytest.mark.parametrize("data", [
    [1, 2],
    {},
    {0: 5},
    {0: {"speed": 1}},
    {0: {"computation": 1.0, "communication": 1.0}, 1: _behaviour([0], [5])},
])
def test_a_pickle_of_neither_format_is_refused(tmp_path, data):
    with pytest.raises(MpiflError, match=r"data.pkl is neither mpifl's trace CSV .* nor a FedScale"):
        read_traces(_pickle(tmp_path, data, "data.pkl"), 1)


def test_a_file_that_is_not_a_pickle_nor_a_csv_is_refused(tmp_path):
    path = tmp_path / "trace.txt"
    path.write_text(HEADER)
    with pytest.raises(MpiflError, match=r"trace.txt cannot be unpickled \(\w+\), so it is neither"):
        read_traces(str(path), 1)


def test_a_binary_csv_is_refused(tmp_path):
    path = tmp_path / "trace.csv"
    path.write_bytes(b"\x80\x04\xff")
    with pytest.raises(MpiflError, match=r"trace.csv is not UTF-8 text, so it is neither"):
        read_traces(str(path), 1)


def test_non_integer_fedscale_keys_are_refused(tmp_path):
    with pytest.raises(MpiflError, match=r"k.pkl key 'a' is not an integer client key"):
        read_traces(_pickle(tmp_path, {"a": {"computation": 1, "communication": 1}}, "k.pkl"), 1)


def test_a_missing_file_is_refused(tmp_path):
    with pytest.raises(MpiflError, match=r"trace file .*absent.csv does not exist"):
        read_traces(str(tmp_path / "absent.csv"), 1)


def test_two_files_giving_the_same_quantity_are_refused(tmp_path):
    csv = _csv(tmp_path, "0,5,,,\n")
    capacity = _pickle(tmp_path, {0: {"computation": 1.0, "communication": 1.0}}, "cap.pkl")
    with pytest.raises(MpiflError, match=r"trace.csv and .*cap.pkl both give the clients' speed"):
        read_traces(f"{csv},{capacity}", 1)


class _RunsCode:
    def __reduce__(self):
        return os.system, ("echo pwned",)


def test_a_pickle_that_names_a_callable_is_refused_before_it_runs(tmp_path):
    path = _pickle(tmp_path, {0: {"computation": _RunsCode(), "communication": 1.0}}, "evil.pkl")
    with pytest.raises(MpiflError, match=r"evil.pkl refers to \w+\.system, which a pickle of a FedScale client "
                                         r"trace never holds"):
        read_traces(path, 1)
