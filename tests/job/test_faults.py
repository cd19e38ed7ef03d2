"""Injected faults (MPIFL_FAULT, see mpifl.process.faults): every one ends the whole job promptly, said once.

Together with the fault tests of test_errors.py (raise, exit, NaN) and
tests/rundir/test_checkpoint.py (stop, crash after a checkpoint) these are the runs the
resilience issue counts; none may hang (each has a hard subprocess timeout).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from ..conftest import AS_ROOT, REPO, launch, mpirun_command, open_mpi, run_here, run_in_process, shm_report

pytestmark = pytest.mark.slow


def _args(data_root, out, *extra):
    return ["--data-root", str(data_root), "--model", "smallcnn", "--out", str(out), "--rounds", "50", *extra]


SMALL = ("--threads", "1", "--samples-per-client", "64")  # short rounds, where a test waits for a fault, not a round


def pids(run) -> dict[int, str]:
    """Each rank's pid, from log.txt's 'rank K (pid P on HOST, ...)' lines: how docs/faults.md finds a rank by its
    pid."""
    lines = [line for line in (run / "log.txt").read_text().splitlines() if line.startswith("rank ")]
    return {int(line.split()[1]): line.split("(pid ")[1].split()[0] for line in lines}


def test_a_rank_killed_like_by_the_oom_killer_ends_the_job_promptly_and_the_log_maps_ranks_to_pids(data_root,
                                                                                                   tmp_path):
    """No rank can say which one died: MPICH ends the others within milliseconds (docs/faults.md, "Faults, one by
    one", says how to find it from the pid the kernel or the launcher names); the job must end promptly, its
    checkpoint intact, and nothing of MPICH's shared memory is left (unlinked by the ranks once set up)."""
    run = tmp_path / "r"
    job = launch(3, *_args(data_root, run, "--ckpt-every", "1"), env={"MPIFL_FAULT": "kill:rank=2,round=3"},
                 timeout=90)
    assert job.returncode != 0 and job.seconds < 30
    assert job.left_in_shm() in ([], None)  # MPICH's file of the node, unlinked by the ranks once set up
    assert sorted(pids(run)) == [0, 1, 2] and len(set(pids(run).values())) == 3
    # round 2's files were being written when rank 2 died in round 3: the committed checkpoint is round 1's
    assert json.loads((run / "checkpoint" / "meta.json").read_text())["round"] == 1


@pytest.mark.parametrize("fault,waiting_for", [
    ("hang:rank=1,round=2", "the clients' uploads"),  # a client rank stops answering: the server names it
    ("hang:rank=0,round=2", "the server's broadcast"),  # the server stops: client rank 1 names it
])
def test_round_timeout_turns_a_hang_into_one_line_naming_the_rank_its_pid_and_host(data_root, tmp_path, fault,
                                                                                   waiting_for):
    """A hung rank still sends its heartbeats: it is hung, not lost, whatever --peer-timeout (2 s here)."""
    run = tmp_path / "r"
    job = launch(3, *_args(data_root, run, "--round-timeout", "8", "--peer-timeout", "2", *SMALL),
                 env={"MPIFL_FAULT": fault},
                 timeout=120)
    assert job.returncode == 2
    errors = job.lines("mpifl: error")
    assert len(errors) == 1 and f"s waiting for {waiting_for}" in errors[0], job.stderr
    hung = int(fault[len("hang:rank=")])
    waited = 8 if hung else 8 + 3  # the server gives up first; client rank 1 three seconds later
    assert f"timed out after {waited} s waiting" in errors[0]
    assert f": rank {hung} (pid {pids(run)[hung]} on {socket.gethostname()}) stopped answering" in errors[0]
    assert "Traceback" not in job.stderr and job.left_in_shm() in ([], None)


def test_a_round_timeout_shorter_than_the_set_up_is_a_user_error_in_one_line(data_root, tmp_path):
    """--round-timeout 0.01: the server gives up while the client host still sets up.  Before: a traceback (in one
    process) or 'rank 0 failed while starting: MpiflError ... at mpi.py:157' (under mpirun), exit 1."""
    job = run_here(*_args(data_root, tmp_path / "r", *SMALL, "--round-timeout", "0.01"))
    assert job.returncode == 2 and job.stderr.splitlines() == [
        f"mpifl: error: timed out after 0.01 s waiting for rank 1 (pid {os.getpid()} on {socket.gethostname()}, "
        "thread mpifl-rank-1) to finish setting up: --round-timeout must exceed the set-up and the longest round; "
        "raise it (0: no limit)"], job.stderr
    assert not (tmp_path / "r").exists()


def test_a_rank_that_stops_answering_is_lost_after_the_peer_timeout_and_named_with_its_host(data_root, tmp_path):
    """SIGSTOP freezes rank 2 whole, heartbeats included, as a node that stopped answering would: after --peer-timeout
    rank 0 names it once, with its pid and host, in log.txt too, and ends the job (exit 69); nothing hangs."""
    run = tmp_path / "r"
    command = [*mpirun_command(3, report=True), sys.executable, "-m", "mpifl.run",
               *_args(data_root, run, "--peer-timeout", "3", *SMALL)]
    job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                           env={**os.environ, "PYTHONPATH": str(REPO), **AS_ROOT})
    try:
        deadline = time.monotonic() + 60
        while not (run / "metrics.jsonl").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        frozen = int(pids(run)[2])
        os.kill(frozen, signal.SIGSTOP)
        stopped_at = time.monotonic()
        _, err = job.communicate(timeout=60)
    finally:
        job.kill()
        with contextlib.suppress(ProcessLookupError):  # Open MPI's launcher may have ended it already
            os.kill(frozen, signal.SIGKILL)
    assert job.returncode == 69 and time.monotonic() - stopped_at < 3 + 8
    errors = [line for line in err.splitlines() if line.startswith("mpifl: ")]
    assert errors == [f"mpifl: error: lost rank 2 (pid {frozen} on {socket.gethostname()}): nothing heard from it for "
                      "over 3 s (--peer-timeout 3): its node failed or is cut off the network; no checkpoint was "
                      "taken (--ckpt-every N takes them): run again with another --out"], err
    assert (run / "log.txt").read_text().splitlines()[-1] == errors[0]
    assert shm_report(err)[1] in ([], None)


