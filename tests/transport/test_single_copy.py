"""The start-up probe of single copy, and the messages sent at once where it saw it work."""

from __future__ import annotations

import pytest

from ..conftest import SINGLE_COPY_OFF, launch

pytestmark = pytest.mark.slow

SENDING_AT_ONCE = r'''
import time
import numpy as np
from mpi4py import MPI
from mpifl.transport.mpi import MpiComm

comm = MpiComm(MPI.COMM_WORLD, timeout=60)
n = 64 << 20
moving = 0.0  # the seconds the uploads moved in this sender's post and complete (not the small collectives')
for round_ in range(2):
    comm.bcast(np.zeros(8, np.uint8))
    if comm.rank:
        buf = np.full(n, comm.rank + round_, np.uint8)
        time.sleep(0.2)  # rank 0's receive is posted by now: a handshake sender sends inside post
        moved, started = comm.seconds_moving, time.perf_counter()
        handle = comm.post(buf)
        posting = time.perf_counter() - started
        time.sleep(0.3)  # training, out of MPI
        comm.complete([handle])
        moving += comm.seconds_moving - moved
        comm.gatherv(np.array([posting]).view(np.uint8), [0] + [8] * (comm.size - 1))
    else:
        bufs = [np.zeros(n, np.uint8) for _ in range(1, comm.size)]
        comm.receive(bufs, list(range(1, comm.size)))
        assert all((b == r + round_).all() for r, b in enumerate(bufs, start=1)), "content"
        posting = [g.view(np.float64)[0] for g in comm.gatherv(np.zeros(0, np.uint8), [0] + [8] * (comm.size - 1))[1:]]
comm.bcast(np.zeros(8, np.uint8))
left = MPI.COMM_WORLD.Iprobe(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG)
ranks = MPI.COMM_WORLD.gather((comm.sends_at_once, moving, left))
if comm.rank == 0:
    for rank, (at_once, moving, left) in enumerate(ranks[1:], start=1):
        print("rank", rank, "at-once" if at_once else "handshake", f"{posting[rank - 1]:.4f} {moving:.4f}",
              "left" if left else "clean")
'''


@pytest.mark.parametrize("single_copy", ["on", "off"])
def test_a_sender_posts_at_once_only_where_the_library_moved_the_start_up_probe_without_it(tmp_path, single_copy):
    """With single copy on (this machine's default under both MPIs) the start-up probe sees rank 0 receive a
    message while its sender sleeps: each client rank then posts its 64 MB at once and is back at once, rank 0
    copying them, and the sender spends no time moving its uploads' bytes.  With single copy off the probe says no
    and the handshake stays: the sender moves its bytes itself (in post or complete), as rank 0 receives them.
    Both ways every byte arrives, in order, and no control message is left."""
    script = tmp_path / "at_once.py"
    script.write_text(SENDING_AT_ONCE)
    job = launch(3, script=script, env=SINGLE_COPY_OFF if single_copy == "off" else {}, timeout=120)
    assert job.returncode == 0, job.stderr
    ranks = [line.split() for line in job.lines("rank ")]
    assert [r[2] for r in ranks] == ["at-once" if single_copy == "on" else "handshake"] * 2, job.stdout
    assert [r[-1] for r in ranks] == ["clean"] * 2, job.stdout
    posting, moving = [float(r[3]) for r in ranks], [float(r[4]) for r in ranks]
    if single_copy == "on":  # 2 x 64 MB would take tens of ms to copy
        assert max(posting) < 0.01 and max(moving) < 0.005, job.stdout
    else:
        assert min(moving) > 0.01, job.stdout
