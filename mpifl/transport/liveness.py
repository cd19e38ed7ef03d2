"""Peers watched over the network: a rank that hears nothing from a peer for ``--peer-timeout`` seconds ends
the job, naming the rank and its host.

A node that dies without its kernel closing the connections (power, a kernel panic), or that is cut off the
network, leaves its peers waiting for messages that never come, and no MPI library says so: the bytes of a TCP
connection whose other end is silent are retried for many minutes.  A slow round and a lost node look the same
to a rank that only waits for the round's messages (``--round-timeout`` must exceed the longest round), so every
rank of an MPI job also runs a thread, :class:`Heartbeats`, that sends its peers one byte every ``interval``
seconds and takes theirs, whatever the rank is doing (training, folding, waiting inside a collective): rank 0
watches every client rank, a client rank watches rank 0, as the round's messages go.

* A peer not heard from for ``timeout`` seconds is lost: the watcher calls ``on_lost`` (rank 0: the one line
  naming the ranks and hosts, then the job's end).  So is a peer for which the MPI library reports an error (a
  connection it found broken, as MPICH's ofi netmod does for a peer killed outright; MPICH's UCX netmod crashes
  the sender instead, a segmentation fault that the launcher reports).  Client ranks wait longer than rank 0
  (:data:`CLIENT_MARGIN`), so that a lost client rank is named by rank 0, whose lines reach the launcher.
* Before rank 0 ends the job it tells the client ranks (``END``), so that a client rank whose launcher is gone
  (Open MPI's ``prterun`` exits when it loses a node, leaving the other nodes' ranks running) ends too.
* The job's end is a goodbye (``BYE``), a rank's last message, said first by rank 0 once its part is done (every
  result written) and answered by each client rank once its own part is done too; until then a rank beats on.
  So rank 0's goodbyes, all answered, show every peer there at the end, right before the MPI library's
  finalization, which would wait for ever for a node lost meanwhile: :meth:`Heartbeats.goodbye` returns the peers
  silent for ``timeout`` while it waited (lost as the job ended), for the caller to end the job without them.  No
  message is left unmatched when MPI is finalized: a rank takes a peer's messages until that peer's goodbye.

The thread sends and receives on a communicator of its own (a duplicate of the world's), so its messages never
meet the round's, and needs ``MPI_THREAD_MULTIPLE`` (what mpi4py asks for).  Its cost: one byte per peer per
``interval`` (one second at the default ``--peer-timeout``).
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
from typing import Callable

import numpy as np
from mpi4py import MPI

TAG = 31010
BEAT, BYE, END = 1, 2, 3  # what a heartbeat says: alive; done (its last message); the job ends (rank 0)
CLIENT_MARGIN = 1.25  # a client rank gives rank 0 this many times the timeout before calling it lost
LONGEST_INTERVAL = 1.0  # seconds between heartbeats, at most; a tenth of the timeout below 10 s


def unwatchable() -> str | None:
    """Why this MPI library cannot watch the peers, if it cannot: the thread needs ``MPI_THREAD_MULTIPLE``."""
    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        return ("the MPI library gives no MPI_THREAD_MULTIPLE, so a node that fails or is cut off is not "
                "noticed (--peer-timeout has no effect)")
    return None


class Heartbeats:
    """This rank's watch over its peers, on a duplicate of ``world`` (a communicator of its own), once
    :meth:`start`-ed.

    ``on_lost(peers, seconds, error)`` runs on the watching thread when ``peers`` have been silent for longer than
    ``seconds`` (this rank's timeout), or at once when the MPI library reports an error for one (``error``, its
    first line; None for a silence), while this rank's part of the job is under way; ``on_end()`` when rank 0 says
    the job ends.  Neither returns.  Every message is matched: a rank takes a peer's messages until that peer's
    goodbye, and sends its peers heartbeats until its own.
    """

    def __init__(self, world: MPI.Comm, timeout: float, on_lost: Callable[[list[int], float, str | None], None],
                 on_end: Callable[[], None]):
        self.comm = world.Dup()
        self.peers = list(range(1, world.size)) if world.rank == 0 else [0]
        self.timeout = timeout * (1 if world.rank == 0 else CLIENT_MARGIN)
        self.interval = min(LONGEST_INTERVAL, timeout / 10)
        self.on_lost, self.on_end = on_lost, on_end
        self._tokens = {kind: np.array([kind], dtype=np.uint8) for kind in (BEAT, BYE, END)}
        self._inbox = np.zeros(world.size, dtype=np.uint8)  # where peer p's byte lands
        self._done = threading.Event()  # this rank's part of the job is done (goodbye)
        self._gone: list[int] = []  # the peers lost while this rank said goodbye
        self._thread = threading.Thread(target=self._watch, name="mpifl-heartbeats", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def goodbye(self) -> list[int]:
        """This rank's part is done: say goodbye (rank 0 at once, a client rank once rank 0 has) and wait until every
        peer has; the peers silent for ``timeout`` meanwhile, or whose connection failed, are not waited for and are
        returned (empty: every peer said goodbye)."""
        if self._thread.is_alive():
            self._done.set()
            self._thread.join()
        return self._gone

    def end_job(self) -> None:
        """Rank 0: tell every client rank that the job ends (waits at most one interval for the messages to leave)."""
        requests = [self.comm.Isend(self._tokens[END], dest=p, tag=TAG) for p in self.peers]
        deadline = time.monotonic() + self.interval
        while not MPI.Request.Testall(requests) and time.monotonic() < deadline:
            time.sleep(0.01)

    def _watch(self) -> None:
        heard = dict.fromkeys(self.peers, time.monotonic())
        receives = {p: self._receive(p) for p in self.peers}
        sends: list[tuple[int, MPI.Request]] = []
        said_bye, beaten, answered = False, 0.0, False  # answered: rank 0 said goodbye (a client rank's cue)
        while True:
            now = time.monotonic()
            broken: dict[int, str] = {}  # peer -> what the MPI library said of its connection
            bye = not said_bye and self._done.is_set() and (self.comm.rank == 0 or answered)
            # a beat each pass while this rank's part is under way (a pass an interval); once done, passes come ten
            # times as often, and a beat every interval
            due = not self._done.is_set() or now - beaten >= self.interval
            if bye or (not said_bye and due):
                said_bye, beaten = bye, now
                for p in self.peers:
                    with _failing(broken, p):
                        sends.append((p, self.comm.Isend(self._tokens[BYE if bye else BEAT], dest=p, tag=TAG)))
            for p in list(receives):
                with _failing(broken, p):
                    while p in receives and receives[p].Test():
                        heard[p] = now
                        kind = int(self._inbox[p])
                        if kind == END:
                            self.on_end()
                        if kind == BYE:
                            answered = True
                            del receives[p]
                        else:
                            receives[p] = self._receive(p)
            still = []
            for p, request in sends:
                with _failing(broken, p):
                    if not request.Test():
                        still.append((p, request))
            sends = [(p, request) for p, request in still if p not in broken]
            if said_bye and not (set(receives) - set(broken)) and not sends:
                return
            silent = [p for p in receives if now - heard[p] > self.timeout]
            lost = sorted(set(silent) | set(broken))
            if lost:
                if self._done.is_set():  # the caller ends the job without them
                    self._gone = lost
                else:
                    self.on_lost(lost, self.timeout, next(iter(broken.values()), None))
                return
            if self._done.is_set():  # goodbyes are on their way, or soon will be
                time.sleep(self.interval / 10)
            else:
                self._done.wait(self.interval)

    def _receive(self, peer: int) -> MPI.Request:
        return self.comm.Irecv(self._inbox[peer:peer + 1], source=peer, tag=TAG)


@contextlib.contextmanager
def _failing(broken: dict[int, str], peer: int):
    """Note in ``broken`` the error of an operation with ``peer`` (a library that reports a failed connection): the
    last line of MPICH's error stack, where the cause is, without the function that said it."""
    try:
        yield
    except MPI.Exception as exc:
        broken[peer] = re.sub(r"^\w+\(\d+\)\.*:\s*", "", str(exc).strip().splitlines()[-1])
