"""The simulated clock: who takes part in each message, how much local work each does, and when (docs/clients.md).

A client's time in a task is ``download bytes / its download bandwidth + local steps x B / its speed + upload bytes
/ its upload bandwidth`` (:mod:`mpifl.plan.profiles`; B the batch size, the bytes those of the round's wire
manifest).  Everything here is computed from the seed, the profiles and the plan alone, identically on every rank,
before anyone trains: who is online and who drops out are drawn from (seed, round) (one uniform per client,
taken by client id), so a run's conditions and its simulated time do not depend on the number of ranks, and a
resumed run recomputes them.  A message's :class:`Fate` says which clients train (and how many steps, where cut),
whose uploads reach rank 0 in it, and the simulated seconds it takes.

**Synchronous rounds** (:class:`SyncClock`): the round samples its K = max(1, round(C N)) clients (``--fraction``
C), x ``--over-select`` F, among the clients online at its start; each then

1. drops out before training with probability ``--drop-before`` (no work, no upload);
2. with a ``--deadline`` D, is late if its time exceeds D: ``--late drop`` leaves it out (it does not train: the
   server cancels it), ``--late partial`` cuts it to the steps that fit, floor((D - its transfer time) x speed /
   B) (FedProx's partial work, Li et al., MLSys 2020), and leaves it out if none fit;
3. loses its upload with probability ``--drop-after``: it trains (and keeps what its method keeps) but its upload
   never arrives;
4. under over-selection, only the first K uploads to arrive count (ties by client id); the others are cancelled
   and do not train.

The round lasts until its last counted upload arrives; with a deadline that left a client out, until D; a round
whose clients all dropped out lasts as long as its longest training.  The server learns of a lost upload at once.

**Asynchronous aggregation** (:class:`AsyncClock`, FedBuff and FedAsync): ``concurrency`` clients train at once;
each task starts on the model version of its start and arrives after its time; the server adds arrivals to a
buffer and takes a step when it holds ``buffer`` of them (FedBuff's K; FedAsync: 1).  A task whose upload will be
lost (``--drop-after``) is not trained: it holds its slot until its upload would have arrived.  After every arrival
(or lost upload) the free slots are filled at once by clients sampled uniformly among those online, idle, not waiting in
the buffer, and not started on the current version already.  Message j carries version j-1: its clients train the
tasks that start on it, and its uploads are the arrivals of step j (trained then or earlier: a client rank holds a
task's upload until its step).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ..errors import MpiflError
from .profiles import Profiles
from .seeding import conditions_rng, participants, sample_among, sample_size

ONLINE, DROPS, ASYNC_ONLINE, ASYNC_SAMPLE, ASYNC_LOST = 1, 2, 3, 4, 5  # the draws' purposes


@dataclass(frozen=True)
class Fate:
    """One message's clients and simulated time."""

    start: float  # simulated seconds at its start
    seconds: float  # its simulated duration
    trains: dict[int, int | None]  # client -> step cap (None: its full local work), ascending ids
    uploads: tuple[int, ...]  # whose uploads reach rank 0 in this message, ascending
    holds: tuple[int, ...] = ()  # trained now, their uploads go up at a later step (asynchronous)
    staleness: tuple[int, ...] = ()  # per upload, server steps since the version it trained on (asynchronous)
    missing: dict[str, tuple[int, ...]] = field(default_factory=dict)  # why others took no part, or no full part

    def record(self) -> dict:
        """The message's simulated clock for ``metrics.jsonl``."""
        out = {"seconds": self.seconds, "time": self.start + self.seconds}
        if list(self.trains) != list(self.uploads):  # those who downloaded and trained, where not the uploads
            out["trained"] = list(self.trains)
        out.update((why, list(clients)) for why, clients in self.missing.items() if clients)
        cut = {str(c): s for c, s in self.trains.items() if s is not None}
        if cut:
            out["cut"] = cut
        if self.staleness:
            out["staleness"] = list(self.staleness)
        return out


def plain_fate(sampled: np.ndarray) -> Fate:
    """A message without simulated conditions: every sampled client trains fully and uploads."""
    clients = tuple(int(c) for c in sampled)
    return Fate(start=0.0, seconds=0.0, trains=dict.fromkeys(clients), uploads=clients)


