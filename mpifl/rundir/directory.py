"""The run directory: ``--out`` or ``runs/<algo>-<data>-<model>-s<seed>-<time>``, which belongs to one run.

Rank 0 owns it, in four steps, so that results are never lost, overwritten or mixed, and a refused command
changes nothing on disk:

1. **check** while setting up, writing nothing: a new run's directory may not be a file, have a name the file
   system cannot hold, or hold any file a run writes (:data:`RUN_FILES`: a finished run, a run stopped before its
   first record, one that crashed while starting); a resumed run's directory is claimed (next step) for the
   checks of its checkpoint;
2. **claim** (:mod:`mpifl.dirlock`): a run holds its directory for its whole life, so a second run, or a resume,
   of the same directory is refused while the first lives; the claim ends with the process however it ends,
   and a crashed run's directory is resumable at once;
3. **open** once every rank has set up: create a new directory (claimed, then checked again, which settles a race
   between two runs given the same ``--out``), write the resolved ``config.json`` that ``--config`` and
   ``--resume`` read back;
4. **keep**: before each record and the summaries, rank 0 checks that the directory at the path is still the one
   it opened (:class:`~mpifl.server.run_log.MetricsLog`): a run whose directory was removed, or removed and made
   again by another run, stops with one line instead of writing into what is there now.
"""

from __future__ import annotations

import datetime
import fnmatch
import json
import os
from pathlib import Path

from ..dirlock import LOCK_NAME, DirectoryLock, LocksUnsupported, holder, try_lock
from ..errors import MpiflError
from ..plan.config import RunConfig
from .names import ATTEMPTS, CHECKPOINT, CHECKPOINT_META, CONFIG, RUN_FILES, RUN_MARKS, TMP, TRACEBACKS


def run_files(path: Path) -> list[str]:
    """The names in ``path`` that a run writes, sorted."""
    try:
        names = os.listdir(path)
    except (FileNotFoundError, NotADirectoryError):
        return []
    except OSError as exc:
        raise MpiflError(f"cannot read the run directory {path} ({exc.strerror}); pass a readable --out") from None
    return sorted(n for n in names if any(fnmatch.fnmatchcase(n, pattern) for pattern in RUN_FILES))


def default_run_dir(cfg: RunConfig) -> Path:
    """``runs/<algo>-<data>-<model>-s<seed>-<time>``, with ``_1``, ``_2``, ... appended while that exists."""
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    base = path = Path("runs") / f"{cfg.algo}-{cfg.data}-{cfg.model}-s{cfg.seed}-{stamp}"
    suffix = 1
    while path.exists():
        path = base.with_name(f"{base.name}_{suffix}")
        suffix += 1
    return path


def check_new(path: Path) -> None:
    """Refuse (one line, nothing written) a directory a new run cannot own."""
    _check_creatable(path)
    _check_not_inside_a_run(path)
    if (path / LOCK_NAME).exists():  # a live run's (refused here, naming it), or a crashed one's
        probe = claim(path)
        if probe is not None:
            probe.release()
    found = run_files(path)
    if found:
        resumable = (path / CHECKPOINT / CHECKPOINT_META).is_file()
        raise MpiflError(f"run directory {path} already holds a run ({', '.join(found)}); a run directory belongs "
                         "to one run: pass another --out" + (f", or --resume {path} to continue that run" if resumable
                                                             else ", or remove it"))


def _check_not_inside_a_run(path: Path) -> None:
    """``path`` lies in no other run's directory (live or finished): a run nested in a run would mix them."""
    for parent in path.absolute().parents:
        marks = [name for name in RUN_MARKS if _lexists(parent / name)]
        if marks:
            raise MpiflError(f"--out {path} lies inside the run directory {parent} (it holds {', '.join(marks)}); "
                             "a run directory belongs to one run: pass an --out outside it")


