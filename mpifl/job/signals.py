"""Stopping on request: SIGUSR1 or SIGTERM ends the run cleanly at the next round boundary.

Slurm sends one of them before a job's time limit (``--signal``) or when it
preempts the job; ``mpirun``/``srun`` forward it to every rank.  The server
finishes the round under way, writes a checkpoint, tells the client ranks
to save theirs and stop, and every rank exits with :data:`EXIT_STOPPED`;
``--resume RUN_DIR`` then continues the run (``slurm/common.sh`` requeues
the job and does so by itself).  Only rank 0's request is acted upon: the
clients keep training until the server's message says stop.
"""

from __future__ import annotations

import signal

STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)
EXIT_STOPPED = 75  # EX_TEMPFAIL: stopped early with a checkpoint; resume to continue


class StopRequest:
    """Remembers the first stop signal received after :meth:`install`."""

    def __init__(self):
        self.signal_name: str | None = None

    def install(self) -> None:
        for signum in STOP_SIGNALS:
            signal.signal(signum, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.signal_name is None:
            self.signal_name = signal.Signals(signum).name