@dataclass(frozen=True)
class Work:
    """What a clock needs of the run: the training clients (ascending), each client's full local steps by id,
    the batch size, and the bytes a client downloads and uploads in a round (``wire(round)``)."""

    training: np.ndarray
    steps: np.ndarray
    batch_size: int
    wire: Callable[[int], tuple[int, int]]

    def transfer(self, profiles: Profiles, clients: np.ndarray, round_index: int) -> np.ndarray:
        down, up = self.wire(round_index)
        return down / profiles.down[clients] + up / profiles.up[clients]

    def step_seconds(self, profiles: Profiles, clients: np.ndarray) -> np.ndarray:
        return self.batch_size / profiles.speed[clients]


class SyncClock:
    """Synchronous rounds under the round policy (module docstring), each round's :class:`Fate` computed once."""

    def __init__(self, profiles: Profiles, work: Work, seed: int, fraction: float, *, over_select: float = 1.0,
                 deadline: float = 0.0, late: str = "drop", drop_before: float = 0.0, drop_after: float = 0.0,
                 poisson: bool = False):
        self.profiles, self.work, self.seed, self.fraction = profiles, work, seed, fraction
        self.over_select, self.deadline, self.late = over_select, deadline, late
        self.drop_before, self.drop_after, self.poisson = drop_before, drop_after, poisson
        self.fates: list[Fate] = []

    def fate(self, round_index: int) -> Fate:
        while len(self.fates) < round_index:
            start = self.fates[-1].start + self.fates[-1].seconds if self.fates else 0.0
            self.fates.append(self._round(len(self.fates) + 1, start))
        return self.fates[round_index - 1]

    def _round(self, r: int, start: float) -> Fate:
        ids, n = self.work.training, len(self.profiles.speed)
        wanted = sample_size(len(ids), self.fraction)
        if self.poisson:  # client-level DP's sampling, which its accountant assumes (no other condition)
            sampled = ids[participants(self.seed, r, len(ids), self.fraction, poisson=True)]
        else:
            online = ids[self.profiles.available(ids, conditions_rng(self.seed, ONLINE, r).random(n), start)]
            sampled = sample_among(self.seed, r, online, math.ceil(self.over_select * wanted - 1e-9))
        draws = conditions_rng(self.seed, DROPS, r).random((n, 2))
        before = sampled[draws[sampled, 0] < self.drop_before]
        going = sampled[draws[sampled, 0] >= self.drop_before]
        transfer = self.work.transfer(self.profiles, going, r)
        step = self.work.step_seconds(self.profiles, going)
        steps = self.work.steps[going]
        finish = transfer + steps * step
        cap: dict[int, int | None] = {}
        late = []
        for k, client in enumerate(going):
            cap[int(client)] = None
            if self.deadline and finish[k] > self.deadline:
                fits = math.floor((self.deadline - transfer[k]) / step[k]) if self.late == "partial" else 0
                if fits >= 1:
                    cap[int(client)] = min(fits, int(steps[k]))
                    finish[k] = transfer[k] + cap[int(client)] * step[k]
                else:
                    late.append(int(client))
                    del cap[int(client)]
        ending = {int(c): float(f) for c, f in zip(going, finish) if int(c) in cap}
        lost = [c for c in ending if draws[c, 1] < self.drop_after]
        arriving = sorted((c for c in ending if c not in lost), key=lambda c: (ending[c], c))
        over = arriving[wanted:] if self.over_select > 1 else []
        kept = sorted(arriving[:len(arriving) - len(over)])
        if over:  # the K-th arrival ends the round: whoever still trains then is cancelled, a lost one too
            seconds = ending[arriving[wanted - 1]]
            over += [c for c in lost if ending[c] > seconds]
            lost = [c for c in lost if ending[c] <= seconds]
        elif late:
            seconds = self.deadline
        else:
            seconds = max((ending[c] for c in kept), default=max((ending[c] for c in lost), default=0.0))
        for c in over:
            del cap[c]
        missing = {"dropped_before": tuple(int(c) for c in before), "late": tuple(late),
                   "over_selected": tuple(sorted(over)), "lost": tuple(sorted(lost))}
        return Fate(start=start, seconds=float(seconds), trains=dict(sorted(cap.items())), uploads=tuple(kept),
                    missing=missing)


