"""Client traces: what a file says of each logical client's compute speed, bandwidths and availability.

:func:`read_traces` reads one file or a comma-separated list of files, each of one of three kinds, and returns a
:class:`Trace` for the run's N clients (ids ``0..N-1``); where a trace gives a value it overrides the
distribution's for that client.  Two files that both give values of the same quantity are refused.

**mpifl's trace CSV** (a ``.csv`` file)::

    # comment lines and blank lines are skipped
    client,speed,down,up,active
    0,120.5,12.5,2.5,0-3600;7200-10800
    3,80,,,

* the header is exactly ``client,speed,down,up,active``;
* ``client``: an integer id in ``0..N-1``, at most one row each; a client without a row gets no values;
* ``speed``: images per second; ``down`` and ``up``: MB per second (1 MB = 10^6 bytes), read as bytes per second;
* ``active``: ``;``-separated ``start-end`` intervals of simulated seconds, sorted and non-overlapping, with
  ``0 <= start < end``; the client is available during each half-open ``[start, end)`` (no repetition);
* any field may be empty: the trace then says nothing of that quantity for that client.

**FedScale's device capacity pickle** (``client_device_capacity``): ``{key: {'computation': c, 'communication':
b}}``.  FedScale reads ``c`` as ms of inference per sample and charges training 3x that (its
``augmentation_factor``), so ``speed = 1000 / (3 * c)`` images per second; it reads ``b`` as kbit per second with
1 kbit = 1024 / 8 bytes (model sizes in bytes / 1024 * 8), so ``down = up = 128 * b`` bytes per second.

**FedScale's availability pickle** (``client_behave_trace``): ``{key: {'active': [...], 'inactive': [...],
'finish_time': T, ...}}``.  FedScale takes ``t % T`` and counts a client active while ``active[i] <= t % T <=
inactive[i]``; here it is available during the half-open ``[active[i], inactive[i])``, repeating every ``T``
seconds (the closed end is dropped: one instant).

FedScale keys map onto mpifl clients in sorted order, wrapping around: client ``k`` takes the entry of
``sorted(keys)[k % len(keys)]``; only those entries are read.  Pickles are loaded with
:func:`~mpifl.data.arrays.load_array_pickle` (plain containers and numpy only: a pickle that names any other
global is refused before it runs).  Every refusal is one :class:`~mpifl.errors.MpiflError` line naming the file,
the CSV line or the pickle key, and the fix.
"""

from __future__ import annotations

import math
import numbers
import re
from bisect import bisect_right
from dataclasses import dataclass
from pathlib import Path

from ..data.arrays import load_array_pickle
from ..errors import MpiflError

_HEADER = ("client", "speed", "down", "up", "active")
_QUANTITIES = _HEADER[1:]
_CAPACITY_FIELDS = ("computation", "communication")
_BEHAVIOUR_FIELDS = ("active", "inactive", "finish_time")
_BYTES_PER_MB = 10 ** 6
_BYTES_PER_FEDSCALE_KBIT = 1024 / 8
_FEDSCALE_TRAINING_FACTOR = 3  # FedScale's augmentation_factor: training costs 3 inferences
_INTERVAL = re.compile(r"\s*(.+?)\s*(?<![eE])-\s*(.+?)\s*")  # start-end; a '-' after e/E is an exponent's
_CSV_INTERVAL_RULE = ("write active as ';'-separated start-end intervals of simulated seconds, sorted and "
                      "non-overlapping, with 0 <= start < end")
_FEDSCALE_INTERVAL_RULE = ("active[i]-inactive[i] must be sorted, non-overlapping intervals with "
                           "0 <= active[i] < inactive[i] <= finish_time; use FedScale's unmodified client_behave_trace")
_NEITHER = ("is neither mpifl's trace CSV (a .csv file with the header client,speed,down,up,active) nor a FedScale "
            "client_device_capacity or client_behave_trace pickle; pass one of those (see `pydoc mpifl.plan.traces`)")


@dataclass(frozen=True)
class Intervals:
    """Half-open ``[start, end)`` simulated-second intervals, sorted and disjoint, during which a client is
    available; with ``period > 0`` they repeat every ``period`` seconds (FedScale's reading: time modulo
    ``finish_time``)."""

    starts: tuple[float, ...]
    ends: tuple[float, ...]
    period: float = 0.0

    def available(self, t: float) -> bool:
        """Whether some interval holds ``t`` (``t % period`` when periodic)."""
        offset = t % self.period if self.period else t
        i = bisect_right(self.starts, offset) - 1
        return i >= 0 and offset < self.ends[i]

    def next_start(self, t: float) -> float | None:
        """The earliest time ``>= t`` at which the client is available (``t`` itself if available), None if never
        again."""
        if self.available(t):
            return t
        offset = t % self.period if self.period else t
        i = bisect_right(self.starts, offset)
        if i < len(self.starts):
            return t - offset + self.starts[i]
        if self.period and self.starts:
            return t - offset + self.period + self.starts[0]
        return None


