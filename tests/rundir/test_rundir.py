"""RunDir: the run directory as this run opened it, and every write into it, never into a directory made since
at its path."""

from __future__ import annotations

import shutil
from pathlib import Path

from mpifl.rundir.rundir import RunDir


def test_the_log_follows_the_directory_this_run_opened_and_never_goes_into_one_made_since(tmp_path):
    run, moved = tmp_path / "run", tmp_path / "moved"
    run.mkdir()
    opened = RunDir(run)
    opened.log("first\n")
    run.rename(moved)
    run.mkdir()  # another's now
    opened.log("second\n")
    assert (moved / "log.txt").read_text() == "first\nsecond\n" and list(run.iterdir()) == []
    shutil.rmtree(moved)
    opened.log("third\n")  # removed: nowhere to go, and no error (the run stops at its next record)
    assert list(run.iterdir()) == []


def test_a_bugs_traceback_never_goes_into_a_directory_that_replaced_the_runs(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    kept = RunDir(run)
    assert kept.write_traceback(1, "first") == str(run / "traceback-rank1.txt")
    shutil.rmtree(run)
    run.mkdir()  # another's now
    where = kept.write_traceback(1, "second")
    assert not kept.intact() and list(run.iterdir()) == []
    path = Path(where.split(":")[0])
    assert path.read_text() == "second" and f"the run directory {run} was removed or replaced" in where
    path.unlink()
