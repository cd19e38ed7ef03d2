"""Client profiles: each client's compute speed, link bandwidths and availability (docs/clients.md).

A quantity is given by an option (``--client-speed``, ``--client-bandwidth``, ``--client-upload``,
``--availability``) in one of these forms, or read from a trace file (``--client-trace``,
:mod:`mpifl.plan.traces`), whose values replace the option's for the clients it names:

* a number: every client's value;
* ``lognormal:MEDIAN,SIGMA``: MEDIAN x exp(SIGMA z), z ~ N(0, 1) (a spread of device speeds);
* ``uniform:LOW,HIGH``: drawn uniformly in [LOW, HIGH];
* ``DOMAIN=NUMBER,...``: a value per domain, the default value for a domain left out.

A client's draw comes from (seed, quantity, client) (:func:`~mpifl.plan.seeding.profile_rng`), so it is the same
whoever hosts the client and however many ranks run.  Units: speed in images per second (a local step of B images
takes B / speed simulated seconds), bandwidths in MB/s (10^6 bytes), availability the probability a client is
online when a round starts (drawn from (seed, round), :mod:`mpifl.plan.clock`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..errors import MpiflError
from .clients import ClientSpec
from .seeding import profile_rng
from .traces import Intervals, read_traces

SPEED, DOWN, UP, ONLINE = 1, 2, 3, 4  # the quantities' draw purposes
DEFAULT_SPEED = 100.0  # images per second
DEFAULT_BANDWIDTH = 10.0  # MB/s, both ways
MB = 1e6


@dataclass(frozen=True)
class Spread:
    """One option's per-client quantity: ``kind`` constant, lognormal, uniform or domains."""

    flag: str
    kind: str
    params: tuple[float, ...] = ()
    by_domain: tuple[tuple[str, float], ...] = ()

    def values(self, seed: int, purpose: int, clients: Sequence[ClientSpec], default: float) -> np.ndarray:
        """Every client's value, by client id."""
        if self.kind == "constant":
            return np.full(len(clients), self.params[0])
        if self.kind == "domains":
            given = dict(self.by_domain)
            return np.array([given.get(c.domain, default) for c in clients])
        draws = np.array([profile_rng(seed, purpose, c.id).random() if self.kind == "uniform" else
                          profile_rng(seed, purpose, c.id).standard_normal() for c in clients])
        low, high = self.params
        return low + (high - low) * draws if self.kind == "uniform" else low * np.exp(high * draws)


def parse_spread(flag: str, text: str, domains: Sequence[str], *, most: float = math.inf) -> Spread:
    """``text`` of option ``flag`` as a :class:`Spread`; a value must be positive (and at most ``most``): one line
    naming the problem otherwise."""
    forms = (f"{flag} takes a number, lognormal:MEDIAN,SIGMA, uniform:LOW,HIGH or DOMAIN=NUMBER,... "
             f"(domains: {', '.join(domains)})")

    def number(word: str, what: str, least_zero: bool = False) -> float:
        try:
            value = float(word)
        except ValueError:
            raise MpiflError(f"{forms}; {word!r} is not a number") from None
        if not math.isfinite(value) or (value < 0 if least_zero else value <= 0) or value > most:
            bound = f"in (0, {most:g}]" if math.isfinite(most) else ("at least 0" if least_zero else "positive")
            raise MpiflError(f"{flag}: {what} {word} must be a finite number {bound}")
        return value

    text = text.strip()
    if ":" in text:
        kind, _, rest = text.partition(":")
        words = rest.split(",")
        if kind not in ("lognormal", "uniform") or len(words) != 2:
            raise MpiflError(f"{forms}; got {text!r}")
        if kind == "lognormal":
            return Spread(flag, kind, (number(words[0], "the median"), number(words[1], "sigma", least_zero=True)))
        low, high = number(words[0], "LOW"), number(words[1], "HIGH")
        if low > high:
            raise MpiflError(f"{flag} uniform:{low:g},{high:g}: LOW is above HIGH; swap them")
        return Spread(flag, kind, (low, high))
    if "=" in text:
        pairs = []
        for part in text.split(","):
            domain, sep, value = part.partition("=")
            if not sep or domain.strip() not in domains:
                raise MpiflError(f"{forms}; {part.strip()!r} names no domain of this run")
            pairs.append((domain.strip(), number(value.strip(), f"the value of {domain.strip()}")))
        if len(dict(pairs)) != len(pairs):
            raise MpiflError(f"{flag}: a domain is given twice in {text!r}")
        return Spread(flag, "domains", by_domain=tuple(pairs))
    return Spread(flag, "constant", (number(text, "the value"),))


@dataclass(frozen=True)
class Profiles:
    """Every client's profile, by client id: speed (images/s), download and upload bandwidth (bytes/s), the
    probability it is online at a draw, and the intervals of simulated time a trace says it is available (None:
    at any time)."""

    speed: np.ndarray
    down: np.ndarray
    up: np.ndarray
    online: np.ndarray
    active: tuple[Intervals | None, ...]

    def available(self, clients: np.ndarray, draws: np.ndarray, t: float) -> np.ndarray:
        """Which of ``clients`` are online at simulated time ``t``, given every client's uniform ``draws`` of
        the moment (by client id): online with their probability, and inside a trace's interval."""
        online = draws[clients] < self.online[clients]
        return np.array([ok and (self.active[c] is None or self.active[c].available(t))
                         for c, ok in zip(clients, online)], dtype=bool)

    def next_start(self, clients: np.ndarray, t: float) -> float | None:
        """The earliest time after ``t`` at which a trace makes one of ``clients`` available (None: never)."""
        starts = [self.active[c].next_start(t) for c in clients if self.active[c] is not None]
        starts = [s for s in starts if s is not None and s > t]
        return min(starts, default=None)


def client_profiles(speed: str, bandwidth: str, upload: str, availability: str, trace: str, seed: int,
                    clients: Sequence[ClientSpec], domains: Sequence[str]) -> Profiles:
    """The run's profiles from the options' texts ("" = the default) and the trace file(s), if any."""
    def values(text: str, flag: str, purpose: int, default: float, **bounds) -> np.ndarray:
        if not text:
            return np.full(len(clients), default)
        return parse_spread(flag, text, domains, **bounds).values(seed, purpose, clients, default)

    speeds = values(speed, "--client-speed", SPEED, DEFAULT_SPEED)
    down = values(bandwidth, "--client-bandwidth", DOWN, DEFAULT_BANDWIDTH) * MB
    up = values(upload, "--client-upload", UP, DEFAULT_BANDWIDTH) * MB if upload else down.copy()
    online = values(availability, "--availability", ONLINE, 1.0, most=1.0)
    active: list[Intervals | None] = [None] * len(clients)
    if trace:
        given = read_traces(trace, len(clients))
        for k in range(len(clients)):
            speeds[k] = given.speed[k] if given.speed[k] is not None else speeds[k]
            down[k] = given.down[k] if given.down[k] is not None else down[k]
            up[k] = given.up[k] if given.up[k] is not None else up[k]
            active[k] = given.active[k]
    return Profiles(speed=speeds, down=down, up=up, online=online, active=tuple(active))
