"""A run directory belongs to one run: what a new run refuses, the claim a run holds for its whole life, and a
refused command that leaves the directory as it was."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mpifl.dirlock import LOCK_NAME
from mpifl.errors import MpiflError
from mpifl.plan.config import RunConfig
from mpifl.rundir.directory import check_new, default_run_dir, open_new, run_files

from ..conftest import REPO, read_metrics, run_here

pytestmark = pytest.mark.slow


def _args(data_root, out, *extra):
    return ["--data-root", str(data_root), "--model", "smallcnn", "--threads", "1", "--out", str(out), *extra]


def snapshot(path: Path) -> dict[str, bytes]:
    """Every file below ``path``, by relative name: what a refused command must leave as it was."""
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def one_error(job, *patterns: str) -> str:
    lines = [line for line in (job.stdout + job.stderr).splitlines() if line.startswith("mpifl: ")]
    assert len(lines) == 1 and "Traceback" not in job.stderr, job.stdout + job.stderr
    for pattern in patterns:
        assert pattern in lines[0], lines[0]
    return lines[0]


def test_a_run_stopped_before_its_first_record_is_a_run_and_is_not_overwritten(data_root, tmp_path, monkeypatch):
    run = tmp_path / "run"
    monkeypatch.setenv("MPIFL_FAULT", "stop:rank=0,round=1")  # SIGTERM while round 1 trains: no record yet
    stopped = run_here(*_args(data_root, run, "--rounds", "3"))
    assert stopped.returncode == 75, stopped.stderr
    assert (run / "checkpoint" / "meta.json").is_file() and not (run / "metrics.jsonl").exists()
    monkeypatch.delenv("MPIFL_FAULT")
    before = snapshot(run)
    again = run_here(*_args(data_root, run, "--rounds", "3"))
    assert again.returncode == 2
    one_error(again, f"run directory {run} already holds a run (checkpoint, config.json, log.txt)",
              f"--resume {run} to continue that run")
    assert snapshot(run) == before


def test_a_second_run_of_a_directory_in_use_is_refused_and_a_crashed_runs_claim_is_taken_over(data_root, tmp_path):
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    first = subprocess.Popen([sys.executable, "-m", "mpifl.run", *_args(data_root, run, "--rounds", "40",
                                                                         "--ckpt-every", "1")],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    try:
        deadline = time.monotonic() + 60
        while not (run / "config.json").exists():  # set up, training round 1, no record yet
            assert time.monotonic() < deadline and first.poll() is None, "the first run did not start"
            time.sleep(0.05)
        second = run_here(*_args(data_root, run, "--rounds", "2"))
        assert second.returncode == 2
        one_error(second, f"run directory {run} is in use by another run (fedavg on styledigits, 40 rounds, "
                          f"pid {first.pid} on ", "wait for it to end or pass another --out")
        resume = run_here("--resume", str(run), "--rounds", "50")
        assert resume.returncode == 2 and "is in use by another run" in resume.stderr
        while not (run / "checkpoint" / "meta.json").exists():
            assert time.monotonic() < deadline and first.poll() is None, "the first run wrote no checkpoint"
            time.sleep(0.05)
        first.send_signal(signal.SIGKILL)  # a crash: the claim ends with the process, the lock file stays
        first.wait(30)
    finally:
        first.kill()
    assert (run / LOCK_NAME).exists()
    done = [r["round"] for r in read_metrics(run)]
    resumed = run_here("--resume", str(run), "--rounds", str(max(done, default=0) + 2))
    assert resumed.returncode == 0, resumed.stderr
    rounds = [r["round"] for r in read_metrics(run)]
    assert rounds == list(range(1, len(rounds) + 1)) and len(rounds) >= 2  # one run's records, in order, once
    assert not (run / LOCK_NAME).exists()  # released at the end


def test_a_finished_run_is_refused_and_so_is_a_folder_of_folds(data_root, tmp_path):
    run = tmp_path / "run"
    assert run_here(*_args(data_root, run, "--rounds", "1")).returncode == 0
    assert run_files(run) == ["config.json", "log.txt", "metrics.jsonl", "summary.csv", "summary.md"]
    with pytest.raises(MpiflError, match="already holds a run .*pass another --out, or remove it"):
        check_new(run)
    (tmp_path / "lodo" / "holdout-mono").mkdir(parents=True)
    with pytest.raises(MpiflError, match=r"already holds a run \(holdout-mono\)"):
        check_new(tmp_path / "lodo")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "slurm-12.out").write_text("a launcher's log")
    check_new(tmp_path / "mine")  # other files may be there: nothing a run writes is


def test_an_out_inside_another_runs_directory_is_refused_and_leaves_the_disk_as_it_was(data_root, tmp_path):
    run = tmp_path / "run"
    assert run_here(*_args(data_root, run, "--rounds", "1")).returncode == 0
    before = snapshot(tmp_path)
    for out in (run / "sub", run / "a" / "b"):
        nested = run_here(*_args(data_root, out, "--rounds", "1"))
        assert nested.returncode == 2
        one_error(nested, f"--out {out} lies inside the run directory {run} (it holds config.json, "
                          "metrics.jsonl)", "pass an --out outside it")
    assert snapshot(tmp_path) == before and not (run / "sub").exists() and not (run / "a").exists()
    (tmp_path / "live").mkdir()
    (tmp_path / "live" / LOCK_NAME).write_text("")  # a run's claim (live or not, the folder is that run's)
    with pytest.raises(MpiflError, match=f"lies inside the run directory {tmp_path / 'live'} "):
        check_new(tmp_path / "live" / "run")
    (tmp_path / "lodo" / "holdout-mono").mkdir(parents=True)  # --holdout all's folds go inside their folder
    check_new(tmp_path / "lodo" / "holdout-photo")


@pytest.mark.parametrize("out,pattern", [
    ("file", "is a file, not a directory; pass a directory"),
    ("file/run", "is a file; pass another --out"),
    ("x" * 300 + "/run", "has 300 bytes, more than the 255 the file system allows"),
])
def test_an_out_that_cannot_be_a_directory_is_refused_in_one_line(data_root, tmp_path, out, pattern):
    (tmp_path / "file").write_text("not a directory")
    out = tmp_path / out
    before = snapshot(tmp_path)
    job = run_here(*_args(data_root, out, "--rounds", "1"))
    assert job.returncode == 2
    one_error(job, pattern)
    assert snapshot(tmp_path) == before


def test_a_default_run_directory_made_meanwhile_by_another_run_gives_way_to_the_next_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = RunConfig(model="smallcnn")
    taken = default_run_dir(cfg)
    taken.mkdir(parents=True)  # another run with the same options, started in the same second, made it first
    path, lock = open_new(taken, cfg)
    try:
        assert path != taken and path.name.startswith(taken.name) and (path / "config.json").is_file()
        assert run_files(taken) == []
    finally:
        lock.release()
    with pytest.raises(MpiflError, match="was taken by another run while this one set up"):
        open_new(path, RunConfig(model="smallcnn", out=str(path)))  # a given --out is never renamed


def test_a_run_refused_while_setting_up_leaves_no_directory(data_root, tmp_path):
    """The run directory is written only once every rank has set up: fixing the option and running again works."""
    run = tmp_path / "run"
    job = run_here(*_args(data_root, run, "--rounds", "1", "--holdout", "moon"))
    assert job.returncode == 2 and "--holdout moon is not a domain" in job.stderr
    assert not run.exists()
    assert run_here(*_args(data_root, run, "--rounds", "1")).returncode == 0


def test_a_successful_resume_moves_the_failed_attempts_traceback_into_the_runs_history(data_root, tmp_path,
                                                                                       monkeypatch):
    run = tmp_path / "run"
    monkeypatch.setenv("MPIFL_FAULT", "raise:rank=1,round=3")  # a bug on client rank 1 in round 3
    failed = run_here(*_args(data_root, run, "--rounds", "4", "--ckpt-every", "1"))
    assert failed.returncode == 1 and (run / "traceback-rank1.txt").is_file()
    text = (run / "traceback-rank1.txt").read_text()
    monkeypatch.delenv("MPIFL_FAULT")
    resumed = run_here("--resume", str(run), "--rounds", "4")
    assert resumed.returncode == 0, resumed.stderr
    assert not list(run.glob("traceback-rank*.txt"))
    assert (run / "attempts" / "1" / "traceback-rank1.txt").read_text() == text  # kept, out of the way
    line = f"the failed attempt's traceback-rank1.txt moved to {run / 'attempts' / '1'} (attempt 1)"
    assert line in resumed.stdout and line in (run / "log.txt").read_text()
    assert [r["round"] for r in read_metrics(run)] == [1, 2, 3, 4]
