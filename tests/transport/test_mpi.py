"""Collectives over real MPI, including the derived-datatype path for buffers above the count limit; this rank's
node, and the MPICH and Hydra files left on it."""

from __future__ import annotations

import pytest

from ..conftest import launch, open_mpi

pytestmark = pytest.mark.slow

SCRIPT = r'''
import numpy as np
import torch
from mpi4py import MPI
from mpifl.transport.mpi import MpiComm

def check(max_count, as_buffer):
    comm = MpiComm(MPI.COMM_WORLD, max_count=max_count)
    n = 10_007
    buf = np.arange(n, dtype=np.uint64).astype(np.uint8) if comm.rank == 0 else np.zeros(n, np.uint8)
    buf = as_buffer(buf)
    comm.bcast(buf)
    assert np.array_equal(np.asarray(buf), np.arange(n, dtype=np.uint64).astype(np.uint8)), "bcast"
    counts = [0] + [1000 * r + 3 for r in range(1, comm.size)]
    mine = as_buffer(np.full(counts[comm.rank], comm.rank, np.uint8))
    got = comm.gatherv(mine, counts)
    if comm.rank == 0:
        assert [len(g) for g in got] == counts, "sizes"
        assert all((g == r).all() for r, g in enumerate(got)), "content"
    return True

def check_messages(max_count, as_buffer):
    """Every client rank sends 3 messages; rank 0 receives them interleaved, 2 at a time, in each rank's order."""
    comm = MpiComm(MPI.COMM_WORLD, max_count=max_count)
    n = 5003
    if comm.rank:
        comm.complete([comm.post(as_buffer(np.full(n, 10 * comm.rank + i, np.uint8))) for i in range(3)])
        return True
    order = [(r, i) for i in range(3) for r in range(1, comm.size)]
    for start in range(0, len(order), 2):
        part = order[start:start + 2]
        bufs = [as_buffer(np.zeros(n, np.uint8)) for _ in part]
        comm.receive(bufs, [r for r, _ in part])
        assert all((np.asarray(b) == 10 * r + i).all() for b, (r, i) in zip(bufs, part)), "message order"
    return True

for as_buffer in (np.asarray, torch.from_numpy):  # numpy arrays, and tensors as GPU buffers would be
    assert check(2**31 - 1, as_buffer) and check(1000, as_buffer) and check(7, as_buffer)
    assert check_messages(2**31 - 1, as_buffer) and check_messages(1000, as_buffer)
done = MPI.COMM_WORLD.allreduce(1)
if MPI.COMM_WORLD.rank == 0:
    print("ok", done)
'''


def test_collectives_and_messages_small_and_above_the_count_limit(tmp_path):
    script = tmp_path / "comm_check.py"
    script.write_text(SCRIPT)
    job = launch(3, script=script, timeout=120)
    assert job.returncode == 0, job.stderr
    assert job.lines("ok") == ["ok 3"]


NODE_FILES = r'''
import numpy as np
from mpi4py import MPI
from mpifl.process.node_files import MPICH_NODE, launcher_files, mapped_segments
from mpifl.transport.mpi import MpiComm

comm = MpiComm()
held = launcher_files() + mapped_segments(MPICH_NODE)
layout = comm.node_layout()
assert layout.node_ranks == tuple(range(MPI.COMM_WORLD.size))
assert layout.client_ranks == tuple(range(1, MPI.COMM_WORLD.size))
left = [path.name for path in held if path.exists()]
comm.bcast(np.zeros(1 << 20, np.uint8))  # the node's ranks still speak over the memory they share
found = MPI.COMM_WORLD.gather((sorted(path.name.rsplit("_", 1)[0] for path in held), left))
if comm.rank == 0:
    print("held", *found[0][0])
    print("left", sum(len(left) for _, left in found))
'''


def test_once_set_up_the_ranks_leave_none_of_the_files_mpich_and_hydra_keep_on_the_node(tmp_path):
    """MPICH's shared-memory file of the node and Hydra's topology file (/tmp/hydra_hwloc_xmlfile_*): every rank of
    the node has opened them once they have spoken, so they are unlinked then, and a job ended through MPI_Abort
    (which skips their removal) leaves neither; the job goes on and ends cleanly.  Under Open MPI neither exists."""
    script = tmp_path / "node_files.py"
    script.write_text(NODE_FILES)
    job = launch(3, script=script, timeout=120)
    assert job.returncode == 0, job.stderr
    held = job.lines("held")[0].split()[1:]
    assert held == [] if open_mpi() else held[0] == "hydra_hwloc_xmlfile" and held[1].startswith("mpich_shm_")
    assert job.lines("left") == ["left 0"], job.stdout
