"""Messages to rank 0 over real MPI without single copy: the POSTED / SENDING handshake."""

from __future__ import annotations

import pytest

from ..conftest import SINGLE_COPY_OFF, launch

pytestmark = pytest.mark.slow

MESSAGES_WHILE_TRAINING = r'''
import sys
import time
import numpy as np
from mpi4py import MPI
from mpifl.transport.mpi import MpiComm

comm = MpiComm(MPI.COMM_WORLD, timeout=60)
n, per_rank, training = 16 << 20, 3, 0.3  # 16 MB messages, 3 per client rank, 0.3 s of "training" before each
late = sys.argv[1] == "after-gather"  # FedNova's path: the messages wait for the gather, then leave
start = time.perf_counter()
for round_ in range(2):
    comm.bcast(np.zeros(8, np.uint8))
    if comm.rank:
        bufs = [np.full(n, 16 * comm.rank + i, np.uint8) for i in range(per_rank)]
        handles = []
        for buf in bufs:
            time.sleep(training)  # training: this rank makes no MPI call
            handles.append(comm.post(buf))
        if not late:
            comm.complete(handles)
        comm.gatherv(np.zeros(4, np.uint8), [0] + [4] * (comm.size - 1))
        if late:
            comm.complete(handles)
    else:
        if late:
            comm.gatherv(np.zeros(0, np.uint8), [0] + [4] * (comm.size - 1))
        order = [(r, i) for i in range(per_rank) for r in range(1, comm.size)]  # client-id order over ranks
        for first in range(0, len(order), 2):  # two at a time, as rank 0 folds its windows
            part = order[first:first + 2]
            bufs = [np.zeros(n, np.uint8) for _ in part]
            comm.receive(bufs, [r for r, _ in part])
            assert all((b == 16 * r + i).all() for b, (r, i) in zip(bufs, part)), "content"
        if not late:
            comm.gatherv(np.zeros(0, np.uint8), [0] + [4] * (comm.size - 1))
comm.bcast(np.zeros(8, np.uint8))  # a last barrier: every control message has been taken
left = MPI.COMM_WORLD.Iprobe(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG)
seconds = time.perf_counter() - start
times = MPI.COMM_WORLD.gather((comm.seconds_moving, comm.seconds_waiting, comm.cpu_seconds_waiting, left))
if comm.rank == 0:
    print("seconds", f"{seconds:.2f}")
    for rank, (moving, waiting, cpu, left) in enumerate(times):
        print("rank", rank, f"{moving:.2f} {waiting:.2f} {cpu:.2f}", "left" if left else "clean")
'''


@pytest.mark.parametrize("path", ["during-training", "after-gather"])
def test_messages_leave_at_the_speed_of_the_work_without_single_copy(tmp_path, path):
    """Without single-copy transfers a large message moves only while both ends call into MPI; rank 0 sleeps
    while its senders train.  96 MB a round from two ranks, each training 0.9 s: the job takes a few seconds
    (before the senders pushed their messages themselves it crawled at about 2 MB/s under Open MPI and never
    finished under MPICH).  The time moving them counts as communication on both ends, and no control
    message is left behind."""
    script = tmp_path / "messages.py"
    script.write_text(MESSAGES_WHILE_TRAINING)
    job = launch(3, str(path), script=script, env=SINGLE_COPY_OFF, timeout=120)
    assert job.returncode == 0, job.stderr
    seconds = float(job.lines("seconds")[0].split()[1])
    ranks = [line.split() for line in job.lines("rank ")]
    assert seconds < 15, job.stdout  # two rounds of 0.9 s of training and 96 MB each
    assert [r[-1] for r in ranks] == ["clean"] * 3, job.stdout
    moving, waiting, cpu = (float(x) for x in ranks[0][2:5])
    assert moving > 0 and all(float(r[2]) > 0 for r in ranks[1:]), job.stdout  # bytes moved, seen at both ends
    assert cpu < 0.25 * waiting, job.stdout  # rank 0 slept while it waited
