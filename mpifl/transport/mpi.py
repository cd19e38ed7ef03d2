"""The MPI transport: one process per rank; per round one broadcast down, one gather up and one message per
trained client to rank 0, on raw byte buffers.

Three properties matter beyond moving bytes:

* **No busy waiting.**  MPICH and Open MPI spin inside blocking calls, so a
  server waiting for clients, or a client waiting for the next round, would
  steal a core from a rank that is training.  Every collective is therefore
  preceded by a barrier of non-blocking messages that the waiting side polls
  with short sleeps (each client rank tells rank 0 it has arrived, rank 0
  tells them all to go once all have, so rank 0 knows who is missing); the
  collective itself starts only when every rank has arrived, and runs at full
  speed.
* **Any buffer MPI can read.**  A numpy array, or a torch tensor (mpi4py
  takes it through DLPack or ``__cuda_array_interface__``): a GPU tensor
  when the MPI library is CUDA-aware (:mod:`mpifl.transport.gpu_mpi`).
* **No 2 GiB limit.**  MPI counts are C ints.  Buffers above ``max_count``
  bytes travel as derived datatypes (BigMPI's construction): a broadcast or
  a message as one struct of whole blocks plus the remainder, a gather with
  each rank's segment padded to a common block.  Still one collective.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from typing import NoReturn

import numpy as np
import torch
from mpi4py import MPI

from ..job.abort import abort_world
from .comm import Comm
from .gpu_mpi import cuda_aware
from .topology import NodeLayout, affinity
from .wire import Buffer

INT_MAX = 2**31 - 1
ARRIVED, GO, UPLOAD = 31001, 31002, 31003  # tags: the barrier's messages, a client's message to rank 0
LONG_WAIT_SLEEP = 0.05  # seconds: the longest sleep between polls, reached after 5 s of waiting


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

    # ---------------------------------------------------------------- waiting
    def wait(self, requests: list[tuple[int, MPI.Request]], what: str) -> None:
        """Complete ``requests`` (each with its peer rank) by polling with growing sleeps.

        Sleeps double from 50 us up to ``max_sleep`` (2 ms), and in a long
        wait up to 1 % of the time already waited (at most 50 ms): an arrival
        is noticed at most 2 ms or 1 % late, and a server waiting through a
        20 s round wakes about 1 000 times instead of 10 000, which it would
        otherwise take from the cores of ranks that are training.
        """
        sleep = 5e-5
        start = time.monotonic()
        pending = list(requests)
        while True:
            pending = [(rank, request) for rank, request in pending if not request.Test()]
            if not pending:
                return
            waited = time.monotonic() - start
            if self.timeout is not None and waited > self.timeout:
                raise self.timed_out(what, sorted({rank for rank, _ in pending}))
            time.sleep(sleep)
            sleep = min(sleep * 2, max(self.max_sleep, min(LONG_WAIT_SLEEP, waited / 100)))

    def _barrier(self, what: str) -> None:
        """Every client rank sends rank 0 'arrived' and waits for 'go'; rank 0 sends 'go' once all arrived."""
        if self.rank == 0:
            clients = range(1, self.size)
            self.wait([(r, self.comm.Irecv(self._inbox[r:r + 1], source=r, tag=ARRIVED)) for r in clients], what)
            MPI.Request.Waitall([self.comm.Isend(self._token, dest=r, tag=GO) for r in clients])
        else:
            sent = self.comm.Isend(self._token, dest=0, tag=ARRIVED)
            self.wait([(0, self.comm.Irecv(self._inbox[0:1], source=0, tag=GO))], what)
            sent.Wait()

    # ------------------------------------------------------------ collectives
    def _bcast(self, buf: Buffer) -> None:
        with self._typed(buf) as message:
            self.comm.Bcast(message, root=0)

    def _gatherv(self, sendbuf: Buffer, counts: list[int]) -> list[Buffer] | None:
        block = self._gather_block(counts)
        padded = [-(-c // block) * block for c in counts]
        if block > 1 and sendbuf.nbytes != padded[self.rank]:
            staged = sendbuf.new_zeros(padded[self.rank]) if isinstance(sendbuf, torch.Tensor) \
                else np.zeros(padded[self.rank], dtype=np.uint8)
            staged[:sendbuf.nbytes] = sendbuf
            sendbuf = staged
        recv, displs = self._receive_buffer(padded) if self.rank == 0 else (None, None)
        dtype = MPI.BYTE if block == 1 else MPI.BYTE.Create_contiguous(block).Commit()
        try:
            self.comm.Gatherv(
                [sendbuf, len(sendbuf) // block, dtype],
                [recv, ([p // block for p in padded], [int(d) // block for d in displs]), dtype]
                if self.rank == 0 else None,
                root=0)
        finally:
            if block > 1:
                dtype.Free()
        if self.rank != 0:
            return None
        return [recv[d:d + c] for d, c in zip(displs, counts)]

    def _post(self, buf: Buffer) -> MPI.Request:
        with self._typed(buf) as message:  # a datatype freed under a pending send lives until the send ends
            return self.comm.Isend(message, dest=0, tag=UPLOAD)

    def _complete(self, handles: list[MPI.Request], what: str) -> None:
        self.wait([(0, request) for request in handles], what)

    def _receive(self, bufs: list[Buffer], sources: list[int], what: str) -> None:
        with contextlib.ExitStack() as types:
            self.wait([(source, self.comm.Irecv(types.enter_context(self._typed(buf)), source=source, tag=UPLOAD))
                       for buf, source in zip(bufs, sources)], what)

    @contextlib.contextmanager
    def _typed(self, buf: Buffer):
        """``buf`` as an MPI message: bytes, or above ``max_count`` one struct (freed on leaving)."""
        n = buf.nbytes
        if n <= self.max_count:
            yield [buf, n, MPI.BYTE]
            return
        dtype = self._struct_type(n)
        try:
            yield [buf, 1, dtype]
        finally:
            dtype.Free()

    def bcast_object(self, obj):
        return self.comm.bcast(obj, root=0)

    def gather_object(self, obj):
        return self.comm.gather(obj, root=0)

    def allgather_object(self, obj):
        return self.comm.allgather(obj)

    def cuda_aware(self) -> bool | None:
        return cuda_aware()

    def abort(self, code: int) -> NoReturn:
        abort_world(code)

    # ------------------------------------------------------- large-count help
    def _struct_type(self, n: int) -> MPI.Datatype:
        block = _block_size(n, self.max_count)
        whole, rest = divmod(n, block)
        chunk = MPI.BYTE.Create_contiguous(block)
        parts, counts, displs = [chunk], [whole], [0]
        if rest:
            parts.append(MPI.BYTE.Create_contiguous(rest))
            counts.append(1)
            displs.append(whole * block)
        dtype = MPI.Datatype.Create_struct(counts, displs, parts).Commit()
        for part in parts:
            part.Free()
        return dtype

    def _gather_block(self, counts: list[int]) -> int:
        block = 1
        while sum(-(-c // block) for c in counts) > self.max_count:
            block *= 2
        return block

    # -------------------------------------------------------------- topology
    def node_layout(self) -> NodeLayout:
        """The world ranks that share this rank's node (an MPI shared-memory split)."""
        mine = affinity()
        local = self.comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        everyone = dict(local.allgather((self.rank, mine)))  # setup only: small pickled tuples
        local.Free()
        ranks = tuple(sorted(everyone))
        clients = tuple(r for r in ranks if r != 0)
        sharing = sum(1 for r in clients if everyone[r] & mine) if self.rank != 0 else 1
        return NodeLayout(hostname=socket.gethostname(), rank=self.rank, node_ranks=ranks, client_ranks=clients,
                          cores=len(mine), sharing=max(1, sharing))


def _block_size(n: int, max_count: int) -> int:
    block = 1
    while n // block > max_count:
        block *= 2
    return block
