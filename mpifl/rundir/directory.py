"""The run directory: ``--out`` or ``runs/<algo>-<data>-<model>-s<seed>-<time>``, which belongs to one run.

Rank 0 owns it, in four steps, so that results are never lost, overwritten or mixed, and a refused command
changes nothing on disk:

1. **check** while setting up, writing nothing: a new run's directory is where its path leads (:func:`place`:
   symbolic links followed, ``..`` after them); it may not be a file, have a name the file system cannot hold,
   hold any file a run writes (:data:`RUN_FILES`: a finished run, a run stopped before its first record, one that
   crashed while starting), lie inside another run's directory or ``--holdout all``'s folder of folds, or hold a
   run's directory below it; a resumed run's directory is claimed (next step) for the checks of its checkpoint;
2. **claim** (:mod:`mpifl.dirlock`): a run holds its directory for its whole life, so a second run, or a resume,
   of the same directory is refused while the first lives; the claim ends with the process however it ends,
   and a crashed run's directory is resumable at once;
3. **open** once every rank has set up (:meth:`.rundir.RunDir.create`): create a new directory (claimed, then
   checked again, which settles a race between two runs given the same ``--out``, or one inside the other:
   :func:`check_alone`), write the resolved
   ``config.json`` that ``--config`` and ``--resume`` read back;
4. **keep** (:class:`.rundir.RunDir`, which writes every file of the run but the client ranks' checkpoint files):
   before each record, checkpoint and the summaries, rank 0 checks that the directory at the path is still the one
   it opened: a run whose directory was removed, or moved and made again, stops with one line instead of writing
   into what is there now, and neither the log nor a bug's traceback ever goes into such a directory.

This module holds the first two steps.
"""

from __future__ import annotations

import datetime
import errno
import fnmatch
import hashlib
import os
from pathlib import Path

from ..dirlock import LOCK_NAME, DirectoryLock, LocksUnsupported, holder, try_lock
from ..errors import MpiflError
from ..plan.config import RunConfig
from .names import CHECKPOINT, CHECKPOINT_META, CONFIG, HOLDOUT_FOLD, RUN_FILES, RUN_MARKS


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


def check_new(path: Path, holdout: str | None = None) -> Path:
    """Refuse (one line, nothing written) a directory a new run cannot own; else where to make it (:func:`place`).
    ``holdout``: the run's ``--holdout`` domain, whose fold directory may lie beside its sibling folds."""
    where = place(path)
    shown = _shown(path, where)
    _check_creatable(where, shown)
    check_alone(where, holdout, shown)
    if (where / LOCK_NAME).exists():  # a live run's (refused here, naming it), or a crashed one's
        probe = claim(where)
        if probe is not None:
            probe.release()
    found = run_files(where)
    if found:
        resumable = (where / CHECKPOINT / CHECKPOINT_META).is_file()
        raise MpiflError(f"run directory {shown} already holds a run ({', '.join(found)}); a run directory belongs "
                         "to one run: pass another --out" + (f", or --resume {path} to continue that run" if resumable
                                                             else ", or remove it"))
    return where


def check_alone(where: Path, holdout: str | None = None, shown: str | None = None) -> None:
    """``where`` lies in no other run's directory and holds none (:func:`check_new`'s nesting checks).  A new run
    makes them again once it holds its directory (:meth:`.rundir.RunDir.create`): its claim is then a mark that
    the other run's checks see, so of two runs started together, one inside the other, at least one is refused."""
    shown = str(where) if shown is None else shown
    _check_not_inside_a_run(where, shown, holdout)
    _check_holds_no_run(where, shown)


def place(path: Path) -> Path:
    """Where ``path`` leads, as the kernel resolves it: symbolic links followed at any depth, ``..`` taken after the
    links before it; the path as given (lexically normalized) when that is the same place.  A link that points
    nowhere or loops is refused: a run directory is never made at a link's target."""
    absolute = path.absolute()
    for depth in range(1, len(absolute.parts) + 1):
        prefix = Path(*absolute.parts[:depth])
        if not os.path.islink(prefix):
            if not _lexists(prefix):
                break  # nothing below a missing name exists
            continue
        try:
            os.stat(prefix)
        except OSError as exc:
            problem = ("is a symbolic link that loops" if exc.errno == errno.ELOOP else
                       f"is a symbolic link to {os.readlink(prefix)}, which does not exist")
            raise MpiflError(f"--out {path}: {prefix} {problem}; fix the link or pass another --out") from None
    real = path.resolve()
    normal = Path(os.path.normpath(path))
    return normal if normal.resolve() == real else real


def _shown(path: Path, where: Path) -> str:
    """``path`` for a message, with where it leads when that reads otherwise (through a symbolic link)."""
    real = where.resolve()
    return str(path) if Path(os.path.normpath(path.absolute())) == real else f"{path} ({real})"


def _check_not_inside_a_run(where: Path, shown: str, holdout: str | None) -> None:
    """``where`` lies in no other run's directory (live or finished) and in no ``--holdout all`` folder of folds but
    as its own fold: a run nested in a run would mix them."""
    real = where.resolve()
    for parent in real.parents:
        marks = [name for name in RUN_MARKS if _lexists(parent / name)]
        if marks:
            raise MpiflError(f"--out {shown} lies inside the run directory {parent} (it holds {', '.join(marks)}); "
                             "a run directory belongs to one run: pass an --out outside it")
        folds = [p.name for p in sorted(parent.glob(HOLDOUT_FOLD.format(domain="*"))) if _is_run(p)]
        own_fold = parent == real.parent and holdout and real.name == HOLDOUT_FOLD.format(domain=holdout)
        if folds and not own_fold:
            raise MpiflError(f"--out {shown} lies inside {parent}, --holdout all's folder of folds (it holds "
                             f"{', '.join(folds)}); pass an --out outside it")


