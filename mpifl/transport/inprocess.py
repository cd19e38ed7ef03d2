"""The in-process transport: every rank is a thread of one process (a run started without a launcher).

``python -m mpifl.run ...`` started by itself runs the server (rank 0, the calling thread) and one client
host (rank 1, a second thread) over :class:`ThreadComm`, the same interface as the MPI transport: the same
buffers are packed, copied and unpacked in the same order, so ``metrics.jsonl`` is bit for bit that of
``mpirun -n 2`` with the same ``--threads``.  No MPI library is needed.

A failing rank prints its one line and ends the run at once: the other rank leaves its next collective
(a client host still computing after ``WATCHDOG_SECONDS`` is not waited for: the process exits); a
failing client host wakes the server from its collective (or, should the server be hung, ends the process
after ``WATCHDOG_SECONDS``).
Threads share what processes do not: torch's global generator and its thread count.  Set-up steps that
seed the generator run one rank at a time (:meth:`ThreadComm.in_turn`); during the rounds the server draws no
random numbers, and what it does while the host trains (folding the uploads, :mod:`mpifl.algorithms.core.reduction`)
is numpy's, not torch's; the host waits in the next broadcast while the server aggregates.

The calling thread (rank 0) computes on one torch thread from the very start
(:func:`mpifl.job.start.start`), before any torch work: had it once run a parallel operation on several
threads, its idle OpenMP team would stay, GNU OpenMP would then manage more threads than there are cores
and cut its spin-wait short for every team, and each of the client's parallel operations would wake its
workers from sleep: the client's compute 7-10 % longer on 2 cores (docs/benchmarks.md, "One process against
the bare loop").
"""

from __future__ import annotations

import contextlib
import copy
import os
import queue
import socket
import sys
import threading
import time
import traceback
from typing import Any, Callable, NoReturn

import torch

from .comm import Comm
from .topology import NodeLayout, affinity
from .wire import Buffer

WATCHDOG_SECONDS = 10.0  # a failed client host waits this long for the server to end the run
POLL_SECONDS = 0.05  # how often a rank blocked on a message looks whether the world failed


class Room:
    """What the threads of one in-process world share."""

    def __init__(self, size: int):
        self.size = size
        self.barrier = threading.Barrier(size)
        self.waiting: set[int] = set()  # the ranks inside the barrier now (guarded by ``turn``)
        self.missing: list[int] | None = None  # who had not arrived when a barrier timed out
        self.posted: list[Any] = [None] * size  # each rank's contribution to the collective under way
        self.to_server = [queue.Queue() for _ in range(size)]  # rank r's messages to rank 0: (buffer, received)
        self.turn = threading.Condition()
        self.whose_turn = 0
        self.failed: int | None = None  # the exit code of a rank that ended the job
        self.watchdog: threading.Timer | None = None

    def fail(self, code: int) -> None:
        """End the world: every rank waiting, or arriving later, in a collective leaves with ``code``."""
        if self.failed is None:
            self.failed = code
        self.barrier.abort()

    def fail_from_worker(self, code: int) -> None:
        """:meth:`fail`, from a thread that is not the server's: the server leaves its collective and ends
        the run; should it be stuck elsewhere (a hung server), the process exits after a grace period."""
        self.fail(code)
        if self.watchdog is None:
            self.watchdog = threading.Timer(WATCHDOG_SECONDS, os._exit, args=(code,))
            self.watchdog.daemon = True
            self.watchdog.start()