def test_an_exception_on_the_server_ends_the_job_with_its_line_and_leaves_no_shared_memory(data_root, tmp_path):
    """MPI_Abort skips the MPI library's own removal of its shared memory: MPICH left its 1-3 MB file of the node
    in /dev/shm after every job ended so (here the job's own /dev/shm, tests/conftest.py private_shm)."""
    job = launch(3, *_args(data_root, tmp_path / "r", *SMALL), env={"MPIFL_FAULT": "raise:rank=0,round=2"}, timeout=90)
    assert job.returncode == 1 and job.seconds < 60
    lines = job.lines("mpifl: rank 0 failed: RuntimeError: injected fault")
    assert len(lines) == 1 and (tmp_path / "r" / "traceback-rank0.txt").exists()
    assert job.left_in_shm() in ([], None)


@pytest.mark.parametrize("fault", ["raise:rank=0,round=2", "raise:rank=1,round=2", "hang:rank=0,round=2"])
def test_in_one_process_a_failing_or_hung_rank_ends_the_run_at_once_with_one_line(data_root, tmp_path, fault):
    extra = ("--round-timeout", "5") if fault.startswith("hang") else ()
    job = run_in_process(*_args(data_root, tmp_path / "r", *SMALL, *extra), env={"MPIFL_FAULT": fault},
                         timeout=90)
    lines = job.lines("mpifl: ")
    assert len(lines) == 1 and "Traceback" not in job.stderr and job.seconds < 40, job.stderr
    if fault.startswith("raise"):
        rank = fault[len("raise:rank=")]
        assert job.returncode == 1 and lines[0].startswith(f"mpifl: rank {rank} failed: RuntimeError: injected fault")
        assert (tmp_path / "r" / f"traceback-rank{rank}.txt").exists()
    else:  # the server hangs: the client host times out, names it, and the process ends without it
        assert job.returncode == 2 and "waiting for the server's broadcast: rank 0 (pid" in lines[0]
        assert "main thread) stopped answering" in lines[0]


