"""``python -m mpifl.run``: one federated run (rank 0 the server, the other ranks client hosts).

    mpirun -n 3 python -m mpifl.run --algo fedavg --rounds 3   # over MPI: 1 server + 2 client ranks
    python -m mpifl.run --algo fedavg --rounds 3               # in one process: server and one client host

The options are :mod:`mpifl.job.cli`'s; what each rank then does is :mod:`mpifl.job.start`'s.
"""

from __future__ import annotations

if __name__ == "__main__":  # before the heavy imports: a rank failing in them must not leave the others waiting
    import os
    import signal

    signal.signal(signal.SIGINT, lambda *_: os._exit(130))  # Ctrl-C while importing: nothing to save yet

    import sys

    from mpifl.process.abort import abort_on_uncaught
    from mpifl.process.faults import maybe_inject
    from mpifl.process.world import forget_inherited_launcher, launched_world, launcher_mismatch

    forget_inherited_launcher()  # a child of a launched process runs without a launcher
    refused = launcher_mismatch()  # before any option is read: each process would run the whole job alone
    if refused:
        if refused.says_it:
            sys.stderr.write(refused.line + "\n")
        sys.exit(2)
    rank, size = launched_world()
    if size > 1:
        abort_on_uncaught()
    maybe_inject(rank=rank, client=-1, round_index=0)

from .job.cli import command, invoke

main = command()

if __name__ == "__main__":
    invoke(main, rank=rank)
