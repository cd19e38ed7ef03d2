"""Ending the whole MPI job from one rank, with its one line shown.

:func:`abort_world` is how a failing rank ends an MPI job
(``MpiComm.abort``): it gives the launcher half a second to forward the
rank's line (launchers forward output asynchronously, and the abort would
otherwise race the line), calls ``MPI_Abort`` and exits whatever that
returns.  :func:`abort_job` prints the line first.  :func:`end_now` is for
where no communicator is at hand (a signal handler): it ends an MPI job the
same way, and a run without a launcher (every rank a thread of this process)
by ending the process.

:func:`abort_on_uncaught` covers the time before the runtime's own error
handling exists: an exception while ``python -m mpifl.run`` is still
importing (a broken install on one node, a missing CUDA library) would let
that rank exit while the others wait in their first collective forever.  It
installs a ``sys.excepthook`` that names the rank and the innermost frame and
aborts.  Installed only by the ``mpifl.run`` entry point, never by a library
import.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from typing import NoReturn

from .node_files import forget_launcher_files, forget_segments

ABORT_SECONDS = 10.0  # a rank calling MPI_Abort exits by itself after this long
EXIT_LOST = 69  # EX_UNAVAILABLE: a peer's node failed or is cut off the network (mpifl.transport.liveness)


def abort_job(line: str, code: int) -> NoReturn:
    """Print ``line`` and end the whole MPI job."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
    abort_world(code)


def end_now(line: str, code: int) -> NoReturn:
    """Print ``line`` and end this job at once, with or without a launcher."""
    from .world import launched_world

    sys.stdout.flush()
    if launched_world()[1] > 1:
        abort_job(line, code)
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
    os._exit(code)  # every rank is a thread of this process: end them all, whatever each is doing


def abort_world(code: int) -> NoReturn:
    """End every rank of the MPI world (a lone process just exits), leaving none of the MPI library's shared memory
    that this process maps, nor its launcher's topology file (``MPI_Abort`` skips their own removal:
    :mod:`.node_files`).

    This process exits within :data:`ABORT_SECONDS` whatever ``MPI_Abort`` does: with a launcher that is gone
    or cut off (a lost node), the abort may wait for an answer that never comes."""
    from mpi4py import MPI

    deadline = threading.Timer(ABORT_SECONDS, os._exit, args=(code,))
    deadline.daemon = True
    deadline.start()
    forget_segments()
    forget_launcher_files()
    if MPI.COMM_WORLD.size > 1:
        time.sleep(0.5)
        MPI.COMM_WORLD.Abort(code)
    os._exit(code)  # MPI_Abort may return before the launcher kills this process; nothing else may run


def abort_on_uncaught() -> None:
    from mpi4py import MPI

    def hook(kind, exc, tb):
        frame = traceback.extract_tb(tb)[-1] if tb else None
        where = f" at {frame.filename}:{frame.lineno}" if frame else ""
        abort_job(f"mpifl: rank {MPI.COMM_WORLD.rank} failed while starting: {kind.__name__}: {exc}{where}", 1)

    sys.excepthook = hook
