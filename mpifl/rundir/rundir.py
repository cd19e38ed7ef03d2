"""The run directory once a run makes or claims it, and every file rank 0 writes there (:class:`RunDir`):
steps 3 and 4 of :mod:`.directory`, open and keep.  Callers say what to write; where, under which name, and
whether the directory is still the run's, is decided here.  The client ranks write only their checkpoint files
(:func:`.checkpoint.save_clients`), and a bug's traceback (:meth:`RunDir.write_traceback`)."""

from __future__ import annotations

import csv
import json
import os
import shutil
import tempfile
import weakref
from pathlib import Path

from ..algorithms import ServerState
from ..dirlock import DirectoryLock
from ..errors import MpiflError
from ..plan.config import RunConfig
from . import checkpoint
from .directory import claim, default_run_dir, run_files
from .names import ATTEMPTS, CONFIG, LOG, METRICS, SUMMARY_CSV, SUMMARY_MD, TMP, TRACEBACKS, TRACKING, traceback_file


class RunDir:
    """A run directory as this run opened it, held by a descriptor (so its inode is not reused by a directory made
    later at its path), with the claim this run holds on it (``lock``; None: the file system keeps no locks, or a
    client rank, which claims nothing): what may be written there while the run goes on."""

    def __init__(self, path: Path, lock: DirectoryLock | None = None):
        self.path, self.lock = Path(path), lock
        self._descriptor = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        weakref.finalize(self, os.close, self._descriptor)

    @classmethod
    def create(cls, path: Path, cfg: RunConfig) -> RunDir:
        """Create, claim and check again a new run's directory, and write its ``config.json``.  A default directory
        (no ``--out``) that another run made meanwhile (the same options started in the same second) gives way to
        the next free name (the returned one's ``path``)."""
        while True:
            try:
                path.mkdir(parents=True, exist_ok=cfg.out is not None)
                break
            except FileExistsError:
                path = default_run_dir(cfg)
            except OSError as exc:
                raise MpiflError(f"cannot create the run directory {path} ({exc.strerror}); pass another --out") \
                    from None
        run_dir = cls(path)
        run_dir.lock = claim(path)
        found = run_files(path)
        if found:  # another run took it between the check and now
            run_dir.release()
            raise MpiflError(f"run directory {path} was taken by another run while this one set up "
                             f"({', '.join(found)}); pass another --out")
        run_dir.write_config(cfg)
        return run_dir

    @classmethod
    def claim_resumed(cls, path: Path) -> RunDir:
        """The directory of the run ``--resume`` continues, claimed while the ranks set up (nothing written yet)."""
        run_dir = cls(path)
        run_dir.lock = claim(path, resuming=True)
        return run_dir

    def reopen(self, cfg: RunConfig) -> str | None:
        """A resumed run, once it may write: its ``config.json`` again, and the tracebacks of the attempt that failed
        moved to ``attempts/<k>/`` (the k-th attempt), so the directory shows this attempt's files only; the line
        that says so (also in the log), or None."""
        self.write_config(cfg)
        tracebacks = sorted(self.path.glob(TRACEBACKS))
        if not tracebacks:
            return None
        history = self.path / ATTEMPTS
        k = 1 + sum(1 for p in history.iterdir() if p.is_dir()) if history.is_dir() else 1
        folder = history / str(k)
        folder.mkdir(parents=True)
        for file in tracebacks:
            os.replace(file, folder / file.name)
        line = (f"the failed attempt's {', '.join(f.name for f in tracebacks)} moved to {folder} (attempt {k}); "
                "this attempt writes its own")
        self.log(line + "\n")
        return line

    def write_config(self, cfg: RunConfig) -> None:
        """``config.json``, atomically (temp file + rename: the other ranks of a resumed run read it); and who holds
        the directory, for the message of a second run refused."""
        tmp = self.path / (CONFIG + TMP)
        tmp.write_text(json.dumps(cfg.to_flat(), indent=2) + "\n")
        os.replace(tmp, self.path / CONFIG)
        if self.lock is not None:
            self.lock.describe(f"{cfg.algo} on {cfg.data}, {cfg.rounds} rounds")

    def unmake(self) -> None:
        """Undo :meth:`create` for a run refused right after it (its ``config.json``, what its live trackers began,
        its claim, the empty directory)."""
        (self.path / CONFIG).unlink(missing_ok=True)
        shutil.rmtree(self.path / TRACKING, ignore_errors=True)
        self.release()
        try:
            self.path.rmdir()
        except OSError:
            pass  # something else is there now: not this run's to remove

    def release(self) -> None:
        """Give up the claim (a no-op without one, or once released)."""
        if self.lock is not None:
            self.lock.release()

    def intact(self) -> bool:
        """Whether the directory at the path is still the one opened (not removed, moved or replaced)."""
        mine = _identity(self._descriptor)
        return mine is not None and _identity(self.path) == mine

    def check(self) -> None:
        """Stop (one line) before writing into a run directory that was removed or replaced while the run went on:
        what is at its path now belongs to someone else, and this run's files must not mix with it."""
        if not self.intact():
            raise MpiflError(f"the run directory {self.path} was removed or replaced while this run was writing it; "
                             "the run stops so that its files do not mix with what is there now")

    def log(self, text: str) -> None:
        """Append ``text`` to ``log.txt`` of the directory this run opened, wherever it is now (never to one made
        since at its path); nothing once it was removed (the run stops at its next record, :meth:`check`)."""
        try:
            fd = os.open(LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o666, dir_fd=self._descriptor)
        except FileNotFoundError:  # LOG has no folder in it: the directory itself is gone
            return
        with open(fd, "w") as file:
            file.write(text)

    def rewrite_records(self, records: list[dict]) -> None:
        """``metrics.jsonl`` holding just ``records``, one JSON line each (temp file + rename)."""
        self.check()
        path = self.path / METRICS
        tmp = path.with_name(path.name + TMP)
        tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
        tmp.replace(path)

    def append_record(self, record: dict) -> None:
        """One more line of ``metrics.jsonl``."""
        self.check()
        with (self.path / METRICS).open("a") as f:
            f.write(json.dumps(record) + "\n")

    def write_summaries(self, rows: list[dict], markdown: str) -> None:
        """``summary.csv`` (``rows``, the first row's keys as its header) and ``summary.md`` (``markdown``)."""
        self.check()
        with (self.path / SUMMARY_CSV).open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
        (self.path / SUMMARY_MD).write_text(markdown)

    def save_server(self, round_index: int, state: ServerState) -> checkpoint.FileRecord:
        """The server's file of round ``round_index``'s checkpoint (:func:`.checkpoint.save_server`)."""
        self.check()  # the client ranks write theirs on the same message: none into another's directory
        return checkpoint.save_server(self.path, round_index, state)

    def commit(self, complete: checkpoint.Checkpoint) -> None:
        """Make ``complete`` the checkpoint (:func:`.checkpoint.commit`)."""
        self.check()
        checkpoint.commit(self.path, complete)

    def write_traceback(self, rank: int, text: str) -> str:
        """Rank ``rank``'s traceback of a bug, in the run directory while it is this run's, else in a temporary
        file; where it went, for the rank's one line."""
        if self.intact():
            path = traceback_file(self.path, rank)
            path.write_text(text)
            return str(path)
        with tempfile.NamedTemporaryFile("w", prefix=f"mpifl-traceback-rank{rank}-", suffix=".txt",
                                         delete=False) as file:
            file.write(text)
        return f"{file.name}: the run directory {self.path} was removed or replaced"


def write_fold_table(folder: Path, table: str) -> None:
    """``--holdout all``: the table of its fold runs, ``summary.md`` in their folder."""
    (Path(folder) / SUMMARY_MD).write_text(table)


def _identity(directory: Path | int) -> tuple[int, int] | None:
    """(device, inode) of a directory by path or open descriptor; None when nothing is there (for a descriptor:
    when the directory was removed)."""
    try:
        status = os.stat(directory)
    except OSError:
        return None
    return (status.st_dev, status.st_ino) if status.st_nlink else None