def _started(command: list[str], run) -> subprocess.Popen:
    """``command`` started, once its run has written its first record."""
    env = {**os.environ, "PYTHONPATH": str(REPO), **AS_ROOT}
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    deadline = time.monotonic() + 120
    while not ((run / "metrics.jsonl").exists() and (run / "metrics.jsonl").read_text()):
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            pytest.fail(f"the run did not start: {proc.communicate()[1]}")
        time.sleep(0.1)
    return proc


@pytest.mark.parametrize("signum,to,said", [
    (signal.SIGUSR1, "mpirun", "SIGUSR1"),  # Slurm's --signal before a time limit: mpirun forwards it to every rank
    (signal.SIGINT, "mpirun", "SIGINT"),  # Ctrl-C: MPICH's mpirun forwards the first to every rank
    (signal.SIGTERM, "rank 2", "SIGTERM on rank 2"),  # one node of a job preempted: only its ranks hear it
])
def test_a_stop_signal_checkpoints_the_whole_job_says_so_once_and_exits_75(data_root, tmp_path, signum, to, said):
    if signum == signal.SIGINT and open_mpi():
        pytest.skip("Open MPI's mpirun does not forward Ctrl-C: it ends the job itself (docs/faults.md)")
    run = tmp_path / "r"
    proc = _started([*mpirun_command(3), sys.executable, "-m", "mpifl.run", *_args(data_root, run, *SMALL)], run)
    try:
        if to == "mpirun":
            proc.send_signal(signum)
        else:
            os.kill(int(pids(run)[2]), signum)
        _, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 75, stderr
    lines = [line for line in stderr.splitlines() if line.startswith("mpifl: ")]
    assert len(lines) == 1 and lines[0].startswith(f"mpifl: stopped by {said} after round"), stderr
    assert f"--resume {run}" in lines[0] and "Traceback" not in stderr and "Aborted" not in stderr
    done = json.loads((run / "checkpoint" / "meta.json").read_text())["round"]
    assert 1 <= done < 50 and (run / "checkpoint" / f"round-{done}" / "rank-2.zip").exists()


def test_in_one_process_a_first_ctrl_c_stops_with_a_checkpoint_and_a_second_ends_at_once(data_root, tmp_path):
    run = tmp_path / "r"
    proc = _started([sys.executable, "-m", "mpifl.run", *_args(data_root, run, "--threads", "1", "--ckpt-every",
                                                               "1")], run)
    try:
        time.sleep(0.5)
        before = json.loads((run / "checkpoint" / "meta.json").read_text())["round"]
        proc.send_signal(signal.SIGINT)
        time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        started = time.monotonic()
        _, stderr = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130 and time.monotonic() - started < 5, stderr
    lines = [line for line in stderr.splitlines() if line.startswith("mpifl: ")]
    assert lines == ["mpifl: interrupted again: ended at once, without a checkpoint (the last one, if any, is still "
                     "there)"], stderr
    assert json.loads((run / "checkpoint" / "meta.json").read_text())["round"] >= before  # intact, resumable


def test_a_rank_failing_while_importing_ends_the_job_instead_of_hanging_it(data_root, tmp_path):
    """Without the start-up hook the other ranks would wait in their first collective forever."""
    job = launch(3, *_args(data_root, tmp_path / "r"), env={"MPIFL_FAULT": "raise:rank=2,round=0"}, timeout=90)
    assert job.returncode == 1 and job.seconds < 30
    lines = job.lines("mpifl: rank 2 failed while starting: RuntimeError: injected fault")
    assert len(lines) == 1 and "Traceback" not in job.stderr and job.left_in_shm() in ([], None)
