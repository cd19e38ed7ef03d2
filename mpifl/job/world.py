"""Which world this process was started in, without importing the runtime (the start-up hooks need it)."""

from __future__ import annotations


def launched_world() -> tuple[int, int]:
    """(rank, size) of the MPI world this process was launched in; (0, 1) without a launcher or without MPI."""
    try:
        from mpi4py import MPI
    except ImportError:
        return 0, 1
    return MPI.COMM_WORLD.rank, MPI.COMM_WORLD.size