class ThreadComm(Comm):
    """Rank ``rank`` of an in-process world; collectives are barriers around copies between threads."""

    in_process = True

    def __init__(self, room: Room, rank: int, timeout: float | None = None):
        where = f"pid {os.getpid()} on {socket.gethostname()}"
        peers = [f"{where}, {'main thread' if r == 0 else f'thread mpifl-rank-{r}'}" for r in range(room.size)]
        super().__init__(rank, room.size, peers, timeout)
        self.room = room

    def _barrier(self, what: str) -> None:
        with self.room.turn:
            self.room.waiting.add(self.rank)
        try:
            self.room.barrier.wait(self.timeout)
        except threading.BrokenBarrierError:
            if self.room.failed is not None:  # another rank ended the job and said why
                raise SystemExit(self.room.failed) from None
            with self.room.turn:  # the first rank out of the broken barrier sees who was in it
                if self.room.missing is None:
                    self.room.missing = sorted(set(range(self.size)) - self.room.waiting)
            raise self.timed_out(what, self.room.missing) from None
        finally:
            with self.room.turn:
                self.room.waiting.discard(self.rank)

    def _exchange(self, obj: Any) -> list[Any]:
        """Post ``obj``, read everyone's after all posted, and let no rank post again before all have read."""
        self.room.posted[self.rank] = obj
        self._barrier("the other ranks")
        everyone = list(self.room.posted)
        self._barrier("the other ranks")
        return everyone

    def _bcast(self, buf: Buffer) -> None:
        root = self._exchange(buf)[0]
        if self.rank != 0:
            _copy(buf, root)

    def _gatherv(self, sendbuf: Buffer, counts: list[int]) -> list[Buffer] | None:
        self.room.posted[self.rank] = sendbuf
        self._barrier("the other ranks")
        segments = None
        if self.rank == 0:
            recv, displs = self._receive_buffer(counts)
            segments = [recv[d:d + c] for d, c in zip(displs, counts)]
            for segment, sent in zip(segments, self.room.posted):
                _copy(segment, sent)
        self._barrier("the other ranks")  # the senders may reuse their buffers only now
        return segments

    def _post(self, buf: Buffer) -> threading.Event:
        received = threading.Event()  # set by rank 0 once it has copied the buffer
        self.room.to_server[self.rank].put((buf, received))
        return received

    def _complete(self, handles: list[threading.Event], what: str) -> None:
        with self._waiting():  # rank 0 does the copying
            for received in handles:
                self._blocked(lambda: received.wait(POLL_SECONDS) or None, what, [0])

    def _receive(self, bufs: list[Buffer], sources: list[int], what: str) -> None:
        for buf, source in zip(bufs, sources):
            inbox = self.room.to_server[source]
            with self._waiting():
                sent, received = self._blocked(lambda: _next(inbox), what, [source])
            with self._moving():
                _copy(buf, sent)
            received.set()  # the sender may reuse its buffer

    def _blocked(self, attempt: Callable[[], Any], what: str, peers: list[int]) -> Any:
        """The first value other than None that ``attempt`` (which waits up to POLL_SECONDS) returns; leaves
        when the world failed, or after ``timeout`` seconds naming ``peers``."""
        start = time.monotonic()
        while (value := attempt()) is None:
            if self.room.failed is not None:
                raise SystemExit(self.room.failed)
            if self.timeout is not None and time.monotonic() - start > self.timeout:
                raise self.timed_out(what, peers)
        return value

    def bcast_object(self, obj):
        return copy.deepcopy(self._exchange(obj)[0])

    def gather_object(self, obj):
        everyone = self._exchange(obj)
        return copy.deepcopy(everyone) if self.rank == 0 else None

    def allgather_object(self, obj):
        return copy.deepcopy(self._exchange(obj))

    def node_layout(self) -> NodeLayout:
        ranks = tuple(range(self.size))
        return NodeLayout(hostname=socket.gethostname(), rank=self.rank, node_ranks=ranks, client_ranks=ranks[1:],
                          cores=len(affinity()), sharing=max(1, self.size - 1))

    @contextlib.contextmanager
    def in_turn(self):
        with self.room.turn:
            self.room.turn.wait_for(lambda: self.room.whose_turn == self.rank)
        try:
            yield
        finally:
            with self.room.turn:
                self.room.whose_turn = (self.rank + 1) % self.size
                self.room.turn.notify_all()

    def cuda_aware(self) -> bool:
        return True  # the copies are torch's, on any device

    def abort(self, code: int) -> NoReturn:
        if threading.current_thread() is threading.main_thread():
            self.room.fail(code)
        else:
            self.room.fail_from_worker(code)
        raise SystemExit(code)


def run_threads(size: int, rank_main: Callable[[Comm], None]) -> None:
    """Run ``rank_main(comm)`` for ranks 0..size-1 of an in-process world: rank 0 in the calling thread (which
    receives signals), the others in daemon threads.  Exits as the first rank that exits non-zero does; a
    failing rank ends the world at once (the others leave their next collective), and a failing server
    waits at most ``WATCHDOG_SECONDS`` for a client host still training (interpreter shutdown must not
    find one inside torch)."""
    room = Room(size)
    codes: dict[int, int] = {}

    def guarded(rank: int) -> None:
        try:
            rank_main(ThreadComm(room, rank))
        except SystemExit as exc:  # an exit every rank takes (a set-up error, a stop) or ThreadComm.abort's
            codes[rank] = _exit_code(exc)
        except BaseException:  # a bug outside the rank's own handling: show it and end the world
            traceback.print_exc()
            codes[rank] = 1
            room.fail(1)

    threads = [threading.Thread(target=guarded, args=(r,), name=f"mpifl-rank-{r}", daemon=True)
               for r in range(1, size)]
    for thread in threads:
        thread.start()
    guarded(0)
    if room.watchdog is not None:
        room.watchdog.cancel()  # the server has ended the run in time
    for thread in threads:  # a failed world's threads leave their next collective
        thread.join(None if room.failed is None else WATCHDOG_SECONDS)
    if any(thread.is_alive() for thread in threads):  # still computing: end without waiting for it
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(room.failed)
    failed = [code for _, code in sorted(codes.items()) if code] or ([room.failed] if room.failed else [])
    if failed:
        sys.exit(failed[0])


def _copy(dst: Buffer, src: Buffer) -> None:
    """dst[:] = src for numpy arrays and torch tensors on any device, in any pairing."""
    if isinstance(dst, torch.Tensor):
        dst.copy_(torch.as_tensor(src), non_blocking=False)
    else:
        dst[:] = src.cpu().numpy() if isinstance(src, torch.Tensor) else src


def _next(inbox: queue.Queue) -> Any:
    """The next message in ``inbox``, or None if none came within POLL_SECONDS."""
    try:
        return inbox.get(timeout=POLL_SECONDS)
    except queue.Empty:
        return None


def _exit_code(exc: SystemExit) -> int:
    return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
