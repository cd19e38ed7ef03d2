"""Whether the MPI library moves a client rank's large message to rank 0 without its sender: seen at start-up, not
guessed from settings.

With a single-copy transfer (CMA, XPMEM, KNEM) rank 0 copies a large message out of its sender's memory inside its
own calls, and waiting for it (:mod:`mpifl.transport.handshake`) costs the sender the time the copy takes (7 % of
SCAFFOLD's rounds at K = 100).  So at start-up every client rank sends rank 0 ``PROBE_BYTES`` and stays out of MPI
for ``PROBE_PAUSE`` seconds (:func:`probe_single_copy`); a rank whose message rank 0 received meanwhile posts its
host-memory messages at once and goes back to training.  Every other rank (another node over TCP, single copy off,
a GPU buffer) keeps the handshake.
"""

from __future__ import annotations

import time

import numpy as np
from mpi4py import MPI

from .wire import Buffer

PROBE = 31006  # tag: the start-up transfer that tells whether the library moves a message without its sender
PROBE_BYTES = 4 << 20  # far above every library's eager limit: a message that needs the rendezvous
PROBE_PAUSE = 0.05  # seconds a prober stays out of MPI
PROBE_MARGIN = 0.01  # seconds: a probe counts as moved without its sender if it arrived this long before it woke
PROBE_GROUP = 16  # client ranks probed at once (rank 0 holds their messages: 64 MiB)


def probe_single_copy(comm: MPI.Comm) -> bool:
    """Whether this rank's large messages reach rank 0 while it stays out of MPI (False on rank 0).

    Client ranks, ``PROBE_GROUP`` at a time, each send rank 0 ``PROBE_BYTES`` and sleep ``PROBE_PAUSE``
    before completing the send; rank 0 has posted its receives and notes when each completes.  One that
    completed before its sender woke (the clock of the node, or of two nodes, ``PROBE_MARGIN`` apart at
    most) moved without its sender: the library's single copy, seen working between these two processes.
    A slow or descheduled rank 0 can only make the answer no (the handshake)."""
    at_once = [False] * comm.size
    for first in range(1, comm.size, PROBE_GROUP):
        group = range(first, min(first + PROBE_GROUP, comm.size))
        woke = np.zeros(1)
        if comm.rank == 0:
            bufs = np.empty((len(group), PROBE_BYTES), dtype=np.uint8)
            requests = dict(zip(group, (comm.Irecv(buf, source=r, tag=PROBE) for buf, r in zip(bufs, group))))
            done: dict[int, float] = {}
            comm.Barrier()
            while len(done) < len(group):
                done.update((r, time.time()) for r, request in requests.items()
                            if r not in done and request.Test())
            for r in group:
                comm.Recv(woke, source=r, tag=PROBE)
                at_once[r] = done[r] < woke[0] - PROBE_MARGIN
        else:
            message = np.ones(PROBE_BYTES, dtype=np.uint8) if comm.rank in group else None
            comm.Barrier()
            if message is not None:
                sent = comm.Isend(message, dest=0, tag=PROBE)
                time.sleep(PROBE_PAUSE)
                woke[0] = time.time()
                sent.Wait()
                comm.Send(woke, dest=0, tag=PROBE)
    return comm.bcast(at_once, root=0)[comm.rank]


def on_gpu(buf: Buffer) -> bool:
    """Whether ``buf`` lives in GPU memory (the probe measured host memory only)."""
    return hasattr(buf, "__cuda_array_interface__") or getattr(buf, "is_cuda", False)
