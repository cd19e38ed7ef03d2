"""RunDir: the run directory as this run opened it, and every write into it, never into a directory made since
at its path."""

from __future__ import annotations

import builtins
import errno
import io
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from mpifl.algorithms import ServerState
from mpifl.errors import MpiflError
from mpifl.plan.config import RunConfig
from mpifl.rundir.checkpoint import Checkpoint, FileRecord, save_clients
from mpifl.rundir.directory import claim
from mpifl.rundir.rundir import RunDir

from .test_directory import snapshot


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


class _Filling:
    """A file on a file system with ``room[0]`` bytes left: a write takes what fits, then fails as a full disk
    does (ENOSPC)."""

    def __init__(self, file, room: list[int]):
        self.file, self.room = file, room

    def write(self, data) -> int:
        data = data if isinstance(data, str) else memoryview(data).cast("B")
        if len(data) > self.room[0]:
            self.file.write(data[:self.room[0]])
            self.room[0] = 0
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room[0] -= len(data)
        return self.file.write(data)

    def __getattr__(self, name):
        return getattr(self.file, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.file.close()


def _fill_up(monkeypatch, room: int, folder: Path) -> None:
    """The file system of ``folder`` holds ``room`` more bytes: every file opened there from now on is a
    :class:`_Filling` one."""
    left, real = [room], io.open

    def filling(file, *args, **kwargs):
        opened = real(file, *args, **kwargs)
        where = os.readlink(f"/proc/self/fd/{file}") if isinstance(file, int) else os.path.abspath(file)
        return _Filling(opened, left) if Path(where).is_relative_to(folder) else opened

    monkeypatch.setattr(io, "open", filling)  # pathlib's
    monkeypatch.setattr(builtins, "open", filling)


def _state():
    return ServerState(model={"w": torch.arange(4096, dtype=torch.float32)}, extra={})


def _checkpoint(round_index: int, files_: dict) -> Checkpoint:
    return Checkpoint(round=round_index, clients=1, ranks={1: [0]}, pending=None, identity={}, files=files_)


WRITES = {  # the name each write of a run directory writes, and the write
    "config.json": lambda d: d.write_config(RunConfig()),
    "metrics.jsonl": lambda d: d.append_record({"round": 2, "loss": [0.5] * 100}),
    "metrics.jsonl rewritten": lambda d: d.rewrite_records([{"round": 1, "loss": [0.5] * 100}]),
    "summary.csv": lambda d: d.write_summaries([{"domain": "mono", "test": 0.5}] * 20, "| table |\n" * 20),
    "log.txt": lambda d: d.log("round 2: mean test accuracy 0.5\n" * 20),
    "checkpoint/round-2/server.pt": lambda d: d.save_server(2, _state()),
    "checkpoint/round-2/rank-1.zip": lambda d: save_clients(d, 2, 1, [(0, {"p": torch.ones(1000)})], {}),
    "checkpoint/meta.json": lambda d: d.commit(_checkpoint(2, {f"x{k}": FileRecord(1, "0" * 64) for k in range(20)})),
}


@pytest.mark.parametrize("write", WRITES)
def test_every_write_on_a_full_disk_ends_in_one_line_naming_the_file_and_leaves_nothing_behind(tmp_path, monkeypatch,
                                                                                            write):
    run = tmp_path / "run"
    run.mkdir()
    opened = RunDir(run)
    opened.append_record({"round": 1})
    opened.log("started\n")
    name = write.split()[0]
    before = snapshot(run)
    _fill_up(monkeypatch, 100, run)
    with pytest.raises(MpiflError) as error:
        WRITES[write](opened)
    assert str(error.value) == (f"cannot write {run / name}: No space left on device; free space on its file system; "
                                "no checkpoint was taken: run again with another --out")
    assert snapshot(run) == before  # no temporary file, no partial line, nothing replaced


def test_a_full_disk_after_a_checkpoint_keeps_it_and_says_how_to_continue(tmp_path, monkeypatch):
    run = tmp_path / "run"
    run.mkdir()
    opened = RunDir(run)
    opened.commit(_checkpoint(1, {"server.pt": opened.save_server(1, _state())}))
    before = snapshot(run)
    _fill_up(monkeypatch, 1000, run)  # round 2's server.pt does not fit
    with pytest.raises(MpiflError) as error:
        opened.save_server(2, _state())
    assert str(error.value) == (
        f"cannot write {run}/checkpoint/round-2/server.pt: No space left on device; free space on its file system (or "
        f"copy {run} to a file system that can hold it, and resume the copy); the checkpoint after round 1 is kept: "
        f"continue with --resume {run}")
    assert snapshot(run) == before


def test_a_file_system_that_fails_at_the_flush_to_disk_leaves_no_temporary_file(tmp_path, monkeypatch):
    """A network file system may report a full disk (or its quota) only when the data go to the server."""
    run = tmp_path / "run"
    run.mkdir()
    opened = RunDir(run)

    def over_quota(fd):
        raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))

    monkeypatch.setattr(os, "fsync", over_quota)
    with pytest.raises(MpiflError, match=rf"^cannot write {run}/checkpoint/meta.json: Disk quota exceeded; free "
                                         "space on its file system; no checkpoint was taken"):
        opened.commit(_checkpoint(1, {}))
    assert snapshot(run) == {}