@dataclass(frozen=True)
class Trace:
    """What a trace file says of the run's N clients; None where it says nothing of that quantity for a client."""

    speed: list[float | None]  # images per second, per client (len N)
    down: list[float | None]  # download bytes per second
    up: list[float | None]  # upload bytes per second
    active: list[Intervals | None]  # when the client is available


def read_traces(paths: str, num_clients: int) -> Trace:
    """The trace of clients ``0..num_clients-1`` from ``paths``: one file or a comma-separated list (kinds told
    apart by extension and content); a quantity given by two files is refused."""
    given: dict[str, tuple[str, list]] = {}
    files = [p.strip() for p in paths.split(",") if p.strip()]
    if not files:
        raise MpiflError(f"no trace file in {paths!r}; give one file or a comma-separated list of files")
    for path in files:
        for quantity, values in _read_file(path, num_clients).items():
            if all(v is None for v in values):
                continue
            if quantity in given:
                raise MpiflError(f"{given[quantity][0]} and {path} both give the clients' {quantity}; "
                                 f"pass only one file that gives {quantity}")
            given[quantity] = (path, values)
    return Trace(**{q: given[q][1] if q in given else [None] * num_clients for q in _QUANTITIES})


def _read_file(path: str, num_clients: int) -> dict[str, list]:
    if not Path(path).is_file():
        raise MpiflError(f"trace file {path} does not exist; check the path")
    if Path(path).suffix.lower() == ".csv":
        return _read_csv(path, num_clients)
    data = _load_pickle(path)
    read = _fedscale_reader(data, path)
    keys = sorted(data)
    return read([(keys[k % len(keys)], data[keys[k % len(keys)]]) for k in range(num_clients)], path)


# mpifl's CSV


