"""Client ranks' messages to rank 0, each sent while both ends are in MPI: the ``POSTED`` / ``SENDING`` handshake.

Without single-copy transfers (CMA, XPMEM, KNEM: off in many containers, and for some pinned buffers) an MPI
library moves a large message in small pieces, each needing a call on both sides; a message posted before its
sender went back to training would crawl (and under MPICH it also holds back every later message to rank 0).  So
a client's message to rank 0 waits in its sender's outbox until rank 0 has posted the receive for it (rank 0 says
so: ``POSTED``, how many of that rank's messages it is receiving now); the sender then says it is sending
(``SENDING``, up to which message), sends, and calls into MPI without sleeping until they are through; rank 0 stops
sleeping while a message announced by ``SENDING`` is pending.  A sender looks for ``POSTED`` each time it posts a
message and while it waits in :meth:`~mpifl.transport.comm.Comm.complete`, so rank 0 folds a rank's uploads while
it trains its next clients.  Every control message is received: a sender takes every ``POSTED`` before its last
message leaves, and rank 0 the ``SENDING`` of every message it receives before its receive returns.  A rank whose
messages the library moves alone (:mod:`mpifl.transport.single_copy`) posts its host-memory messages at once
(``SENDING`` first, so rank 0's accounting is the same) and waits only in ``complete``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

from .large import typed
from .polling import Pending, PollingComm
from .single_copy import on_gpu, probe_single_copy
from .wire import Buffer

UPLOAD = 31003  # tag: a client's message to rank 0
POSTED, SENDING = 31004, 31005  # tags: rank 0 receives a rank's messages up to n / the rank sends them up to n


@dataclass
class Outgoing:
    """A client's message to rank 0, held in its sender's outbox until rank 0 receives it; the handle of
    :meth:`~mpifl.transport.comm.Comm.post`."""

    number: int
    buf: Buffer
    request: MPI.Request | None = None  # sent at once (single copy): its send, ...
    types: contextlib.ExitStack | None = None  # ... and the datatype it needs until it completes


class HandshakeComm(PollingComm):
    """Messages to rank 0 over ``comm`` (buffers above ``max_count`` bytes as one struct), sent as rank 0 comes to
    receive them, or at once where the start-up probe saw the library move them alone."""

    def __init__(self, comm: MPI.Comm, peers: list[str], *, timeout: float | None, max_sleep: float,
                 max_count: int):
        super().__init__(comm.rank, comm.size, peers, timeout, max_sleep=max_sleep)
        self.comm = comm
        self.max_count = max_count
        self._control: list[tuple[MPI.Request, np.ndarray]] = []  # POSTED / SENDING sends not yet complete
        self._number = np.zeros(1, dtype=np.int64)  # where a POSTED or SENDING lands
        # a client rank: its messages to rank 0 numbered, sent, and received by rank 0 as far as it said
        self._outbox: list[Outgoing] = []
        self._at_once: list[Outgoing] = []  # sent at once (single copy), not yet known to be received
        self._numbered = self._sent = self._posted = 0
        # rank 0, per client rank: its messages whose receives are posted, and that it said it sends
        self._expected, self._sending = [0] * comm.size, [0] * comm.size
        self.sends_at_once = probe_single_copy(comm)

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

    def _settle_control(self) -> None:
        """Wait for every control message sent to leave (small sends, which their receivers have taken by now)."""
        MPI.Request.Waitall([request for request, _ in self._control])
        self._control = []

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

        def sent() -> bool:
            self._send_posted(what)  # counts its own time, as bytes moving
            return self._sent >= last

        self.wait_until(sent, what, [0])  # sleeping while rank 0 has not posted their receives yet

    def _complete_at_once(self, last: int, what: str) -> None:
        """Wait until rank 0 has received the messages sent at once up to number ``last``, and has said it
        receives them (every POSTED taken); rank 0 copies them itself, so the time counts as waiting."""
        done = [m for m in self._at_once if m.number <= last]
        if not done:
            return
        self.wait([Pending(0, m.number, m.request) for m in done], what,
                  owed=lambda: [0] if self._posted < done[-1].number else [])
        self._settle_control()  # the SENDINGs: small sends, long gone
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
        self._settle_control()  # the SENDING: a small send, long gone
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
