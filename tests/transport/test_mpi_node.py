"""This rank's node over real MPI: its ranks, and the MPICH and Hydra files left on it."""

from __future__ import annotations

import pytest

from ..conftest import launch, open_mpi

pytestmark = pytest.mark.slow

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