def _read_csv(path: str, num_clients: int) -> dict[str, list]:
    values = {q: [None] * num_clients for q in _QUANTITIES}
    row_of: dict[int, int] = {}
    header_seen = False
    for number, line in enumerate(_csv_text(path).splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        fields = [f.strip() for f in line.split(",")]
        where = f"{path} line {number}"
        if not header_seen:
            if tuple(fields) != _HEADER:
                raise MpiflError(f"{where}: the header is {line.strip()!r}; the first row of a trace CSV must be "
                                 f"exactly {','.join(_HEADER)}")
            header_seen = True
            continue
        if len(fields) != len(_HEADER):
            raise MpiflError(f"{where} has {len(fields)} fields; every row has {len(_HEADER)}: "
                             f"{','.join(_HEADER)} (leave a field empty to say nothing of it)")
        client = _client_id(fields[0], where, num_clients)
        if client in row_of:
            raise MpiflError(f"{where}: client {client} already has a row (line {row_of[client]}); "
                             "give each client at most one row")
        row_of[client] = number
        for quantity, text in zip(_QUANTITIES, fields[1:]):
            if text:
                values[quantity][client] = _csv_value(quantity, text, where)
    if not header_seen:
        raise MpiflError(f"{path} has no header; the first row of a trace CSV must be exactly {','.join(_HEADER)}")
    return values


def _csv_text(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise MpiflError(f"{path} is not UTF-8 text, so it {_NEITHER}") from None


def _client_id(text: str, where: str, num_clients: int) -> int:
    if not re.fullmatch(r"[+-]?\d+", text) or not 0 <= int(text) < num_clients:
        raise MpiflError(f"{where}: client {text!r} is not a client of this run; client ids are integers "
                         f"0..{num_clients - 1}")
    return int(text)


def _csv_value(quantity: str, text: str, where: str):
    """speed in images/s; down and up: MB/s -> bytes/s; active: start-end;... -> Intervals."""
    if quantity == "speed":
        return _positive(text, where, "speed", "images per second", _float_of_text)
    if quantity in ("down", "up"):
        return _positive(text, where, quantity, "MB (10^6 bytes) per second", _float_of_text) * _BYTES_PER_MB
    return _intervals([_csv_interval(part, where) for part in text.split(";")], where, _CSV_INTERVAL_RULE)


def _csv_interval(text: str, where: str) -> tuple[float, float]:
    match = _INTERVAL.fullmatch(text)
    if match is None:
        raise MpiflError(f"{where}: active interval {text!r} is not start-end; {_CSV_INTERVAL_RULE}")
    return tuple(_number(bound, where, "active bound", _CSV_INTERVAL_RULE, _float_of_text) for bound in match.groups())


# FedScale's pickles


def _load_pickle(path: str):
    try:
        with open(path, "rb") as file:
            return load_array_pickle(file, Path(path), holds="a FedScale client trace",
                                     fix="pass FedScale's unmodified client_device_capacity or client_behave_trace, "
                                         "or mpifl's trace CSV")
    except MpiflError:
        raise
    except Exception as e:  # noqa: BLE001 - any unpickling failure is a file of neither kind
        raise MpiflError(f"{path} cannot be unpickled ({type(e).__name__}), so it {_NEITHER}") from None


def _fedscale_reader(data, path: str):
    """_read_capacity or _read_behaviour, by the fields of the entries of ``{int key: dict}``."""
    if isinstance(data, dict) and data and all(isinstance(v, dict) for v in data.values()):
        for key in data:
            if isinstance(key, bool) or not isinstance(key, numbers.Integral):
                raise MpiflError(f"{path} key {key!r} is not an integer client key; a FedScale trace maps "
                                 "integer client ids to entries")
        fields = set().union(*data.values())
        capacity, behaviour = fields & set(_CAPACITY_FIELDS), fields & set(_BEHAVIOUR_FIELDS)
        if capacity and not behaviour:
            return _read_capacity
        if behaviour and not capacity:
            return _read_behaviour
    raise MpiflError(f"{path} {_NEITHER}")


def _read_capacity(entries: list[tuple[int, dict]], path: str) -> dict[str, list]:
    """speed = 1000 / (3 * computation ms per sample) images/s; down = up = 128 * communication kbit/s bytes/s."""
    speed, bandwidth = [], []
    for key, entry in entries:
        where = f"{path} key {key}"
        _require(entry, _CAPACITY_FIELDS, where, "client_device_capacity")
        computation = _positive(entry["computation"], where, "computation", "ms per sample", _float_of_value)
        speed.append(1000 / (_FEDSCALE_TRAINING_FACTOR * computation))
        bandwidth.append(_positive(entry["communication"], where, "communication", "kbit per second",
                                   _float_of_value)
                         * _BYTES_PER_FEDSCALE_KBIT)
    return {"speed": speed, "down": bandwidth, "up": list(bandwidth)}


def _read_behaviour(entries: list[tuple[int, dict]], path: str) -> dict[str, list]:
    """active = the [active[i], inactive[i]) intervals, repeating every finish_time seconds."""
    active = []
    for key, entry in entries:
        where = f"{path} key {key}"
        _require(entry, _BEHAVIOUR_FIELDS, where, "client_behave_trace")
        period = _positive(entry["finish_time"], where, "finish_time", "seconds", _float_of_value)
        starts, ends = (_number_list(entry[field], where, field) for field in ("active", "inactive"))
        if len(starts) != len(ends):
            raise MpiflError(f"{where} has {len(starts)} active but {len(ends)} inactive times; every active time "
                             "needs its inactive time: use FedScale's unmodified client_behave_trace")
        active.append(_intervals(list(zip(starts, ends)), where, _FEDSCALE_INTERVAL_RULE, period))
    return {"active": active}


def _require(entry: dict, fields: tuple[str, ...], where: str, kind: str) -> None:
    for field in fields:
        if field not in entry:
            raise MpiflError(f"{where} has no {field!r}; every entry of FedScale's {kind} holds "
                             f"{', '.join(map(repr, fields))}")


def _number_list(value, where: str, field: str) -> list[float]:
    rule = f"{field} must be a list of simulated seconds; use FedScale's unmodified client_behave_trace"
    if not isinstance(value, (list, tuple)):
        raise MpiflError(f"{where}: {field} is a {type(value).__name__}; {rule}")
    return [_number(x, where, f"{field} time", rule, _float_of_value) for x in value]


# Numbers and intervals, for both kinds


def _float_of_text(text: str) -> float | None:
    """A CSV field's number, None if it is none."""
    try:
        return float(text)
    except ValueError:
        return None


def _float_of_value(value) -> float | None:
    """A pickled int or float (Python's or numpy's), None for anything else (a bool or a string included)."""
    return None if isinstance(value, bool) or not isinstance(value, numbers.Real) else float(value)


def _number(value, where: str, what: str, rule: str, read) -> float:
    """``read(value)`` (:func:`_float_of_text` or :func:`_float_of_value`) if it is finite, else a refusal ending
    in ``rule``."""
    number = read(value)
    if number is None:
        raise MpiflError(f"{where}: {what} {value!r} is not a number; {rule}")
    if not math.isfinite(number):
        raise MpiflError(f"{where}: {what} {value} is not finite; {rule}")
    return number


def _positive(value, where: str, what: str, unit: str, read) -> float:
    rule = f"every {what} must be a positive number of {unit}"
    number = _number(value, where, what, rule, read)
    if number <= 0:
        raise MpiflError(f"{where}: {what} {value} is {'negative' if number < 0 else 'zero'}; {rule}")
    return number


def _intervals(pairs: list[tuple[float, float]], where: str, rule: str, period: float = 0.0) -> Intervals:
    """``pairs`` checked to be sorted, disjoint, non-empty, from 0 on (and within ``period`` when periodic)."""
    for i, (start, end) in enumerate(pairs):
        shown = f"active interval {start:.15g}-{end:.15g}"
        if start < 0:
            raise MpiflError(f"{where}: {shown} starts before 0; {rule}")
        if start >= end:
            raise MpiflError(f"{where}: {shown} is empty (start >= end); {rule}")
        if period and end > period:
            raise MpiflError(f"{where}: {shown} ends after finish_time {period:.15g}; {rule}")
        if i and start < pairs[i - 1][0]:
            raise MpiflError(f"{where}: {shown} comes before the one preceding it; {rule}")
        if i and start < pairs[i - 1][1]:
            raise MpiflError(f"{where}: {shown} overlaps the one preceding it; {rule}")
    return Intervals(tuple(s for s, _ in pairs), tuple(e for _, e in pairs), period)
