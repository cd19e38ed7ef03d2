"""The run directory once a run makes or claims it, and every file rank 0 writes there (:class:`RunDir`):
steps 3 and 4 of :mod:`.directory`, open and keep.  Callers say what to write; where, under which name, and
whether the directory is still the run's, is decided here.  The client ranks write only their checkpoint files
(:func:`.checkpoint.save_clients`, into their own :class:`RunDir` of the directory rank 0 opened), and a bug's
traceback (:meth:`RunDir.write_traceback`).  Every write goes through :class:`.files.Folder`: into the directory
as it was opened, whole or not at all; one that fails (a full disk) ends the run with one line that names the
file and says what the run left to continue from."""

from __future__ import annotations

import csv
import fnmatch
import io
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from ..algorithms import ServerState
from ..dirlock import LOCK_NAME, DirectoryLock
from ..errors import MpiflError
from ..plan.config import RunConfig
from . import checkpoint
from .directory import check_alone, claim, default_run_dir, run_files
from .files import Folder
from .names import ATTEMPTS, CONFIG, LOG, METRICS, SUMMARY_CSV, SUMMARY_MD, TRACEBACKS, TRACKING, traceback_file


class RunDir(Folder):
    """A run directory as this run opened it, held by a descriptor (so its inode is not reused by a directory made
    later at its path), with the claim this run holds on it (``lock``; None: the file system keeps no locks, or a
    client rank, which claims nothing): what may be written there while the run goes on."""

    def __init__(self, path: Path, lock: DirectoryLock | None = None):
        super().__init__(path)
        self.lock = lock
        self.made: list[Path] = []  # the folders create made, the run directory first, then its new parents

    @classmethod
    def create(cls, path: Path, cfg: RunConfig) -> RunDir:
        """Create, claim and check again a new run's directory, and write its ``config.json``.  A default directory
        (no ``--out``) that another run made meanwhile (the same options started in the same second) gives way to
        the next free name (the returned one's ``path``)."""
        while True:
            missing = [p for p in (path, *path.parents) if not os.path.lexists(p)]
            try:
                path.mkdir(parents=True, exist_ok=cfg.out is not None)
                break
            except FileExistsError:
                path = default_run_dir(cfg)
            except OSError as exc:
                raise MpiflError(f"cannot create the run directory {path} ({exc.strerror}); pass another --out") \
                    from None
        run_dir = cls(path)
        run_dir.made = missing
        run_dir.lock = claim(path)
        found = run_files(path)
        if found:  # another run took it between the check and now
            run_dir.release()
            raise MpiflError(f"run directory {path} was taken by another run while this one set up "
                             f"({', '.join(found)}); pass another --out")
        try:  # a run made around or inside it meanwhile: its claim, or this one's, is now there to see
            check_alone(path, cfg.holdout)
        except MpiflError:
            run_dir.unmake()
            raise
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
        tracebacks = [name for name in self.names() if fnmatch.fnmatchcase(name, TRACEBACKS)]
        if not tracebacks:
            return None
        k = 1 + sum(1 for name in self.names(ATTEMPTS) if (self.path / ATTEMPTS / name).is_dir())
        folder = f"{ATTEMPTS}/{k}"
        self.mkdir(folder)
        for name in tracebacks:
            self.replace(name, f"{folder}/{name}")
        line = (f"the failed attempt's {', '.join(tracebacks)} moved to {self.path / folder} (attempt {k}); "
                "this attempt writes its own")
        self.log(line + "\n")
        return line

    def write_config(self, cfg: RunConfig) -> None:
        """``config.json``, atomically (temp file + rename: the other ranks of a resumed run read it); and who holds
        the directory, for the message of a second run refused."""
        self.write_text(CONFIG, json.dumps(cfg.to_flat(), indent=2) + "\n")
        if self.lock is not None:
            try:
                self.lock.describe(f"{cfg.algo} on {cfg.data}, {cfg.rounds} rounds")
            except OSError as exc:
                raise self.failed(LOCK_NAME, exc) from None

    def unmake(self) -> None:
        """Undo :meth:`create` for a run refused right after it (its ``config.json``, what its live trackers began,
        its claim, the folders it made while they are empty)."""
        (self.path / CONFIG).unlink(missing_ok=True)
        shutil.rmtree(self.path / TRACKING, ignore_errors=True)
        self.release()
        for folder in self.made:
            try:
                folder.rmdir()
            except OSError:
                return  # something else is there now: not this run's to remove

    def release(self) -> None:
        """Give up the claim (a no-op without one, or once released)."""
        if self.lock is not None:
            self.lock.release()

    def failed(self, name: str, exc: OSError) -> MpiflError:
        """:meth:`.files.Folder.failed`, with what the run leaves to continue from: its last checkpoint, kept."""
        error = super().failed(name, exc)
        if not self.intact():
            return error
        done = checkpoint.committed_round(self.path)
        if done is None:
            return MpiflError(f"{error}; no checkpoint was taken: run again with another --out")
        return MpiflError(f"{error} (or copy {self.path} to a file system that can hold it, and resume the copy); the "
                          f"checkpoint after round {done} is kept: continue with --resume {self.path}")

    def log(self, text: str, best_effort: bool = False) -> None:
        """Append ``text`` to ``log.txt`` of the directory this run opened, wherever it is now (never to one made
        since at its path); nothing once it was removed (the run stops at its next record, :meth:`check`).
        ``best_effort``: a line that tells of another fault (a lost node, a tracker dropped), also on stderr, is
        passed over where it cannot be written (a full disk), so that it never becomes a fault of its own."""
        try:
            self.append(LOG, text)
        except MpiflError:
            if self.intact() and not best_effort:
                raise
            # removed or replaced: the moved directory, if any, had the log; the next record stops the run

    def rewrite_records(self, records: list[dict]) -> None:
        """``metrics.jsonl`` holding just ``records``, one JSON line each (temp file + rename)."""
        self.check()
        self.write_text(METRICS, "".join(json.dumps(r) + "\n" for r in records))

    def append_record(self, record: dict) -> None:
        """One more line of ``metrics.jsonl``."""
        self.check()
        self.append(METRICS, json.dumps(record) + "\n")

    def write_summaries(self, rows: list[dict], markdown: str) -> None:
        """``summary.csv`` (``rows``, the first row's keys as its header) and ``summary.md`` (``markdown``)."""
        self.check()
        table = io.StringIO(newline="")
        writer = csv.DictWriter(table, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
        self.write_text(SUMMARY_CSV, table.getvalue())
        self.write_text(SUMMARY_MD, markdown)

    def save_server(self, round_index: int, state: ServerState) -> checkpoint.FileRecord:
        """The server's file of round ``round_index``'s checkpoint (:func:`.checkpoint.save_server`)."""
        self.check()  # the client ranks write theirs on the same message: none into another's directory
        return checkpoint.save_server(self, round_index, state)

    def commit(self, complete: checkpoint.Checkpoint) -> None:
        """Make ``complete`` the checkpoint (:func:`.checkpoint.commit`)."""
        self.check()
        checkpoint.commit(self, complete)

    def write_traceback(self, rank: int, text: str) -> str:
        """Rank ``rank``'s traceback of a bug, in the run directory while it is this run's, else in a temporary
        file, else (neither can hold it) on stderr; where it went, for the rank's one line."""
        why = f"the run directory {self.path} was removed or replaced"
        if self.intact():
            name = traceback_file(Path(), rank).name
            try:
                self.write_text(name, text)
                return str(self.path / name)
            except MpiflError as exc:
                why = str(exc)
        name = None
        try:
            descriptor, name = tempfile.mkstemp(prefix=f"mpifl-traceback-rank{rank}-", suffix=".txt")
            with open(descriptor, "w") as file:
                file.write(text)
        except OSError as exc:
            if name is not None:
                Path(name).unlink(missing_ok=True)
            sys.stderr.write(text)
            return f"the lines above ({why}; nor could {tempfile.gettempdir()}: {exc.strerror or exc})"
        return f"{name}: {why}"


def write_fold_table(folder: Path, table: str) -> None:
    """``--holdout all``: the table of its fold runs, ``summary.md`` in their folder."""
    Folder(folder).write_text(SUMMARY_MD, table)
