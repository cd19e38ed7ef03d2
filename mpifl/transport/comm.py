"""The transport interface: what the server and the client hosts need to exchange a round's bytes.

Two implementations:

* :class:`~mpifl.transport.mpi.MpiComm`, one process per rank under an MPI launcher (``mpirun``, ``srun``);
* :class:`~mpifl.transport.inprocess.ThreadComm`, every rank a thread of one process, for a run started
  without a launcher (a debugger, a notebook, a laptop without MPI).

Both move the same bytes in the same order, so a run gives the same numbers over either. Per round there are
two collectives on flat ``uint8`` buffers (:mod:`mpifl.transport.wire`), :meth:`Comm.bcast` from rank 0 and
:meth:`Comm.gatherv` to rank 0, and one message per trained client to rank 0: a client rank posts it
(:meth:`Comm.post`) as soon as the client is trained and goes on training, and rank 0 receives the messages in
client-id order, a few at a time (:meth:`Comm.receive`), folding them as they come. The ``*_object``
collectives carry a few small Python objects during set-up only. Each collective is preceded by
:meth:`Comm.arrive`, a barrier that waits without spinning (the time is counted in ``seconds_waiting``); the
bytes then move at full speed (``seconds_moving``). The messages are split the same way: time waiting for
the peer to come is waiting, time while their bytes move is moving, on both ends. A barrier knows which
ranks have arrived, so a rank that gives up waiting (``timeout``, ``--round-timeout``) names the ranks that
did not come, with their pid and host (:meth:`Comm.describe`).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, NoReturn

import numpy as np

from ..errors import MpiflError
from .buffers import ReusedBuffer
from .topology import NodeLayout
from .wire import Buffer


class TimedOut(MpiflError):
    """A rank gave up waiting (``--round-timeout``): it waited ``seconds`` for the ranks ``missing``."""

    def __init__(self, message: str, seconds: float, missing: list[int]):
        super().__init__(message)
        self.seconds, self.missing = seconds, missing


class Comm:
    """A world of ``size`` ranks as seen from ``rank`` (0 is the server)."""

    in_process = False  # True: every rank is a thread of this process
    sends_at_once = False  # a client rank whose messages the library moves without it (MpiComm's probe)

    def __init__(self, rank: int, size: int, peers: list[str], timeout: float | None = None):
        self.rank, self.size = rank, size
        self.peers = peers  # where each rank runs ("pid 12 on node3"), for messages
        self.timeout = timeout  # seconds a rank waits for the others before the job fails; None: for ever
        self.seconds_waiting = 0.0  # in the barriers: other ranks not ready yet
        self.cpu_seconds_waiting = 0.0  # CPU time this rank spent in them: the cost of waiting
        self.seconds_moving = 0.0  # inside the collectives themselves: bytes moving
        self._gathered = ReusedBuffer()  # rank 0's receive buffer, the same memory every round

    def describe(self, ranks: list[int]) -> str:
        """'rank 2 (pid 12 on node3)', or several such, joined."""
        return ", ".join(f"rank {r} ({self.peers[r]})" for r in ranks)

    def host(self, rank: int) -> str:
        """The host rank ``rank`` runs on."""
        return self.peers[rank].split(" on ", 1)[1].split(",")[0]

    def timed_out(self, what: str, missing: list[int]) -> TimedOut:
        """The one line of a rank that waited ``timeout`` seconds for ``missing``."""
        return TimedOut(f"timed out after {self.timeout:g} s waiting for {what}: {self.describe(missing)} "
                        "stopped answering (hung, or stuck on a file system); raise --round-timeout if "
                        "a round can take that long", self.timeout, missing)

    # ------------------------------------------------------------ the round's bytes
    def arrive(self, what: str) -> None:
        """Wait until every rank has arrived here (``what`` names the wait in a timeout's message)."""
        with self._waiting():
            self._barrier(what)

    def bcast(self, buf: Buffer, what: str = "the server's broadcast") -> None:
        """Broadcast ``buf`` (uint8, the same size on every rank) from rank 0, in place."""
        self.arrive(what)
        with self._moving():
            self._bcast(buf)

    def gatherv(self, sendbuf: Buffer, counts: list[int],
                what: str = "the clients' uploads") -> list[Buffer] | None:
        """Gather each rank's bytes at rank 0; ``counts[r]`` is rank r's size.

        Returns, on rank 0, one view per rank into the receive buffer (segments in rank order), valid until
        the next gather reuses the buffer; ``None`` elsewhere.
        """
        if sendbuf.nbytes != counts[self.rank]:
            raise RuntimeError(f"rank {self.rank} sends {sendbuf.nbytes} bytes, expected {counts[self.rank]}")
        self.arrive(what)
        with self._moving():
            return self._gatherv(sendbuf, counts)

    def post(self, buf: Buffer) -> Any:
        """Queue ``buf`` for rank 0 and return a handle for :meth:`complete`; ``buf`` must stay as it is until
        then.  Its bytes leave now if rank 0 is receiving them, else at a later post or in :meth:`complete`;
        the time they take counts as bytes moving.  A rank's messages arrive in the order it posted them."""
        return self._post(buf)

    def complete(self, handles: list[Any], what: str = "the server's fold of the uploads") -> None:
        """Wait until rank 0 has received the messages of ``handles`` (their buffers may then be reused).
        The time counts as waiting while rank 0 is not yet receiving them, as bytes moving while it is."""
        self._complete(handles, what)

    def receive(self, bufs: list[Buffer], sources: list[int], what: str = "a client's upload") -> None:
        """On rank 0: fill ``bufs[i]`` with the next message of rank ``sources[i]``, all at once (several
        from one rank fill in its posting order).  The time counts as waiting while a sender is still
        computing, as bytes moving while its bytes arrive."""
        self._receive(bufs, sources, what)

    @contextlib.contextmanager
    def _moving(self):
        """Count the time inside as bytes moving (``seconds_moving``)."""
        clock, cpu = clocks()
        yield
        self._count(True, clock, cpu)

    @contextlib.contextmanager
    def _waiting(self):
        """Count the time inside, and its CPU time, as waiting for other ranks (``seconds_waiting``)."""
        clock, cpu = clocks()
        yield
        self._count(False, clock, cpu)

    def _count(self, moving: bool, clock: float, cpu: float) -> tuple[float, float]:
        """Add the time since ``clock`` to bytes moving, or it and this thread's CPU time since ``cpu`` to
        waiting; returns the new (clock, cpu)."""
        now, cpu_now = clocks()
        if moving:
            self.seconds_moving += now - clock
        else:
            self.seconds_waiting += now - clock
            self.cpu_seconds_waiting += cpu_now - cpu
        return now, cpu_now

    # ------------------------------------------------------------ set-up only
    def bcast_object(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (small objects, during set-up)."""
        raise NotImplementedError

    def gather_object(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` in rank order on rank 0, None elsewhere (small objects, during set-up)."""
        raise NotImplementedError

    def allgather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` in rank order on every rank (small objects, during set-up)."""
        raise NotImplementedError

    def node_layout(self) -> NodeLayout:
        """The ranks sharing this rank's node, and its cores."""
        raise NotImplementedError

    def in_turn(self) -> contextlib.AbstractContextManager:
        """A set-up step that touches process-wide state (torch's global generator and thread count):
        separate processes may run it at once; threads of one process take turns in rank order."""
        return contextlib.nullcontext()

    def cuda_aware(self) -> bool | None:
        """Whether GPU buffers may be handed to the collectives (None: the library cannot say)."""
        raise NotImplementedError

    def watch_peers(self, timeout: float, on_lost: Callable[[list[int], float, str | None], None],
                    on_end: Callable[[], None]) -> str | None:
        """Watch the peers until :meth:`goodbye` (:mod:`mpifl.transport.liveness`): ``on_lost(ranks, seconds,
        error)`` when ranks have been silent for ``timeout`` seconds or their connection failed (``error``, what
        the library said), ``on_end()`` on a client rank when rank 0 ends the
        job for that (:meth:`end_job`).  Every rank calls it at once.  Returns why it cannot watch, if so.
        Threads of one process cannot lose each other: nothing to watch."""
        return None

    def end_job(self) -> None:
        """Rank 0: tell the client ranks that the job ends because a peer is lost."""

    def goodbye(self) -> list[int]:
        """This rank's part of the job is done: say so to the watched peers and wait until they have
        (:meth:`~mpifl.transport.liveness.Heartbeats.goodbye`); the peers lost meanwhile (none where nothing
        watches)."""
        return []

    def finalize(self, seconds: float | None, overdue: Callable[[], None]) -> None:
        """End the communication library of this process; ``overdue()`` (which ends the process) runs on another
        thread if it has not ended after ``seconds`` (None: wait as long as it takes)."""

    def abort(self, code: int) -> NoReturn:
        """End the whole job promptly with exit ``code``, from this rank (its line already printed)."""
        raise NotImplementedError

    # ------------------------------------------------------------ implementations
    def _barrier(self, what: str) -> None:
        raise NotImplementedError

    def _bcast(self, buf: Buffer) -> None:
        raise NotImplementedError

    def _gatherv(self, sendbuf: Buffer, counts: list[int]) -> list[Buffer] | None:
        raise NotImplementedError

    def _post(self, buf: Buffer) -> Any:
        raise NotImplementedError

    def _complete(self, handles: list[Any], what: str) -> None:
        raise NotImplementedError

    def _receive(self, bufs: list[Buffer], sources: list[int], what: str) -> None:
        raise NotImplementedError

    def _receive_buffer(self, padded: list[int]) -> tuple[Buffer, np.ndarray]:
        """Rank 0's reused receive buffer for segments of ``padded`` bytes, and their offsets."""
        displs = np.concatenate([[0], np.cumsum(padded)[:-1]]).astype(np.int64)
        return self._gathered.get(int(sum(padded))), displs


def clocks() -> tuple[float, float]:
    """(wall clock, this thread's CPU time): the waiting thread's own, not a training thread's beside it."""
    return time.perf_counter(), time.thread_time()
