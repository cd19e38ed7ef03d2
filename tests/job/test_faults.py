"""Injected faults (MPIFL_FAULT, see mpifl.job.faults): every one ends the whole job promptly, said once.

Together with the fault tests of test_errors.py (raise, exit, NaN) and
test_checkpoint.py (stop, crash after a checkpoint) these are the runs the
resilience issue counts; none may hang (each has a hard subprocess timeout).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from ..conftest import REPO, launch, mpirun_path, run_in_process


def _args(data_root, out, *extra):
    return ["--data-root", str(data_root), "--model", "smallcnn", "--out", str(out), "--rounds", "50", *extra]


def test_a_rank_killed_like_by_the_oom_killer_ends_the_job_and_the_log_names_its_pid(data_root, tmp_path):
    job = launch(3, *_args(data_root, tmp_path / "r"), env={"MPIFL_FAULT": "kill:rank=2,round=2"}, timeout=90)
    assert job.returncode != 0 and job.seconds < 60
    pid = next(line for line in (tmp_path / "r" / "log.txt").read_text().splitlines() if line.startswith("rank 2 ("))
    assert pid.split("pid ")[1].split()[0] in job.stdout + job.stderr  # the launcher's report names that process


@pytest.mark.parametrize("fault,waiting_for", [
    ("hang:rank=1,round=2", "the clients' uploads"),  # a client rank stops answering: the server says so
    ("hang:rank=0,round=2", "the server's broadcast"),  # the server stops: client rank 1 says so
])
def test_round_timeout_turns_a_hang_into_one_clean_failure(data_root, tmp_path, fault, waiting_for):
    job = launch(3, *_args(data_root, tmp_path / "r", "--round-timeout", "15"), env={"MPIFL_FAULT": fault},
                 timeout=120)
    assert job.returncode == 2
    errors = job.lines("mpifl: error")
    assert len(errors) == 1 and f"s waiting for {waiting_for}" in errors[0], job.stderr
    assert "timed out after 1" in errors[0]  # 15 s on the server, a second more per client rank
    assert "Traceback" not in job.stderr


def test_an_exception_on_the_server_ends_the_job_with_its_line(data_root, tmp_path):
    job = launch(3, *_args(data_root, tmp_path / "r"), env={"MPIFL_FAULT": "raise:rank=0,round=2"}, timeout=90)
    assert job.returncode == 1 and job.seconds < 60
    lines = job.lines("mpifl: rank 0 failed: RuntimeError: injected fault")
    assert len(lines) == 1 and (tmp_path / "r" / "traceback-rank0.txt").exists()


@pytest.mark.parametrize("fault", ["raise:rank=0,round=2", "raise:rank=1,round=2", "hang:rank=0,round=2"])
def test_in_one_process_a_failing_or_hung_rank_ends_the_run_at_once_with_one_line(data_root, tmp_path, fault):
    extra = ("--round-timeout", "5") if fault.startswith("hang") else ()
    job = run_in_process(*_args(data_root, tmp_path / "r", "--threads", "1", *extra), env={"MPIFL_FAULT": fault},
                         timeout=90)
    lines = job.lines("mpifl: ")
    assert len(lines) == 1 and "Traceback" not in job.stderr and job.seconds < 40, job.stderr
    if fault.startswith("raise"):
        rank = fault[len("raise:rank=")]
        assert job.returncode == 1 and lines[0].startswith(f"mpifl: rank {rank} failed: RuntimeError: injected fault")
        assert (tmp_path / "r" / f"traceback-rank{rank}.txt").exists()
    else:  # the server hangs: the client host times out, and the process ends without it
        assert job.returncode == 2 and "waiting for the server's broadcast" in lines[0]


def test_sigusr1_to_mpirun_checkpoints_and_exits_75(data_root, tmp_path):
    """What Slurm's --signal does before a time limit: the launcher forwards the signal to every rank."""
    run = tmp_path / "r"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([mpirun_path(), "-n", "3", sys.executable, "-m", "mpifl.run", *_args(data_root, run)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    try:
        deadline = time.monotonic() + 120
        while not ((run / "metrics.jsonl").exists() and (run / "metrics.jsonl").read_text()):
            assert time.monotonic() < deadline and proc.poll() is None, "the run did not start"
            time.sleep(0.2)
        proc.send_signal(signal.SIGUSR1)
        _, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 75, stderr
    assert "mpifl: stopped by SIGUSR1 after round" in stderr and f"--resume {run}" in stderr
    done = json.loads((run / "checkpoint" / "meta.json").read_text())["round"]
    assert 1 <= done < 50 and (run / "checkpoint" / f"round-{done}" / "rank-2.pt").exists()


def test_a_rank_failing_while_importing_ends_the_job_instead_of_hanging_it(data_root, tmp_path):
    """Without the start-up hook the other ranks would wait in their first collective forever."""
    job = launch(3, *_args(data_root, tmp_path / "r"), env={"MPIFL_FAULT": "raise:rank=2,round=0"}, timeout=90)
    assert job.returncode == 1 and job.seconds < 30
    lines = job.lines("mpifl: rank 2 failed while starting: RuntimeError: injected fault")
    assert len(lines) == 1 and "Traceback" not in job.stderr