def _check_creatable(path: Path) -> None:
    """``path`` is a directory, or can be made one: no file in the way, names the file system can hold."""
    absolute = path.absolute()
    existing = next(p for p in [absolute, *absolute.parents] if _lexists(p))
    limit = os.pathconf(existing, "PC_NAME_MAX") if existing.is_dir() else 255
    for name in absolute.relative_to(existing).parts:
        if len(name.encode()) > limit:
            raise MpiflError(f"cannot create the run directory {path}: the name {name[:24]}... has "
                             f"{len(name.encode())} bytes, more than the {limit} the file system allows; pass a "
                             "shorter --out")
    if not existing.is_dir():
        if existing == absolute:
            raise MpiflError(f"--out {path} is a file, not a directory; pass a directory for the run")
        raise MpiflError(f"cannot create the run directory {path}: {existing} is a file; pass another --out")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise MpiflError(f"cannot create the run directory {path}: {existing} is not writable; pass another --out")


def _lexists(path: Path) -> bool:
    try:
        os.lstat(path)
    except OSError:  # missing, or a name too long to look up
        return False
    return True


def claim(path: Path) -> DirectoryLock | None:
    """Hold ``path`` (an existing directory) for this run; refused while another run holds it.  None: the file
    system keeps no locks, and only the checks of :func:`check_new` keep runs apart."""
    try:
        lock = try_lock(path)
    except LocksUnsupported:
        return None
    except OSError as exc:
        raise MpiflError(f"cannot claim the run directory {path} ({exc.strerror}); pass a writable --out") from None
    if lock is None:
        who = holder(path) or "a run that is starting"
        raise MpiflError(f"run directory {path} is in use by another run ({who}); wait for it to end or pass "
                         "another --out")
    return lock


def open_new(path: Path, cfg: RunConfig) -> tuple[Path, DirectoryLock | None]:
    """Create, claim and check again a new run's directory, and write its ``config.json``.  A default directory
    (no ``--out``) that another run made meanwhile (the same options started in the same second) gives way to
    the next free name, so it is returned."""
    while True:
        try:
            path.mkdir(parents=True, exist_ok=cfg.out is not None)
            break
        except FileExistsError:
            path = default_run_dir(cfg)
        except OSError as exc:
            raise MpiflError(f"cannot create the run directory {path} ({exc.strerror}); pass another --out") from None
    lock = claim(path)
    found = run_files(path)
    if found:  # another run took it between the check and now
        if lock is not None:
            lock.release()
        raise MpiflError(f"run directory {path} was taken by another run while this one set up ({', '.join(found)}); "
                         "pass another --out")
    write_config(path, cfg, lock)
    return path, lock


def archive_attempt(path: Path) -> str | None:
    """A resumed run, once it may write: the tracebacks of the attempt that failed go to ``attempts/<k>/`` (the
    k-th attempt), so the directory shows this attempt's files only; the line for the log, or None."""
    tracebacks = sorted(path.glob(TRACEBACKS))
    if not tracebacks:
        return None
    history = path / ATTEMPTS
    k = 1 + sum(1 for p in history.iterdir() if p.is_dir()) if history.is_dir() else 1
    folder = history / str(k)
    folder.mkdir(parents=True)
    for file in tracebacks:
        os.replace(file, folder / file.name)
    return (f"the failed attempt's {', '.join(f.name for f in tracebacks)} moved to {folder} (attempt {k}); "
            "this attempt writes its own")


def write_config(path: Path, cfg: RunConfig, lock: DirectoryLock | None) -> None:
    """``config.json``, atomically (temp file + rename: the other ranks of a resumed run read it); and who holds
    the directory, for the message of a second run refused."""
    tmp = path / (CONFIG + TMP)
    tmp.write_text(json.dumps(cfg.to_flat(), indent=2) + "\n")
    os.replace(tmp, path / CONFIG)
    if lock is not None:
        lock.describe(f"{cfg.algo} on {cfg.data}, {cfg.rounds} rounds")
