"""Staging directories of the converters: a converter killed outright leaves one, the next converter under the same
--out removes it, and never one whose converter still works."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time

import pytest

from mpifl.data.folders import convert_folders
from mpifl.data.staging import UNCLAIMED_STALE_SECONDS, remove_stale, staging_dir
from mpifl.dirlock import LOCK_NAME

from ..conftest import REPO
from .test_folders import make_tree, toy_spec

STAGE = "from pathlib import Path; from mpifl.data.staging import staging_dir; import os, signal, sys, time\n" \
        "tmp, lock = staging_dir(Path(sys.argv[1]), 'toy'); (tmp / 'toy').mkdir(); print(tmp, flush=True)\n"


def _converter(out, then: str) -> tuple[subprocess.Popen, str]:
    """A process that makes a staging directory under ``out`` as a converter does, then runs ``then``."""
    proc = subprocess.Popen([sys.executable, "-c", STAGE + then, str(out)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    return proc, proc.stdout.readline().strip()


@pytest.mark.slow
def test_the_next_prepare_removes_the_staging_directory_of_a_converter_killed_outright(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    working, live = _converter(out, "time.sleep(60)")
    killed, stale = _converter(out, "os.kill(os.getpid(), signal.SIGKILL)")
    killed.wait(30)
    try:
        assert os.path.isdir(stale) and os.path.exists(os.path.join(stale, LOCK_NAME))
        src = tmp_path / "src"
        make_tree(src, {"One": {"x": 3, "y": 3}, "Two B": {"x": 3, "y": 3}})
        convert_folders(toy_spec(), src, out, size=8)
        assert not os.path.exists(stale)  # no live process held it
        assert os.path.isdir(live)  # its converter is still at work
        assert sorted(p.name for p in out.iterdir()) == sorted(["toy", os.path.basename(live)])
    finally:
        working.kill()
    working.wait(30)
    assert remove_stale(out) == [out / os.path.basename(live)]


def test_an_unclaimed_staging_directory_is_stale_once_a_minute_old(tmp_path):
    """Made by an older mpifl, or killed between making it and claiming it: no lock file to ask."""
    young, old = tmp_path / ".toy.tmp-1-young", tmp_path / ".toy.tmp-2-old"
    young.mkdir()
    old.mkdir()
    past = time.time() - UNCLAIMED_STALE_SECONDS - 5
    os.utime(old, (past, past))
    (tmp_path / ".not-staging").mkdir()
    assert remove_stale(tmp_path) == [old]
    assert young.is_dir() and (tmp_path / ".not-staging").is_dir()


def test_a_staging_directory_is_never_removed_between_its_making_and_its_claim(tmp_path, monkeypatch):
    """Another converter cleaning up while this one takes its lock finds nothing free to remove (it once found the
    new lock file before its flock, took it, and removed a live converter's staging directory)."""
    real_flock, rival_removed = fcntl.flock, []

    def flock_after_a_rival_cleans_up(fd, operation):
        if not rival_removed:  # the first flock is this converter's; the rival's own flock is left alone
            rival_removed.append(None)
            rival_removed[0] = remove_stale(tmp_path)
        return real_flock(fd, operation)

    monkeypatch.setattr(fcntl, "flock", flock_after_a_rival_cleans_up)
    tmp, lock = staging_dir(tmp_path, "toy")
    assert rival_removed == [[]] and tmp.is_dir() and lock is not None
    assert remove_stale(tmp_path) == []
    lock.release()
