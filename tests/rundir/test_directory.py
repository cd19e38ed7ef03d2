"""A run directory belongs to one run: what a new run refuses, the claim a run holds for its whole life, and a
refused command that leaves the directory as it was."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mpifl.dirlock import LOCK_NAME
from mpifl.errors import MpiflError
from mpifl.plan.config import RunConfig
from mpifl.rundir.directory import check_new, default_run_dir, run_files
from mpifl.rundir.rundir import RunDir

from ..conftest import REPO, read_metrics, run_here


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


@pytest.mark.slow
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


@pytest.mark.slow
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
    # the kill may fall just after round 1's checkpoint is committed and before round 1's record, which waits for
    # the evaluation of the same gather, is written (the checkpoint holds it as pending): then there is no record
    done = [r["round"] for r in read_metrics(run)] if (run / "metrics.jsonl").exists() else []
    resumed = run_here("--resume", str(run), "--rounds", str(max(done, default=0) + 2))
    assert resumed.returncode == 0, resumed.stderr
    rounds = [r["round"] for r in read_metrics(run)]
    assert rounds == list(range(1, len(rounds) + 1)) and len(rounds) >= 2  # one run's records, in order, once
    assert not (run / LOCK_NAME).exists()  # released at the end


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
def test_a_default_run_directory_made_meanwhile_by_another_run_gives_way_to_the_next_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = RunConfig(model="smallcnn")
    taken = default_run_dir(cfg)
    taken.mkdir(parents=True)  # another run with the same options, started in the same second, made it first
    opened = RunDir.create(taken, cfg)
    path = opened.path
    try:
        assert path != taken and path.name.startswith(taken.name) and (path / "config.json").is_file()
        assert run_files(taken) == []
    finally:
        opened.release()
    with pytest.raises(MpiflError, match="was taken by another run while this one set up"):
        RunDir.create(path, RunConfig(model="smallcnn", out=str(path)))  # a given --out is never renamed


@pytest.mark.parametrize("outer_first", [True, False])
@pytest.mark.parametrize("inner", ["sub", "a/b"])
def test_of_two_runs_set_up_together_one_inside_the_other_the_later_claim_is_refused(tmp_path, inner, outer_first):
    """Both pass the set-up checks (neither directory exists yet); the one that opens second is refused, its
    directory unmade, and the other holds its own: a run never ends up inside another, however they start."""
    outer, nested = tmp_path / "W" / "N", tmp_path / "W" / "N" / inner
    for path in (outer, nested):
        check_new(path)
    first, second = (outer, nested) if outer_first else (nested, outer)
    opened = RunDir.create(first, RunConfig(out=str(first)))
    try:
        where = (f"--out {nested} lies inside the run directory {outer}" if outer_first else
                 f"--out {outer} holds the run directory {nested}")
        with pytest.raises(MpiflError, match=where):
            RunDir.create(second, RunConfig(out=str(second)))
        assert (first / "config.json").is_file() and not (second / "config.json").exists()
        assert not (second / LOCK_NAME).exists()
        if outer_first:  # made by the refused run, and unmade: the outer run's directory is as it was
            assert sorted(p.name for p in outer.iterdir()) == [LOCK_NAME, "config.json"]
    finally:
        opened.release()


@pytest.mark.slow
def test_a_run_refused_while_setting_up_leaves_no_directory(data_root, tmp_path):
    """The run directory is written only once every rank has set up: fixing the option and running again works."""
    run = tmp_path / "run"
    job = run_here(*_args(data_root, run, "--rounds", "1", "--holdout", "moon"))
    assert job.returncode == 2 and "--holdout moon is not a domain" in job.stderr
    assert not run.exists()
    assert run_here(*_args(data_root, run, "--rounds", "1")).returncode == 0


@pytest.mark.slow
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


# ------------------------------------------------------------------ where --out leads: links, "..", runs around runs


def fake_run(path: Path) -> Path:
    """A directory as a finished run leaves it, as far as the checks look: its first file and its records."""
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}\n")
    (path / "metrics.jsonl").write_text("")
    return path


def _links(tmp_path: Path, links: dict[str, str]) -> None:
    for link, target in links.items():
        (tmp_path / link).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / link).symlink_to(target.format(tmp=tmp_path))


@pytest.mark.parametrize("links,out", [
    ({"lnk": "run/extra"}, "lnk"),  # a link at the last part, into the run (the issue's)
    ({"lnk": "run/a/b"}, "lnk"),  # deeper inside it
    ({"lnk": "run/extra"}, "lnk/sub/deeper"),  # a link in the middle, a new folder below it
    ({"deep/er/lnk": "../../run/extra"}, "deep/er/lnk"),  # a relative link, itself two folders down
    ({"chain": "run/extra", "lnk": "chain"}, "lnk"),  # a link to a link
    ({"lnk": "{tmp}/run/extra"}, "lnk"),  # an absolute target
    ({"lnk": "run/extra"}, "lnk/../inner"),  # ".." after a link: run/extra/.. is run
])
def test_an_out_that_leads_into_a_run_through_symbolic_links_is_refused(tmp_path, monkeypatch, links, out):
    monkeypatch.chdir(tmp_path)
    fake_run(tmp_path / "run")
    (tmp_path / "run" / "a" / "b").mkdir(parents=True)
    (tmp_path / "run" / "extra").mkdir()
    _links(tmp_path, links)
    before = sorted(tmp_path.rglob("*"))
    with pytest.raises(MpiflError, match=f"lies inside the run directory {tmp_path / 'run'} .*pass an --out outside"):
        check_new(Path(out))
    assert sorted(tmp_path.rglob("*")) == before


@pytest.mark.parametrize("links,out,problem", [
    ({"lnk": "nowhere"}, "lnk", "lnk is a symbolic link to nowhere, which does not exist"),
    ({"lnk": "nowhere"}, "lnk/run", "lnk is a symbolic link to nowhere, which does not exist"),
    ({"a/lnk": "../gone/x"}, "a/lnk/b/run", "lnk is a symbolic link to ../gone/x, which does not exist"),
    ({"lnk": "lnk"}, "lnk", "lnk is a symbolic link that loops"),
    ({"a": "b", "b": "a"}, "a/run", "a is a symbolic link that loops"),
])
def test_a_link_that_points_nowhere_or_loops_is_named_and_nothing_is_made(tmp_path, links, out, problem):
    _links(tmp_path, links)
    before = sorted(tmp_path.rglob("*"))
    with pytest.raises(MpiflError, match=f"^--out {tmp_path / out}: {tmp_path}/.*{problem}; fix the link"):
        check_new(tmp_path / out)
    assert sorted(tmp_path.rglob("*")) == before  # not even the link's target


@pytest.mark.parametrize("out,lands", [
    ("nonexist/../dd1", "dd1"),  # the issue's: no empty nonexist/ left behind
    ("a/b/../../dd1", "dd1"),
    ("run/sub/../../new", "new"),  # beside the run, not inside it
    ("run/extra/../../new/x", "new/x"),  # through a folder the run holds
])
def test_dot_dot_lands_where_the_kernel_puts_it_and_only_that_is_made(tmp_path, monkeypatch, out, lands):
    fake_run(tmp_path / "run")
    (tmp_path / "run" / "extra").mkdir()
    monkeypatch.chdir(tmp_path)
    before = set(tmp_path.rglob("*"))
    opened = RunDir.create(check_new(Path(out)), RunConfig(model="smallcnn", out=out))
    opened.release()
    path = opened.path
    assert path.resolve() == tmp_path / lands and (path / "config.json").is_file()
    folders = {p for p in set(tmp_path.rglob("*")) - before if p.is_dir()}
    assert folders == {tmp_path / Path(*Path(lands).parts[:k]) for k in range(1, len(Path(lands).parts) + 1)}


def test_a_run_given_a_dot_dot_out_writes_only_where_it_leads(data_root, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    job = run_here(*_args(data_root, "nonexist/../dd1", "--rounds", "1", "--samples-per-client", "64"))
    assert job.returncode == 0, job.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dd1"] and (tmp_path / "dd1" / "metrics.jsonl").is_file()


@pytest.mark.parametrize("inner", ["a-run", "x/y/a-run"])
def test_an_out_that_holds_a_run_below_it_is_refused(tmp_path, inner):
    runs = tmp_path / "runs"
    fake_run(runs / inner)
    with pytest.raises(MpiflError, match=f"--out {runs} holds the run directory {runs / inner} \\(it holds "
                                         "config.json, metrics.jsonl\\); .*pass an --out that holds no run"):
        check_new(runs)
    with pytest.raises(MpiflError, match="holds the run directory"):
        check_new(runs / inner.split("/")[0]) if "/" in inner else check_new(tmp_path)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "link").symlink_to(runs / inner)  # a run made around it would hide the run it leads to
    with pytest.raises(MpiflError, match=f"--out {tmp_path / 'other'} holds {tmp_path / 'other' / 'link'}, a "
                                         f"symbolic link to the run directory {runs / inner}; .*no link to a run"):
        check_new(tmp_path / "other")


@pytest.mark.parametrize("target", ["run/logs", "runs", "plain", ".."])
def test_an_out_holding_a_link_is_refused_only_where_the_link_reaches_a_run(tmp_path, target):
    fake_run(tmp_path / "runs" / "run")
    (tmp_path / "runs" / "run" / "logs").mkdir()
    (tmp_path / "runs" / "plain").mkdir()
    out = tmp_path / "w2"
    (out / "x").mkdir(parents=True)
    (out / "x" / "lnk").symlink_to({"run/logs": tmp_path / "runs" / "run" / "logs", "runs": tmp_path / "runs",
                                   "plain": tmp_path / "runs" / "plain", "..": out}[target])
    if target in ("plain", ".."):  # a folder of no run's, or a loop back up: nothing is mixed
        assert check_new(out) == out
        return
    with pytest.raises(MpiflError, match=f"a symbolic link to the run directory {tmp_path / 'runs' / 'run'};"):
        check_new(out)


def test_the_issues_run_around_runs_is_refused_and_writes_nothing(data_root, tmp_path):
    fake_run(tmp_path / "runs" / "fedavg-styledigits-smallcnn-s0-20260101-000000")
    before = snapshot(tmp_path)
    job = run_here(*_args(data_root, tmp_path / "runs", "--rounds", "1"))
    assert job.returncode == 2
    one_error(job, f"--out {tmp_path / 'runs'} holds the run directory {tmp_path / 'runs'}/fedavg-")
    assert snapshot(tmp_path) == before


def test_an_out_beside_holdout_all_folds_is_refused_but_the_next_fold_is_not(tmp_path):
    folds = tmp_path / "lodo"
    fake_run(folds / "holdout-mono")
    fake_run(folds / "holdout-paper")
    for out in (folds / "extra", folds / "extra" / "deeper", folds / "holdout-street"):
        with pytest.raises(MpiflError, match=f"--out {out} lies inside {folds}, --holdout all's folder of folds "
                                             r"\(it holds holdout-mono, holdout-paper\); pass an --out outside it"):
            check_new(out)
    with pytest.raises(MpiflError, match="folder of folds"):
        check_new(folds / "holdout-street", holdout="outline")  # another fold's name
    assert check_new(folds / "holdout-street", holdout="street") == folds / "holdout-street"  # --holdout all's own
    (tmp_path / "plain" / "holdout-notes").mkdir(parents=True)  # a folder so named, but no run's
    check_new(tmp_path / "plain" / "run")


def test_resume_of_a_folder_of_folds_names_them_and_the_way_to_resume_one(tmp_path):
    folds = tmp_path / "lodo"
    fake_run(folds / "holdout-mono")
    fake_run(folds / "holdout-paper")
    (folds / "summary.md").write_text("the fold table")
    before = snapshot(tmp_path)
    job = run_here("--resume", str(folds), "--rounds", "3")
    assert job.returncode == 2
    one_error(job, f"--resume {folds}: it is --holdout all's folder of folds (holdout-mono, holdout-paper), each a "
                   f"run of its own; resume one fold: --resume {folds / 'holdout-mono'}")
    assert snapshot(tmp_path) == before


def test_resume_of_a_run_it_cannot_claim_says_how_to_continue_it(data_root, tmp_path, monkeypatch):
    """A run on a read-only mount: '--out' cannot change on a resume, so that is not the advice."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps(RunConfig(data_root=str(data_root), model="smallcnn",
                                                          out=str(run)).to_flat()))

    def read_only(path):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path / LOCK_NAME))

    monkeypatch.setattr("mpifl.rundir.directory.try_lock", read_only)
    job = run_here("--resume", str(run), "--rounds", "3")
    assert job.returncode == 2
    line = one_error(job, f"cannot claim the run directory {run} (Read-only file system); a resumed run writes into "
                          f"its own directory: make it writable, or copy the run (cp -a {run} NEW) and --resume NEW")
    assert "pass a writable --out" not in line


@pytest.mark.parametrize("how", ["removed", "moved away and made again"])
def test_a_run_whose_directory_goes_away_stops_in_one_line_and_writes_nowhere_else(data_root, tmp_path, monkeypatch,
                                                                                     how):
    """With a checkpoint every round: the next one would be written into what is at the path now."""
    from mpifl.server.progress import Progress

    run, update = tmp_path / "run", Progress.update

    def round_reported(self, r, acc):
        update(self, r, acc)
        if r == 1:
            if how == "removed":
                shutil.rmtree(run)
            else:
                run.rename(tmp_path / "moved")
                run.mkdir()

    monkeypatch.setattr(Progress, "update", round_reported)
    job = run_here(*_args(data_root, run, "--rounds", "3", "--ckpt-every", "1", "--samples-per-client", "64"))
    assert job.returncode == 2
    one_error(job, f"the run directory {run} was removed or replaced while this run was writing it")
    assert (not run.exists()) if how == "removed" else list(run.iterdir()) == []
