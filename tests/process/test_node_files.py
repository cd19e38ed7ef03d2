"""A process removes the MPI libraries' shared-memory files it maps, and no other file: not one of another job (of
the same names, but not mapped here), not one of its own of another name."""

from __future__ import annotations

import contextlib
import mmap
import os

import pytest

from mpifl.process.node_files import MPICH_NODE, SHM, forget_segments, mapped_segments


@pytest.fixture
def files():
    """Files in /dev/shm named after this test's process; mapped ones stay mapped until the test ends."""
    made, maps = [], []

    def make(name: str, mapped: bool):
        path = SHM / name
        with open(path, "w+b") as file:
            file.truncate(4096)
            if mapped:
                maps.append(mmap.mmap(file.fileno(), 4096))
        made.append(path)
        return path

    yield make
    for mapping in maps:
        mapping.close()
    for path in made:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


@pytest.mark.skipif(not SHM.is_dir() or not os.path.exists("/proc/self/maps"), reason="Linux's /dev/shm and /proc")
def test_only_the_files_this_process_maps_are_removed(files):
    job = f"{os.getpid():x}"
    mine = files(f"mpich_shm_{job}_0", mapped=True)  # this job's node file, as MPICH names it
    other_job = files(f"mpich_shm_{job}0_0", mapped=False)  # another job's: not mapped here
    open_mpi = files(f"sm_segment.node1.0.{job}.0", mapped=True)  # a world of one's, as Open MPI names it
    not_mpi = files(f"mpifl-test-{job}", mapped=True)  # mapped, but no MPI library's
    assert mapped_segments() == sorted([mine, open_mpi])
    assert forget_segments(MPICH_NODE) == [mine]  # what a rank removes once set up: MPICH's only
    assert not mine.exists() and open_mpi.exists()
    assert forget_segments() == [open_mpi]  # a world of one, or a rank ending the job
    assert not open_mpi.exists() and other_job.exists() and not_mpi.exists()
    assert forget_segments() == []