def _check_holds_no_run(where: Path, shown: str) -> None:
    """No run's directory lies below ``where``, nor a symbolic link that leads to one, into one or to a folder
    holding one: a run around runs would mix them (and hide them from reports)."""
    real = where.resolve()
    for folder, dirs, files in os.walk(real):  # links are not walked into: each is looked at where it leads
        dirs.sort()
        marks = [name for name in RUN_MARKS if name in dirs or name in files]
        if marks and folder != str(real):
            raise MpiflError(f"--out {shown} holds the run directory {folder} (it holds {', '.join(marks)}); a run "
                             "directory belongs to one run: pass an --out that holds no run, such as a new folder "
                             "beside them")
        for name in dirs:
            link = Path(folder) / name
            run = _run_reached(link, real) if link.is_symlink() else None
            if run is not None:
                raise MpiflError(f"--out {shown} holds {link}, a symbolic link to the run directory {run}; a run "
                                 "directory belongs to one run: pass an --out that holds no link to a run, such as "
                                 "a new folder")


def _run_reached(link: Path, around: Path) -> Path | None:
    """The run directory that the directory ``link`` (below ``around``) leads to is, lies in, or holds (the first
    found); None.  A link back up to ``around`` or above it leads to what the other checks see already."""
    target = link.resolve()
    for candidate in (target, *target.parents):
        if _is_run(candidate):
            return candidate
    if target == around or target in around.parents:
        return None
    for folder, dirs, files in os.walk(target):
        dirs.sort()
        if any(name in dirs or name in files for name in RUN_MARKS):
            return Path(folder)
    return None


def _is_run(path: Path) -> bool:
    return any(_lexists(path / name) for name in RUN_MARKS)


def check_output_folder(path: Path, fix: str) -> None:
    """A tool's output folder (a report's, an analysis', by default inside the run directory) can be made and
    written: checked before the work, one line naming it and ``fix`` if not (a run on a read-only mount)."""
    existing = _nearest(path.absolute())
    if not existing.is_dir():
        raise MpiflError(f"cannot write into {path}: {existing} is a file; {fix}")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise MpiflError(f"cannot write into {path}: {existing} is not writable; {fix}")


def _check_creatable(path: Path, shown: str) -> None:
    """``path`` is a directory, or can be made one: no file in the way, names the file system can hold."""
    absolute = path.absolute()
    existing = _nearest(absolute)
    limit = os.pathconf(existing, "PC_NAME_MAX") if existing.is_dir() else 255
    for name in absolute.relative_to(existing).parts:
        if len(name.encode()) > limit:
            raise MpiflError(f"cannot create the run directory {shown}: the name {name[:24]}... has "
                             f"{len(name.encode())} bytes, more than the {limit} the file system allows; pass a "
                             "shorter --out")
    if not existing.is_dir():
        if existing == absolute:
            raise MpiflError(f"--out {shown} is a file, not a directory; pass a directory for the run")
        raise MpiflError(f"cannot create the run directory {shown}: {existing} is a file; pass another --out")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise MpiflError(f"cannot create the run directory {shown}: {existing} is not writable; pass another --out")


def _nearest(absolute: Path) -> Path:
    """``absolute`` or its nearest parent that exists: where a directory there would be made."""
    return next(p for p in [absolute, *absolute.parents] if _lexists(p))


def _lexists(path: Path) -> bool:
    try:
        os.lstat(path)
    except OSError:  # missing, or a name too long to look up
        return False
    return True


def resumed_config(path: Path) -> Path:
    """The ``config.json`` of the run ``--resume PATH`` continues; one line when there is none."""
    config = Path(path) / CONFIG
    if config.is_file():
        return config
    folds = [p.name for p in sorted(Path(path).glob(HOLDOUT_FOLD.format(domain="*"))) if (p / CONFIG).is_file()]
    if folds:
        raise MpiflError(f"--resume {path}: it is --holdout all's folder of folds ({', '.join(folds)}), each a run of "
                         f"its own; resume one fold: --resume {Path(path) / folds[0]}")
    raise MpiflError(f"--resume {path}: no {CONFIG} there; pass the run directory of an earlier run")


def claim(path: Path, resuming: bool = False) -> DirectoryLock | None:
    """Hold ``path`` (an existing directory) for this run (``resuming``: a run it continues); refused while another
    run holds it.  None: the file system keeps no locks, and only the checks of :func:`check_new` keep runs apart."""
    try:
        lock = try_lock(path)
    except LocksUnsupported:
        return None
    except OSError as exc:
        fix = (f"a resumed run writes into its own directory: make it writable, or copy the run (cp -a {path} NEW) "
               "and --resume NEW" if resuming else "pass a writable --out")
        raise MpiflError(f"cannot claim the run directory {path} ({exc.strerror}); {fix}") from None
    if lock is None:
        who = holder(path) or "a run that is starting"
        raise MpiflError(f"run directory {path} is in use by another run ({who}); wait for it to end or pass "
                         "another --out")
    return lock


def config_digest(path: Path) -> str | None:
    """sha256 of ``path``'s ``config.json`` as this process sees it (None: it sees none): the ranks of a job compare
    theirs, to find a run directory that is not on a file system every node shares."""
    try:
        return hashlib.sha256((Path(path) / CONFIG).read_bytes()).hexdigest()
    except OSError:
        return None
