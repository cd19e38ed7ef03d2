"""The MPI transport: one process per rank; per round one broadcast down, one gather up and one message per
trained client to rank 0, on any buffer MPI can read: a numpy array, or a torch tensor (mpi4py takes it through
DLPack or ``__cuda_array_interface__``), a GPU tensor when the MPI library is CUDA-aware
(:mod:`mpifl.transport.gpu_mpi`).

Every collective is preceded by a barrier of non-blocking messages (each client rank tells rank 0 it has arrived,
rank 0 tells them all to go once all have, so rank 0 knows who is missing) that the waiting side polls with short
sleeps (:mod:`mpifl.transport.polling`); the collective itself starts only when every rank has arrived, and runs
at full speed.  The messages to rank 0 move by a handshake (:mod:`mpifl.transport.handshake`) unless the library
moves them alone (:mod:`mpifl.transport.single_copy`); buffers above 2 GiB travel as derived datatypes
(:mod:`mpifl.transport.large`); the peers are watched by heartbeats (:mod:`mpifl.transport.liveness`), and the
node's ranks found by a shared-memory split (:meth:`MpiComm.node_layout`).
"""

from __future__ import annotations

import ctypes
import os
import socket
import threading
from typing import Callable, NoReturn

import numpy as np
from mpi4py import MPI

from ..process.abort import abort_world
from ..process.node_files import MPICH_NODE, forget_launcher_files, forget_segments
from ..process.world import loaded_libmpi
from .gpu_mpi import cuda_aware
from .handshake import HandshakeComm
from .large import INT_MAX, gatherv, typed
from .liveness import Heartbeats, unwatchable
from .polling import Pending
from .topology import NodeLayout, affinity
from .wire import Buffer

ARRIVED, GO = 31001, 31002  # tags: the barrier's messages (the handshake's are 31003-31005, the probe's 31006)


class MpiComm(HandshakeComm):
    """World communicator with polite waiting and large-buffer collectives."""

    def __init__(self, comm: MPI.Comm = MPI.COMM_WORLD, *, max_count: int = INT_MAX,
                 max_sleep: float = 0.002, timeout: float | None = None):
        peers = [f"pid {pid} on {host}" for pid, host in comm.allgather((os.getpid(), socket.gethostname()))]
        super().__init__(comm, peers, timeout=timeout, max_sleep=max_sleep, max_count=max_count)
        self._token = np.zeros(1, dtype=np.uint8)  # the barrier's messages: one byte, never read
        self._inbox = np.zeros(comm.size, dtype=np.uint8)  # where rank r's byte lands
        self._heartbeats: Heartbeats | None = None  # the watch over the peers (watch_peers)

    def _barrier(self, what: str) -> None:
        """Every client rank sends rank 0 'arrived' and waits for 'go'; rank 0 sends 'go' once all arrived."""
        if self.rank == 0:
            clients = range(1, self.size)
            self.wait([Pending(r, 0, self.comm.Irecv(self._inbox[r:r + 1], source=r, tag=ARRIVED))
                       for r in clients], what)
            self._settle_control()  # POSTED: every rank has taken them
            MPI.Request.Waitall([self.comm.Isend(self._token, dest=r, tag=GO) for r in clients])
        else:
            sent = self.comm.Isend(self._token, dest=0, tag=ARRIVED)
            self.wait([Pending(0, 0, self.comm.Irecv(self._inbox[0:1], source=0, tag=GO))], what)
            sent.Wait()

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

    def node_layout(self) -> NodeLayout:
        """The ranks that share this rank's node (an MPI shared-memory split).  Having spoken to them (every one has
        started MPI), the rank unlinks MPICH's shared-memory file of the node and Hydra's topology file: nothing of
        them is left however the job ends (:mod:`mpifl.process.node_files`)."""
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

    def cuda_aware(self) -> bool | None:
        return cuda_aware()

    def watch_peers(self, timeout: float, on_lost: Callable[[list[int], float, str | None], None],
                    on_end: Callable[[], None]) -> str | None:
        why = unwatchable()
        if why is None:
            self._heartbeats = Heartbeats(self.comm, timeout, on_lost, on_end)
            self._heartbeats.start()
        return why

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
