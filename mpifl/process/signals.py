"""Stopping on request: SIGUSR1, SIGTERM or SIGINT (Ctrl-C) ends the run cleanly at the next round boundary.

Slurm sends SIGUSR1 or SIGTERM before a job's time limit (``--signal``) or when it preempts the job;
``mpirun``/``srun`` forward signals to every rank, and MPICH's ``mpirun`` forwards a first Ctrl-C the same way
(a second one it handles itself, ending every rank).  The server finishes the round under way, writes a
checkpoint, tells the client ranks to save theirs and stop, and every rank exits with :data:`EXIT_STOPPED`;
``--resume RUN_DIR`` then continues the run (``slurm/common.sh`` requeues the job and does so by itself).

A signal may reach one rank only (one node of a multi-node job preempted): a client rank reports it in its next
upload (``rank.stop``), and the server stops the whole job as for a signal of its own.  A second SIGINT on a
rank that is already stopping (Ctrl-C pressed again in a run without a launcher) ends the job at once, without a
checkpoint, with :data:`EXIT_INTERRUPTED`.
"""

from __future__ import annotations

import signal

from .abort import end_now

STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)
EXIT_STOPPED = 75  # EX_TEMPFAIL: stopped early with a checkpoint; resume to continue
EXIT_INTERRUPTED = 128 + signal.SIGINT  # ended at once by a second Ctrl-C, as a shell reports it


class StopRequest:
    """The first stop signal received after :meth:`install`, here or (on the server) on a client rank."""

    def __init__(self):
        self.signum = 0  # 0: none yet
        self.rank: int | None = None  # the client rank it reached, when it did not reach this process

    @property
    def requested(self) -> bool:
        return self.signum != 0

    def install(self) -> None:
        for signum in STOP_SIGNALS:
            signal.signal(signum, self._handle)

    def _handle(self, signum, frame) -> None:
        if not self.requested:
            self.signum = signum
        elif signum == signal.SIGINT:
            end_now("mpifl: interrupted again: ended at once, without a checkpoint (the last one, if any, is "
                    "still there)", EXIT_INTERRUPTED)

    def heard_on(self, rank: int, signum: int) -> None:
        """A client rank reports a stop signal it received."""
        if not self.requested:
            self.signum, self.rank = signum, rank

    def describe(self) -> str:
        """'SIGTERM', or 'SIGTERM on rank 2' for a signal that reached a client rank only."""
        name = signal.Signals(self.signum).name
        return name if self.rank is None else f"{name} on rank {self.rank}"
