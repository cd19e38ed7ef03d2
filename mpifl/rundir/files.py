"""Writing into a directory held open by a descriptor (:class:`Folder`): the one way a run's files are written.

Every write goes into the directory as it was opened, wherever it is now: a directory moved away keeps what
the run writes, and nothing goes into one made since at its path (names are resolved from the descriptor, never
from the path).  A file is written whole or not at all: to ``NAME.tmp``, flushed to disk, renamed onto NAME; an
append that fails is cut back to where it began.  Any failure (a full file system, ``ENOSPC`` or ``EDQUOT``, or
another ``OSError``) removes the temporary file and becomes one line, :meth:`Folder.failed`, that names the
file, the system's words and the fix; a directory removed or replaced meanwhile is said as such.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Callable

from ..errors import MpiflError
from .names import TMP

FULL = (errno.ENOSPC, errno.EDQUOT)  # the file system (or the user's quota on it) is full
READ_ONLY = (errno.EACCES, errno.EPERM, errno.EROFS)


@dataclass(frozen=True)
class FileRecord:
    """What a written file is: its size and sha256."""

    nbytes: int
    sha256: str


class _Hashing:
    """A file being written, hashed on the way (what a writer writes is what is recorded); it keeps the first
    ``OSError`` of a write, which a writer (``torch.save``) may hide behind an error of its own."""

    def __init__(self, file: IO[bytes]):
        self.file, self.digest, self.nbytes, self.error = file, hashlib.sha256(), 0, None

    def write(self, data) -> int:
        try:
            written = self.file.write(data)
        except OSError as exc:
            self.error = self.error or exc
            raise
        self.digest.update(data)
        self.nbytes += len(data)
        return written

    def flush(self) -> None:
        self.file.flush()


class Folder:
    """A directory held by a descriptor (its inode is not reused by a directory made later at its path), and every
    write into it.  Names are relative to it, ``/`` between folders."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._descriptor = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        weakref.finalize(self, os.close, self._descriptor)

    def intact(self) -> bool:
        """Whether the directory at the path is still the one opened (not removed, moved or replaced)."""
        mine = _identity(self._descriptor)
        return mine is not None and _identity(self.path) == mine

    def gone(self) -> MpiflError:
        return MpiflError(f"the run directory {self.path} was removed or replaced while this run was writing it; "
                          "the run stops so that its files do not mix with what is there now")

    def check(self) -> None:
        """Stop (one line) before writing into a directory that was removed or replaced while the run went on:
        what is at its path now belongs to someone else, and this run's files must not mix with it."""
        if not self.intact():
            raise self.gone()

    def failed(self, name: str, exc: OSError) -> MpiflError:
        """The line for a write of ``name`` that failed with ``exc``: the directory gone, or the file, the
        system's words and what to do."""
        if not self.intact():
            return self.gone()
        return MpiflError(f"cannot write {self.path / name}: {exc.strerror or exc}; {self.fix(exc)}")

    def fix(self, exc: OSError) -> str:
        """What to do about ``exc`` on this directory's file system."""
        if exc.errno in FULL:
            return "free space on its file system"
        if exc.errno in READ_ONLY:
            return "make it writable"
        return "check its file system"

    def write(self, name: str, write: Callable[[IO[bytes]], None]) -> FileRecord:
        """``write(file)`` to ``name``, whole or not at all (``name.tmp``, flushed, renamed); its size and sha256.
        Folders on the way are made."""
        folder, _, _ = name.rpartition("/")
        tmp, hashing = name + TMP, None
        try:
            if folder:
                self.mkdir(folder)
            with open(self._open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), "wb") as file:
                hashing = _Hashing(file)
                write(hashing)
                file.flush()
                os.fsync(file.fileno())
            os.replace(tmp, name, src_dir_fd=self._descriptor, dst_dir_fd=self._descriptor)
        except BaseException as exc:
            self._unlink(tmp)
            error = hashing.error if hashing is not None and hashing.error is not None else exc
            if isinstance(error, OSError):
                raise self.failed(name, error) from None
            raise
        return FileRecord(hashing.nbytes, hashing.digest.hexdigest())

    def write_text(self, name: str, text: str) -> FileRecord:
        return self.write(name, lambda file: file.write(text.encode()))

    def append(self, name: str, text: str) -> None:
        """Append ``text`` to ``name`` (made if missing); a failed append is cut back, no partial line stays."""
        try:
            descriptor = self._open(name, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        except OSError as exc:
            raise self.failed(name, exc) from None
        with open(descriptor, "wb", buffering=0) as file:
            start = os.fstat(descriptor).st_size
            try:
                data = text.encode()
                while data:
                    data = data[file.write(data):]
            except OSError as exc:
                os.ftruncate(descriptor, start)
                raise self.failed(name, exc) from None

    def mkdir(self, name: str) -> None:
        """Make folder ``name`` and those on the way (those there are kept)."""
        parts = name.split("/")
        for depth in range(1, len(parts) + 1):
            try:
                os.mkdir("/".join(parts[:depth]), dir_fd=self._descriptor)
            except FileExistsError:
                pass
            except OSError as exc:
                raise self.failed(name, exc) from None

    def replace(self, name: str, new: str) -> None:
        """Rename ``name`` onto ``new``."""
        try:
            os.replace(name, new, src_dir_fd=self._descriptor, dst_dir_fd=self._descriptor)
        except OSError as exc:
            raise self.failed(new, exc) from None

    def names(self, name: str = ".") -> list[str]:
        """The names in folder ``name``, sorted (none if it is not there)."""
        try:
            descriptor = self._open(name, os.O_RDONLY | os.O_DIRECTORY)
        except (FileNotFoundError, NotADirectoryError):
            return []
        try:
            return sorted(os.listdir(descriptor))
        finally:
            os.close(descriptor)

    def remove_tree(self, name: str) -> None:
        """Remove folder ``name`` and what it holds, as far as it can be."""
        shutil.rmtree(name, ignore_errors=True, dir_fd=self._descriptor)

    def _open(self, name: str, flags: int) -> int:
        return os.open(name, flags | os.O_CLOEXEC, 0o666, dir_fd=self._descriptor)

    def _unlink(self, name: str) -> None:
        try:
            os.unlink(name, dir_fd=self._descriptor)
        except OSError:
            pass  # never made, or the directory is gone


def _identity(directory: Path | int) -> tuple[int, int] | None:
    """(device, inode) of a directory by path or open descriptor; None when nothing is there (for a descriptor:
    when the directory was removed)."""
    try:
        status = os.stat(directory)
    except OSError:
        return None
    return (status.st_dev, status.st_ino) if status.st_nlink else None
