"""Waiting for peers without taking a core from a rank that trains: non-blocking requests polled with sleeps
between polls, and without sleeping while bytes move.

MPICH and Open MPI spin inside blocking calls, so a server waiting for clients, or a client waiting for the next
round, would steal a core from a rank that is training.  While the peer is not there yet a wait sleeps between
polls; while the peer is inside MPI moving the same bytes it polls without sleeping.  Time spent sleeping counts as
waiting (``seconds_waiting``, its CPU time ``cpu_seconds_waiting``), time spent spinning while bytes move as
communication (``seconds_moving``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from mpi4py import MPI

from .comm import Comm, clocks

FIRST_SLEEP = 5e-5  # seconds: the first sleep between polls
LONG_WAIT_SLEEP = 0.05  # seconds: the longest sleep between polls, reached after 5 s of waiting


@dataclass
class Pending:
    """A request being waited for: its peer rank and, for a client's message, its number in that client
    rank's sequence of messages to rank 0 (from 1; 0 for the barrier's messages)."""

    peer: int
    number: int
    request: MPI.Request


class PollingComm(Comm):
    """A communicator whose waits poll their requests, sleeping up to ``max_sleep`` seconds between polls (longer
    in a long wait), and take the control messages that came in on every pass."""

    def __init__(self, rank: int, size: int, peers: list[str], timeout: float | None, *, max_sleep: float):
        super().__init__(rank, size, peers, timeout)
        self.max_sleep = max_sleep

    def wait(self, pending: list[Pending], what: str, moving: Callable[[list[Pending]], bool] = lambda p: False,
             owed: Callable[[], list[int]] = lambda: []) -> None:
        """Complete ``pending`` and wait until no peer is ``owed()`` a control message, taking control messages
        on every pass.

        While ``moving(still pending)`` holds, the peer is inside MPI moving these bytes too: poll without
        sleeping, and count the time as bytes moving.  Otherwise the peer is not there yet: sleep between
        polls, doubling from 50 us up to ``max_sleep`` (2 ms), and in a long wait up to 1 % of the time waited
        since bytes last moved (at most 50 ms): an arrival (a sender starting to send included) is noticed at
        most 2 ms or 1 % late, and a rank waiting through a 20 s round wakes about 1 000 times instead of
        10 000, which it would otherwise take from the cores of ranks that are training.
        """
        sleep = FIRST_SLEEP
        start = idle_since = time.monotonic()
        clock, cpu = clocks()
        while True:
            self._take_control()
            spinning = bool(pending) and moving(pending)
            still = [p for p in pending if not p.request.Test()]
            # a pass that completed something moved bytes (with single copy, rank 0 copies inside its calls)
            clock, cpu = self._count(spinning or len(still) < len(pending), clock, cpu)
            pending = still
            if not pending and not owed():
                return
            if spinning:
                sleep, idle_since = FIRST_SLEEP, time.monotonic()
                continue
            if self.timeout is not None and time.monotonic() - start > self.timeout:
                raise self.timed_out(what, sorted({p.peer for p in pending} | set(owed())))
            time.sleep(sleep)
            clock, cpu = self._count(False, clock, cpu)
            longest = min(LONG_WAIT_SLEEP, (time.monotonic() - idle_since) / 100)
            sleep = min(sleep * 2, max(self.max_sleep, longest))

    def wait_until(self, done: Callable[[], bool], what: str, missing: list[int]) -> None:
        """Take control messages and call ``done()`` until it holds, sleeping between passes (doubling from 50 us
        up to ``max_sleep``; the sleeps count as waiting); a timeout names the ranks ``missing``."""
        sleep, start = FIRST_SLEEP, time.monotonic()
        while True:
            self._take_control()
            if done():
                return
            if self.timeout is not None and time.monotonic() - start > self.timeout:
                raise self.timed_out(what, missing)
            with self._waiting():
                time.sleep(sleep)
            sleep = min(sleep * 2, self.max_sleep)

    def _take_control(self) -> None:
        """Take the control messages that came in (on every pass of a wait)."""
        raise NotImplementedError
