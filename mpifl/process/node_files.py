"""The files an MPI job keeps on its nodes while it runs: a job removes its own, however it ends.

* MPICH 5 makes one file per job and node, ``mpich_shm_<job>_<node>`` (``<job>``: a hash of the launcher's name for
  the job), which every rank of the node opens and its first rank removes in ``MPI_Finalize``: a job ended through
  ``MPI_Abort``, or by a rank killed, leaves it (1-3 MB).
* Open MPI's ``sm`` transport makes one file per process, ``sm_segment.<host>.<uid>.<job>.<local rank>``, which the
  launcher's daemon removes when the job ends: a process that starts MPI without a launcher (a world of one) has no
  daemon, and leaves its 16 MB.
* MPICH's launcher, Hydra, writes the node's hardware topology to ``/tmp/hydra_hwloc_xmlfile_XXXXXX``, which the
  node's proxy (every rank's parent) holds open and removes when the job ends well, and each rank reads by its name
  as MPI starts: a job ended through ``MPI_Abort`` leaves it (5.5 KB).

Which files are this job's is read from the process itself: a file of those names that this process maps
(``/proc/self/maps``) is one it or a rank of its job made, never another job's.  :func:`forget_segments` unlinks
them: the memory stays mapped, and shared, in every process that has it until that process ends; only a process
that opened the file later by its name would no longer find it.  MPICH's ranks of a node open its file when they
first communicate over shared memory, each waiting there until every one of them has: a rank that maps it may
unlink it (:data:`MPICH_NODE`), as the ranks do once set up.  A node's ranks open each other's Open MPI files when
they first speak, so those go only where no process will: in a world of one, at once, and as a rank ends the job
through ``MPI_Abort`` (:data:`EVERY`).  Hydra's topology file of a node is the one the rank's parent, Hydra's
proxy, holds open (:func:`launcher_files`); once every rank of the node has started MPI, none reads it again.
"""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path

SHM = Path("/dev/shm")
#: MPICH's file of a job's node, and the files of every library: also Open MPI's ``sm`` (5) and ``vader`` (4)
MPICH_NODE = re.compile(r"mpich_shm_[0-9a-f]+_\d+")
EVERY = re.compile(MPICH_NODE.pattern + r"|(sm|vader)_segment\.[^\s/]+")
HYDRA_PROXY = "hydra_pmi_proxy"
HYDRA_TOPOLOGY = re.compile(r"/tmp/hydra_hwloc_xmlfile_\w+")


def mapped_segments(names: re.Pattern = EVERY) -> list[Path]:
    """The MPI libraries' shared-memory files of ``names`` that this process maps (none where ``/proc`` cannot
    say)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return []
    found = set()
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)  # address, permissions, offset, device, inode, and the file, if any
        path = Path(fields[5]) if len(fields) == 6 else None
        if path is not None and path.parent == SHM and names.fullmatch(path.name):  # not "... (deleted)"
            found.add(path)
    return sorted(found)


def forget_segments(names: re.Pattern = EVERY) -> list[Path]:
    """Unlink the MPI libraries' shared-memory files of ``names`` that this process maps (the module's note says
    when no process of the job opens them again); the ones it removed."""
    return _unlink(mapped_segments(names))


def launcher_files() -> list[Path]:
    """Hydra's topology file of this node, which this process's parent holds open where it is Hydra's proxy (none
    where ``/proc`` cannot say)."""
    parent = Path(f"/proc/{os.getppid()}")
    try:
        if (parent / "comm").read_text().strip() != HYDRA_PROXY:
            return []
        descriptors = list((parent / "fd").iterdir())
    except OSError:
        return []
    found = set()
    for descriptor in descriptors:
        with contextlib.suppress(OSError):  # closed meanwhile
            target = os.readlink(descriptor)
            if HYDRA_TOPOLOGY.fullmatch(target):
                found.add(Path(target))
    return sorted(found)


def forget_launcher_files() -> list[Path]:
    """Unlink Hydra's topology file of this node (once every rank of the node has started MPI); the ones removed."""
    return _unlink(launcher_files())


def _unlink(paths: list[Path]) -> list[Path]:
    removed = []
    for path in paths:
        with contextlib.suppress(FileNotFoundError):  # a rank of the same node removed it first
            os.unlink(path)
            removed.append(path)
    return removed
