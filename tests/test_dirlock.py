"""A directory claimed by one holder at a time; a claim ends with its process, however it ends."""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys

import pytest

from mpifl.dirlock import LOCK_NAME, LocksUnsupported, holder, try_lock

from .conftest import REPO


def test_one_holder_at_a_time_and_the_holder_is_described(tmp_path):
    first = try_lock(tmp_path)
    assert first is not None and first.owned
    first.describe("fedavg on styledigits")
    assert try_lock(tmp_path) is None  # another open file description: refused, even in this process
    assert holder(tmp_path).startswith(f"fedavg on styledigits, pid {os.getpid()} on {socket.gethostname()}, since ")
    first.release()
    assert not (tmp_path / LOCK_NAME).exists()
    second = try_lock(tmp_path)
    assert second is not None
    second.release()


@pytest.mark.slow
def test_the_claim_of_a_killed_process_is_taken_over_and_its_lock_file_left_as_it_was(tmp_path):
    code = ("import os, signal, sys; from pathlib import Path; from mpifl.dirlock import try_lock; "
            "try_lock(Path(sys.argv[1])).describe('a run'); os.kill(os.getpid(), signal.SIGKILL)")
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], env={**os.environ, "PYTHONPATH": str(REPO)},
                   timeout=60)
    stale = (tmp_path / LOCK_NAME).read_text()
    assert stale.startswith("a run, pid ")
    lock = try_lock(tmp_path)
    assert lock is not None and not lock.owned
    lock.release()  # a claim that used nothing leaves the file as it found it
    assert (tmp_path / LOCK_NAME).read_text() == stale


def test_a_file_system_without_hard_links_counts_as_one_without_locks_and_keeps_nothing(tmp_path, monkeypatch):
    def no_links(src, dst):
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    with pytest.raises(LocksUnsupported, match="has no hard links"):
        try_lock(tmp_path)
    assert list(tmp_path.iterdir()) == []