@dataclass
class _Task:
    client: int
    version: int  # the model version it trains on
    lost: bool
    step: int = 0  # the server step that applies it (0: not yet known)


class AsyncClock:
    """Asynchronous aggregation's schedule (module docstring): message j's :class:`Fate` is server step j's."""

    def __init__(self, profiles: Profiles, work: Work, seed: int, concurrency: int, buffer: int,
                 drop_after: float = 0.0):
        self.profiles, self.work, self.seed = profiles, work, seed
        self.concurrency, self.buffer, self.drop_after = concurrency, buffer, drop_after
        self.time, self.version, self.event = 0.0, 0, 0
        self.in_flight: list[tuple[float, int, _Task]] = []  # (arrival time, client, task), a heap
        self.waiting: list[_Task] = []  # arrived, in the buffer
        self.started: list[list[_Task]] = [[]]  # the tasks started on each version
        self.steps: list[float] = [0.0]  # the simulated time of each version
        self.arrivals: list[list[_Task]] = []  # the tasks each server step applies
        self.fates: dict[int, Fate] = {}

    def fate(self, step: int) -> Fate:
        if step not in self.fates:
            while self.version < step:
                self._next_event()
            trains = self.started[step - 1]
            arrivals = sorted(self.arrivals[step - 1], key=lambda t: t.client)
            self.fates[step] = Fate(
                start=self.steps[step - 1], seconds=self.steps[step] - self.steps[step - 1],
                trains={t.client: None for t in sorted(trains, key=lambda t: t.client) if not t.lost},
                uploads=tuple(t.client for t in arrivals), holds=tuple(sorted(
                    t.client for t in trains if not t.lost and t.step != step)),
                staleness=tuple(step - 1 - t.version for t in arrivals),
                missing={"lost": tuple(sorted(t.client for t in trains if t.lost))})
        return self.fates[step]

    def _next_event(self) -> None:
        """Fill the free slots, then take the next arrival (and the step it completes)."""
        self._fill()
        arrival, _, task = heapq.heappop(self.in_flight)
        self.time = arrival
        if task.lost:
            return
        self.waiting.append(task)
        if len(self.waiting) == self.buffer:
            self.version += 1
            for waiting in self.waiting:
                waiting.step = self.version
            self.arrivals.append(self.waiting)
            self.waiting = []
            self.steps.append(self.time)
            self.started.append([])

    def _fill(self) -> None:
        """Start tasks until ``concurrency`` are in flight, among the clients free to start one; with none in
        flight and none free, wait for the next one a trace makes available."""
        n = len(self.profiles.speed)
        while len(self.in_flight) < self.concurrency:
            busy = {c for _, c, _ in self.in_flight} | {t.client for t in self.waiting}
            busy |= {t.client for t in self.started[self.version] if not t.lost}
            ids = np.array([c for c in self.work.training if c not in busy], dtype=np.int64)
            self.event += 1
            free = ids[self.profiles.available(ids, conditions_rng(self.seed, ASYNC_ONLINE, self.event).random(n),
                                               self.time)] if len(ids) else ids
            want = self.concurrency - len(self.in_flight)
            if len(free):
                rng = conditions_rng(self.seed, ASYNC_SAMPLE, self.event)
                chosen = np.sort(free[rng.choice(len(free), size=min(want, len(free)), replace=False)])
                lost = conditions_rng(self.seed, ASYNC_LOST, self.event).random(n) < self.drop_after
                seconds = (self.work.transfer(self.profiles, chosen, self.version + 1)
                           + self.work.steps[chosen] * self.work.step_seconds(self.profiles, chosen))
                for client, duration in zip(chosen, seconds):
                    task = _Task(int(client), self.version, bool(lost[client]))
                    self.started[self.version].append(task)
                    heapq.heappush(self.in_flight, (self.time + float(duration), int(client), task))
            if self.in_flight:
                return
            later = self.profiles.next_start(ids, self.time)
            if later is None and all(self.profiles.active[c] is not None for c in ids):
                raise MpiflError(f"no client is available after simulated second {self.time:g} and none is "
                                 "training: the trace's availability ends there; lengthen it or lower --rounds")
            self.time = later if later is not None else self.time
