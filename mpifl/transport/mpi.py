"""The MPI transport: one process per rank; per round one broadcast down, one gather up and one message per
trained client to rank 0, on raw byte buffers.

Three properties matter beyond moving bytes:

* **Sleep only while waiting for a peer; never while bytes move.**  MPICH and
  Open MPI spin inside blocking calls, so a server waiting for clients, or a
  client waiting for the next round, would steal a core from a rank that is
  training.  Every collective is therefore preceded by a barrier of
  non-blocking messages that the waiting side polls with short sleeps (each
  client rank tells rank 0 it has arrived, rank 0 tells them all to go once
  all have, so rank 0 knows who is missing); the collective itself starts
  only when every rank has arrived, and runs at full speed.
* **Messages move while both ends are in MPI.**  Without single-copy
  transfers (CMA, XPMEM, KNEM: off in many containers, and for some pinned
  buffers) an MPI library moves a large message in small pieces, each needing
  a call on both sides; a message posted before its sender went back to
  training would crawl (and under MPICH it also holds back every later
  message to rank 0).  So a client's message to rank 0 waits in its sender's
  outbox until rank 0 has posted the receive for it (rank 0 says so:
  ``POSTED``, how many of that rank's messages it is receiving now); the
  sender then says it is sending (``SENDING``, up to which message), sends,
  and calls into MPI without sleeping until they are through; rank 0 stops
  sleeping while a message announced by ``SENDING`` is pending.  A sender
  looks for ``POSTED`` each time it posts a message and while it waits in
  :meth:`MpiComm.complete`, so rank 0 folds a rank's uploads while it trains
  its next clients.  Every control message is received: a sender takes every
  ``POSTED`` before its last message leaves, and rank 0 the ``SENDING`` of
  every message it receives before its receive returns.  Time spent sleeping counts as
  waiting (``seconds_waiting``), time spent spinning while bytes move as
  communication (``seconds_moving``), on both sides.
* **Unless the library moves them alone** (:mod:`mpifl.transport.single_copy`):
  a rank whose messages the start-up probe saw move without it posts its
  host-memory messages at once (``SENDING`` first, so rank 0's accounting is
  the same) and goes back to training, and waits only in :meth:`MpiComm.complete`.
* **Any buffer MPI can read.**  A numpy array, or a torch tensor (mpi4py
  takes it through DLPack or ``__cuda_array_interface__``): a GPU tensor
  when the MPI library is CUDA-aware (:mod:`mpifl.transport.gpu_mpi`).
* **No 2 GiB limit** (:mod:`mpifl.transport.large`).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Callable, NoReturn

import numpy as np
from mpi4py import MPI

from ..process.abort import abort_world
from ..process.node_files import MPICH_NODE, forget_launcher_files, forget_segments
from ..process.world import loaded_libmpi
from .comm import Comm, clocks
from .gpu_mpi import cuda_aware
from .large import INT_MAX, gatherv, typed
from .single_copy import on_gpu, probe_single_copy
from .liveness import Heartbeats
from .topology import NodeLayout, affinity
from .wire import Buffer

ARRIVED, GO, UPLOAD = 31001, 31002, 31003  # tags: the barrier's messages, a client's message to rank 0
POSTED, SENDING = 31004, 31005  # tags: rank 0 receives a rank's messages up to n / the rank sends them up to n
FIRST_SLEEP = 5e-5  # seconds: the first sleep between polls
LONG_WAIT_SLEEP = 0.05  # seconds: the longest sleep between polls, reached after 5 s of waiting


@dataclass
class Pending:
    """A request being waited for: its peer rank and, for a client's message, its number in that client
    rank's sequence of messages to rank 0 (from 1; 0 for the barrier's messages)."""

    peer: int
    number: int
    request: MPI.Request


@dataclass
class Outgoing:
    """A client's message to rank 0, held in its sender's outbox until rank 0 receives it; the handle of
    :meth:`MpiComm.post`."""

    number: int
    buf: Buffer
    request: MPI.Request | None = None  # sent at once (single copy): its send, ...
    types: contextlib.ExitStack | None = None  # ... and the datatype it needs until it completes


class MpiComm(Comm):
    """World communicator with polite waiting and large-buffer collectives."""

    def __init__(self, comm: MPI.Comm = MPI.COMM_WORLD, *, max_count: int = INT_MAX,
                 max_sleep: float = 0.002, timeout: float | None = None):
        peers = [f"pid {pid} on {host}" for pid, host in comm.allgather((os.getpid(), socket.gethostname()))]
        super().__init__(comm.rank, comm.size, peers, timeout)
        self.comm = comm
        self._token = np.zeros(1, dtype=np.uint8)  # the barrier's messages: one byte, never read
        self._inbox = np.zeros(comm.size, dtype=np.uint8)  # where rank r's byte lands
        self.max_count = max_count
        self.max_sleep = max_sleep
        self._control: list[tuple[MPI.Request, np.ndarray]] = []  # POSTED / SENDING sends not yet complete
        self._number = np.zeros(1, dtype=np.int64)  # where a POSTED or SENDING lands
        # a client rank: its messages to rank 0 numbered, sent, and received by rank 0 as far as it said
        self._outbox: list[Outgoing] = []
        self._at_once: list[Outgoing] = []  # sent at once (single copy), not yet known to be received
        self._numbered = self._sent = self._posted = 0
        # rank 0, per client rank: its messages whose receives are posted, and that it said it sends
        self._expected, self._sending = [0] * comm.size, [0] * comm.size
        self._heartbeats: Heartbeats | None = None  # the watch over the peers (watch_peers)
        self.sends_at_once = probe_single_copy(comm)

    # ---------------------------------------------------------------- waiting
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

    def _take_control(self) -> None:
        """Rank 0: take every SENDING.  A client rank: take every POSTED."""
        self._control = [(request, data) for request, data in self._control if not request.Test()]
        if self.rank == 0:
            status = MPI.Status()
            while self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=SENDING, status=status):
                source = status.Get_source()
                self.comm.Recv(self._number, source=source, tag=SENDING)
                self._sending[source] = max(self._sending[source], int(self._number[0]))
        else:
            while self._posted < self._numbered and self.comm.Iprobe(source=0, tag=POSTED):
                self.comm.Recv(self._number, source=0, tag=POSTED)
                self._posted = max(self._posted, int(self._number[0]))

    def _send_control(self, number: int, dest: int, tag: int) -> None:
        data = np.array([number], dtype=np.int64)
        self._control.append((self.comm.Isend(data, dest=dest, tag=tag), data))

    def _barrier(self, what: str) -> None:
        """Every client rank sends rank 0 'arrived' and waits for 'go'; rank 0 sends 'go' once all arrived."""
        if self.rank == 0:
            clients = range(1, self.size)
            self.wait([Pending(r, 0, self.comm.Irecv(self._inbox[r:r + 1], source=r, tag=ARRIVED))
                       for r in clients], what)
            MPI.Request.Waitall([request for request, _ in self._control])  # POSTED: every rank has taken them
            self._control = []
            MPI.Request.Waitall([self.comm.Isend(self._token, dest=r, tag=GO) for r in clients])
        else:
            sent = self.comm.Isend(self._token, dest=0, tag=ARRIVED)
            self.wait([Pending(0, 0, self.comm.Irecv(self._inbox[0:1], source=0, tag=GO))], what)
            sent.Wait()

    # ------------------------------------------------------------ messages to rank 0
    def _post(self, buf: Buffer) -> Outgoing:
        """Queue ``buf`` and send what rank 0 is receiving now (this message too, if it is); with single copy
        (and ``buf`` in host memory, and no message queued before it) send it at once."""
        self._numbered += 1
        message = Outgoing(self._numbered, buf)
        if self.sends_at_once and not self._outbox and not on_gpu(buf):
            self._send_control(message.number, 0, SENDING)
            message.types = contextlib.ExitStack()
            message.request = self.comm.Isend(message.types.enter_context(typed(buf, self.max_count)), dest=0,
                                              tag=UPLOAD)
            self._at_once.append(message)
            self._take_control()
            return message
        self._outbox.append(message)
        self._take_control()
        self._send_posted("the server's receive of an upload")
        return message

    def _complete(self, handles: list[Outgoing], what: str) -> None:
        """Send the messages of ``handles`` (and those before them) as rank 0 comes to receive them."""
        last = max((h.number for h in handles), default=0)
        self._complete_at_once(last, what)
        sleep, start = FIRST_SLEEP, time.monotonic()
        while True:
            self._take_control()
            self._send_posted(what)  # counts its own time, as bytes moving
            if self._sent >= last:
                return
            if self.timeout is not None and time.monotonic() - start > self.timeout:
                raise self.timed_out(what, [0])
            with self._waiting():  # rank 0 has not posted their receives yet
                time.sleep(sleep)
            sleep = min(sleep * 2, self.max_sleep)

    def _complete_at_once(self, last: int, what: str) -> None:
        """Wait until rank 0 has received the messages sent at once up to number ``last``, and has said it
        receives them (every POSTED taken); rank 0 copies them itself, so the time counts as waiting."""
        done = [m for m in self._at_once if m.number <= last]
        if not done:
            return
        self.wait([Pending(0, m.number, m.request) for m in done], what,
                  owed=lambda: [0] if self._posted < done[-1].number else [])
        MPI.Request.Waitall([request for request, _ in self._control])  # the SENDINGs: small sends, long gone
        self._control = []
        for m in done:
            m.types.close()
        self._at_once = self._at_once[len(done):]
        self._sent = max(self._sent, done[-1].number)

    def _send_posted(self, what: str) -> None:
        """Send, without sleeping, every queued message whose receive rank 0 has posted (after telling it:
        SENDING, so that it stops sleeping too)."""
        ready = [m for m in self._outbox if m.number <= self._posted]
        if not ready:
            return
        self._send_control(ready[-1].number, 0, SENDING)
        with contextlib.ExitStack() as types:  # a datatype freed under a pending send lives until it ends
            pending = [Pending(0, m.number, self.comm.Isend(types.enter_context(typed(m.buf, self.max_count)),
                                                            dest=0, tag=UPLOAD)) for m in ready]
        self.wait(pending, what, moving=lambda still: True)
        MPI.Request.Waitall([request for request, _ in self._control])  # the SENDING: a small send, long gone
        self._control = []
        self._outbox = self._outbox[len(ready):]
        self._sent = ready[-1].number

    def _receive(self, bufs: list[Buffer], sources: list[int], what: str) -> None:
        """Post the receives, tell their senders (POSTED), and spin while an announced one is pending."""
        with contextlib.ExitStack() as types:
            pending = []
            for buf, source in zip(bufs, sources):
                self._expected[source] += 1
                message = types.enter_context(typed(buf, self.max_count))
                pending.append(Pending(source, self._expected[source],
                                       self.comm.Irecv(message, source=source, tag=UPLOAD)))
            for source in sorted(set(sources)):
                self._send_control(self._expected[source], source, POSTED)
            # a sender announces its messages (SENDING) before they leave: once they are in, take that too
            self.wait(pending, what, moving=lambda still: any(p.number <= self._sending[p.peer] for p in still),
                      owed=lambda: [r for r in set(sources) if self._sending[r] < self._expected[r]])

    # ------------------------------------------------------------ collectives
    def _bcast(self, buf: Buffer) -> None:
        with typed(buf, self.max_count) as message:
            self.comm.Bcast(message, root=0)

    def _gatherv(self, sendbuf: Buffer, counts: list[int]) -> list[Buffer] | None:
        return gatherv(self.comm, sendbuf, counts, self.max_count, self._receive_buffer)

    def bcast_object(self, obj):
        return self.comm.bcast(obj, root=0)

    def gather_object(self, obj):
        return self.comm.gather(obj, root=0)

    def allgather_object(self, obj):
        return self.comm.allgather(obj)

    def cuda_aware(self) -> bool | None:
        return cuda_aware()

    def watch_peers(self, timeout: float, on_lost: Callable[[list[int], float, str | None], None],
                    on_end: Callable[[], None]) -> str | None:
        if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            return ("the MPI library gives no MPI_THREAD_MULTIPLE, so a node that fails or is cut off is not "
                    "noticed (--peer-timeout has no effect)")
        self._heartbeats = Heartbeats(self.comm.Dup(), timeout, on_lost, on_end)
        self._heartbeats.start()
        return None

    def end_job(self) -> None:
        if self._heartbeats is not None:
            self._heartbeats.end_job()

    def goodbye(self) -> list[int]:
        return self._heartbeats.goodbye() if self._heartbeats is not None else []

    def finalize(self, seconds: float | None, overdue: Callable[[], None]) -> None:
        """``MPI_Finalize``, called through the C library (ctypes) where this process has it loaded: mpi4py's
        ``Finalize`` holds Python's GIL while MPI finalizes, so no thread could act on a finalization that waits for
        a node lost meanwhile; here ``overdue()`` runs on a thread of its own after ``seconds``."""
        if MPI.Is_finalized():
            return
        library = loaded_libmpi()
        if seconds is None or library is None:
            MPI.Finalize()
            return
        deadline = threading.Timer(seconds, overdue)
        deadline.daemon = True
        deadline.start()
        try:
            ctypes.CDLL(library).MPI_Finalize()
        finally:
            deadline.cancel()

    def abort(self, code: int) -> NoReturn:
        abort_world(code)

    # -------------------------------------------------------------- topology
    def node_layout(self) -> NodeLayout:
        """The world ranks that share this rank's node (an MPI shared-memory split).  Having spoken to them (every
        one has started MPI), the rank unlinks MPICH's shared-memory file of the node and Hydra's topology file:
        nothing of them is left however the job ends (:mod:`mpifl.process.node_files`)."""
        mine = affinity()
        local = self.comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        everyone = dict(local.allgather((self.rank, mine)))  # setup only: small pickled tuples
        local.Free()
        forget_segments(MPICH_NODE)
        forget_launcher_files()
        ranks = tuple(sorted(everyone))
        clients = tuple(r for r in ranks if r != 0)
        sharing = sum(1 for r in clients if everyone[r] & mine) if self.rank != 0 else 1
        return NodeLayout(hostname=socket.gethostname(), rank=self.rank, node_ranks=ranks, client_ranks=clients,
                          cores=len(mine), sharing=max(1, sharing))

