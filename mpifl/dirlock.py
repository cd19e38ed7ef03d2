"""A directory claimed by one process at a time: a run directory (one run writes it) or a converter's staging
directory (whose converter may have died).

The claim is an ``flock`` on ``<directory>/.mpifl-lock``.  The kernel drops it when the holding process ends,
however it ends (SIGKILL and the OOM killer included), so a lock file that a crash left behind holds nothing and
is taken over: a stale claim is recognized without guessing from pids.  A new lock file is locked before it
appears at its path (it is made under a private name and hard-linked into place), so no one finds a live
creator's file free in the moment between making and locking it.  The holder writes who it is into the file
(:meth:`DirectoryLock.describe`) for the message of whoever is refused.  Releasing removes the file, while still
holding it, once it is the holder's own (created or described by it: a stale file is left as it was by a claim
that ends without using the directory); :func:`try_lock` re-checks, once it holds a lock, that the file it locked
is still the one at the path, so a process that opened the file just before its removal never believes it holds
the directory.

``flock`` is kept by NFS (as a POSIX lock) and by Lustre mounted with ``flock``; where the file system has no
locks at all, or no hard links (:class:`LocksUnsupported`), the caller decides what it can still promise.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import os
import secrets
import shutil
import socket
import time
from pathlib import Path

LOCK_NAME = ".mpifl-lock"
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


class LocksUnsupported(OSError):
    """The file system of the directory refuses ``flock``."""


class DirectoryLock:
    """A held claim on ``directory``; :meth:`release` (or the end of the process) gives it up."""

    def __init__(self, directory: Path, fd: int, created: bool):
        self.directory, self.fd = directory, fd
        self.owned = created  # the lock file is this claim's own: removed on release

    @property
    def path(self) -> Path:
        return self.directory / LOCK_NAME

    def describe(self, what: str) -> None:
        """Write who holds the directory (``what`` it does) into the lock file."""
        started = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
        text = f"{what}, pid {os.getpid()} on {socket.gethostname()}, since {started}\n".encode()
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, text, 0)
        self.owned = True

    def release(self) -> None:
        """Give the directory up, removing the lock file if it is this claim's own (a no-op once released)."""
        if self.fd < 0:
            return
        if self.owned:
            self.path.unlink(missing_ok=True)
        os.close(self.fd)
        self.fd = -1


def try_lock(directory: Path) -> DirectoryLock | None:
    """Claim the existing ``directory``; None while a live process holds it.  Raises :class:`LocksUnsupported`."""
    path = Path(directory) / LOCK_NAME
    while True:
        fd = _publish_locked(path)
        if fd is not None:
            return DirectoryLock(Path(directory), fd, created=True)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:  # released between the two attempts
            continue
        try:
            _flock(fd, directory)
        except BlockingIOError:
            os.close(fd)
            return None
        except BaseException:
            os.close(fd)
            raise
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return DirectoryLock(Path(directory), fd, created=False)
        os.close(fd)  # the file we locked was released and removed meanwhile: claim the new one


def _publish_locked(path: Path) -> int | None:
    """A new lock file at ``path`` that is locked before it appears there (made under a private name, locked, then
    hard-linked into place), so that no one ever finds a live creator's lock file free; None if one is there."""
    private = path.with_name(f"{LOCK_NAME}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(private, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        _flock(fd, path.parent)
        try:
            os.link(private, path)
        except OSError as exc:
            if exc.errno in _NO_LOCKS + (errno.EPERM,):
                raise LocksUnsupported(exc.errno, f"the file system of {path.parent} has no hard links") from None
            raise
    except FileExistsError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    finally:
        private.unlink(missing_ok=True)
    return fd


def _flock(fd: int, directory) -> None:
    """Take ``flock`` on ``fd`` without waiting (BlockingIOError: held); a file system without file locks raises
    :class:`LocksUnsupported`."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in _NO_LOCKS:
            raise LocksUnsupported(exc.errno, f"the file system of {directory} has no file locks") from None
        raise


def holder(directory: Path) -> str:
    """What the lock file of ``directory`` says of its holder ('' when it says nothing)."""
    try:
        return (Path(directory) / LOCK_NAME).read_text().strip()
    except OSError:
        return ""


def remove_unheld(parent: Path, pattern: str, unclaimed_after: float) -> list[Path]:
    """Remove the directories in ``parent`` matching ``pattern`` that no live process holds (a holder died, the
    SIGKILL or OOM killer's leftovers); return them.  One without a lock file counts as unheld once
    ``unclaimed_after`` seconds old (its maker may be about to claim it); where the file system keeps no
    locks, none is removed (whether its holder lives cannot be told)."""
    removed = []
    for path in sorted(Path(parent).glob(pattern)):
        if not path.is_dir() or path.is_symlink():
            continue
        if (path / LOCK_NAME).exists():
            try:
                lock = try_lock(path)
            except OSError:
                continue
            if lock is None:
                continue  # its holder lives
        elif time.time() - path.stat().st_mtime > unclaimed_after:
            lock = None
        else:
            continue  # just made: its maker is about to claim it
        shutil.rmtree(path, ignore_errors=True)
        if lock is not None:
            lock.release()
        removed.append(path)
    return removed