def test_a_checkpoint_written_while_the_directory_is_moved_and_made_again_goes_with_it_and_the_run_stops(
        tmp_path, monkeypatch):
    run, moved = tmp_path / "run", tmp_path / "moved"
    run.mkdir()
    opened = RunDir(run)
    save, midway = torch.save, []

    def saving(obj, file):
        save(obj, file)
        if midway:
            midway.pop()()

    monkeypatch.setattr(torch, "save", saving)

    def move():
        run.rename(moved)
        run.mkdir()  # another's now

    midway.append(move)
    record = opened.save_server(1, _state())
    assert (moved / "checkpoint/round-1/server.pt").stat().st_size == record.nbytes and list(run.iterdir()) == []
    gone = (f"the run directory {run} was removed or replaced while this run was writing it; the run stops so that "
            "its files do not mix with what is there now")
    with pytest.raises(MpiflError, match=f"^{gone}$"):
        opened.commit(_checkpoint(1, {"server.pt": record}))
    assert list(run.iterdir()) == [] and not (moved / "checkpoint/meta.json").exists()
    midway.append(lambda: shutil.rmtree(moved))
    with pytest.raises(MpiflError, match=f"^{gone}$"):
        save_clients(opened, 2, 1, [(0, {"p": torch.ones(1)})], {})  # a client rank's, into the directory it opened
    assert list(run.iterdir()) == []


def test_a_bugs_traceback_on_a_full_disk_goes_to_a_temporary_file_or_else_to_stderr(tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    run.mkdir()
    opened = RunDir(run)
    _fill_up(monkeypatch, 10, run)
    where = opened.write_traceback(0, "Traceback (most recent call last): ...")
    path = Path(where.split(":")[0])
    assert path.read_text() == "Traceback (most recent call last): ..." and list(run.iterdir()) == []
    assert where.startswith(f"{path}: cannot write {run}/traceback-rank0.txt: No space left on device")
    path.unlink()
    _fill_up(monkeypatch, 10, Path(tempfile.gettempdir()))  # and the temporary folder is full too
    before = set(Path(tempfile.gettempdir()).glob("mpifl-traceback-rank0-*"))
    where = opened.write_traceback(0, "Traceback (most recent call last): ...")
    assert set(Path(tempfile.gettempdir()).glob("mpifl-traceback-rank0-*")) == before  # no part of it left
    assert capsys.readouterr().err == "Traceback (most recent call last): ..." and list(run.iterdir()) == []
    assert where.startswith(f"the lines above (cannot write {run}/traceback-rank0.txt: No space left on device")
    assert where.endswith(f"; nor could {tempfile.gettempdir()}: No space left on device)")


def test_a_full_disk_while_the_claim_is_described_is_one_line_too(tmp_path, monkeypatch):
    run = tmp_path / "run"
    run.mkdir()
    opened = RunDir(run, claim(run))

    def full(*args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "pwrite", full)
    with pytest.raises(MpiflError, match=rf"^cannot write {run}/\.mpifl-lock: No space left on device; free space"):
        opened.write_config(RunConfig())
    opened.release()
