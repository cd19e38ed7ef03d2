"""Writing a prepared dataset so that it appears whole or not at all.

Converters build ``<out>/<name>`` inside a hidden staging directory next to
it (``.<name>.tmp-<pid>-<random>``) and rename it into place only when every
shard and the manifest are written; on any error (or Ctrl-C) the staging
directory, and a ``--data-root`` folder the converter created, are removed, so no
partial shard is left.  A converter killed outright (SIGKILL, the OOM killer)
cannot clean up: its staging directory stays until the next converter under
the same ``--data-root`` finds it stale and removes it.  Stale means that no live
process holds it: a converter holds its staging directory's lock
(:mod:`mpifl.dirlock`) from the moment it makes it, and the kernel drops the
lock when the process dies; one without a lock file (killed before it took
it, or made by an older mpifl) is stale once a minute old.

A build of the dataset already at ``<out>/<name>`` is replaced only by the same build (the same shards' content,
:func:`~mpifl.data.manifest.build_difference`), or under ``prepare --replace`` (:data:`REPLACING`): runs
checkpointed on a build resume only on it.  ``prepare`` refuses a request that must differ (another
``--size``) before converting, :func:`check_replacing`; the converted build is compared before it is installed.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from mpifl.data.manifest import MANIFEST, DatasetManifest, build_difference, build_of
from mpifl.dirlock import DirectoryLock, LocksUnsupported, remove_unheld, try_lock
from mpifl.errors import MpiflError

UNCLAIMED_STALE_SECONDS = 60  # a staging directory with no lock file is stale once this old
#: Whether a converter may replace a build under ``--data-root`` that differs from the one it made (``--replace``).
REPLACING = contextvars.ContextVar("replacing", default=False)


def source_dir(name: str, src, holding: str) -> Path:
    """``--src`` as a Path; a missing one, or one that is no folder, is refused naming what it must hold."""
    if src is None:
        raise MpiflError(f"{name} is converted from a download: pass --src DIR holding {holding}")
    src = Path(src)
    if not src.is_dir():
        raise MpiflError(f"source folder {src} does not exist; pass --src DIR holding {holding}")
    return src


def check_target(final: Path, src: Path) -> None:
    """Refuse an output folder that is the source, holds it, or holds anything but a prepared dataset."""
    final_r, src_r = final.resolve(), src.resolve()
    if final_r == src_r or final_r in src_r.parents:
        raise MpiflError(f"output {final} would replace the source {src}; choose another --data-root")
    if final.exists() or final.is_symlink():
        if not final.is_dir() or final.is_symlink():
            raise MpiflError(f"{final} exists and is not a dataset folder; remove it or choose another --data-root")
        strangers = [p.name for p in final.iterdir()
                     if not (p.is_file() and (p.suffix == ".h5" or p.name == MANIFEST or ".tmp-" in p.name))]
        if strangers:
            raise MpiflError(f"{final} exists and holds {strangers[0]!r}, which is not part of a prepared "
                             "dataset; remove it or choose another --data-root")


@contextlib.contextmanager
def staged_dataset(out: Path, name: str, src: Path) -> Iterator[Path]:
    """Yield the directory to build ``<out>/<name>`` in; install it on success, remove it on failure."""
    final = out / name
    check_target(final, src)
    created_out = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    tmp, lock = staging_dir(out, name)
    try:
        yield tmp / name
        _install(tmp / name, final)
    except BaseException:
        discard_staging(tmp, lock)
        if created_out:
            with contextlib.suppress(OSError):
                out.rmdir()
        raise
    discard_staging(tmp, lock)


def staging_dir(out: Path, name: str) -> tuple[Path, DirectoryLock | None]:
    """A new staging directory for dataset ``name`` under ``out``, held by this process (the lock is None where
    the file system keeps no locks), after removing the stale ones that converters killed outright left."""
    remove_stale(out)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-{os.getpid()}-", dir=out))
    try:
        return tmp, try_lock(tmp)
    except LocksUnsupported:
        return tmp, None


def remove_stale(out: Path) -> list[Path]:
    """Remove the staging directories under ``out`` that no live process holds; return them."""
    return remove_unheld(out, ".*.tmp-*", UNCLAIMED_STALE_SECONDS)


def discard_staging(tmp: Path, lock: DirectoryLock | None) -> None:
    """Remove a staging directory of :func:`staging_dir` and give it up."""
    shutil.rmtree(tmp, ignore_errors=True)
    if lock is not None:
        lock.release()


def check_replacing(final: Path, size: int | None) -> None:
    """Refuse, before converting, to prepare ``final`` at ``size`` px when it holds a build of other images' size
    (unless :data:`REPLACING`).  A size left to the converter, or another source, is compared once converted."""
    existing = _existing_build(final)
    if existing is not None and size is not None and list(existing.image_size) != [size, size]:
        raise MpiflError(_replacing(final, existing, f"at {size}x{size} px"))


def _existing_build(final: Path) -> DatasetManifest | None:
    """The build at ``final`` that runs may be checkpointed on; None when there is none, or one that cannot be
    read (no run can use it: a converter replaces it), or :data:`REPLACING`."""
    if REPLACING.get() or not (final / MANIFEST).is_file():
        return None
    try:
        return DatasetManifest.load(final.parent, final.name)
    except MpiflError:
        return None


def _replacing(final: Path, existing: DatasetManifest, new: str) -> str:
    origin = existing.source.rpartition("converted from ")[2]
    return (f"{final} holds a build of {existing.name} ({existing.image_size[0]}x{existing.image_size[1]} px, from "
            f"{origin}); this one ({new}) would replace it, and runs checkpointed on it could no longer resume; pass "
            "another --data-root, or --replace to replace it")


def _install(built: Path, final: Path) -> None:
    """Move the finished dataset folder onto ``final``, replacing an earlier prepared copy of the same build (or
    any, :data:`REPLACING`)."""
    if not final.exists():
        os.rename(built, final)
        return
    existing = _existing_build(final)
    if existing is not None:
        changed = build_difference(build_of(existing), build_of(DatasetManifest.load(built.parent, built.name)))
        if changed:
            raise MpiflError(_replacing(final, existing, changed))
    old = built.parent / f"old-{final.name}"
    os.rename(final, old)
    try:
        os.rename(built, final)
    except BaseException:
        os.rename(old, final)
        raise
    shutil.rmtree(old, ignore_errors=True)
