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
* A rank's last message says goodbye (``BYE``): a peer that finished its part is done, not lost; the thread
  ends once every peer has said goodbye, so no message is left unmatched when MPI is finalized.

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


class Heartbeats:
    """This rank's watch over its peers, on ``comm`` (a communicator of its own), once :meth:`start`-ed.

    ``on_lost(peers, seconds, error)`` runs on the watching thread when ``peers`` have been silent for longer than
    ``seconds`` (this rank's timeout), or at once when the MPI library reports an error for one (``error``, its
    first line; None for a silence);
    ``on_end()`` when rank 0 says the job ends.  Neither returns.  Every message is matched: a rank takes a peer's
    messages until that peer's goodbye, and sends its peers heartbeats until its own.
    """

    def __init__(self, comm: MPI.Comm, timeout: float, on_lost: Callable[[list[int], float, str | None], None],
                 on_end: Callable[[], None]):
        self.comm = comm
        self.peers = list(range(1, comm.size)) if comm.rank == 0 else [0]
        self.timeout = timeout * (1 if comm.rank == 0 else CLIENT_MARGIN)
        self.interval = min(LONGEST_INTERVAL, timeout / 10)
        self.on_lost, self.on_end = on_lost, on_end
        self._tokens = {kind: np.array([kind], dtype=np.uint8) for kind in (BEAT, BYE, END)}
        self._inbox = np.zeros(comm.size, dtype=np.uint8)  # where peer p's byte lands
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="mpifl-heartbeats", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Say goodbye and wait until every peer has (a peer silent for ``timeout`` is not waited for)."""
        if self._thread.is_alive():
            self._stopping.set()
            self._thread.join()

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
        said_bye = False
        while True:
            now = time.monotonic()
            broken: dict[int, str] = {}  # peer -> what the MPI library said of its connection
            if not said_bye:
                said_bye = self._stopping.is_set()
                token = self._tokens[BYE if said_bye else BEAT]
                for p in self.peers:
                    with _failing(broken, p):
                        sends.append((p, self.comm.Isend(token, dest=p, tag=TAG)))
            for p in list(receives):
                with _failing(broken, p):
                    while p in receives and receives[p].Test():
                        heard[p] = now
                        kind = int(self._inbox[p])
                        if kind == END:
                            self.on_end()
                        if kind == BYE:
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
                if not said_bye:  # ending anyway: a peer gone meanwhile is not worth a word
                    self.on_lost(lost, self.timeout, next(iter(broken.values()), None))
                return
            if said_bye:
                time.sleep(self.interval / 10)  # the peers' goodbyes are on their way, or soon will be
            else:
                self._stopping.wait(self.interval)

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
