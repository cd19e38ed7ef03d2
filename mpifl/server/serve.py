"""Rank 0's part of a run around the round loop: ``log.txt`` (who runs where), the progress line, the
run log and the summaries, and the one line that says a stopped run can be resumed."""

from __future__ import annotations

import sys

from .. import __version__
from ..plan.config import RunConfig
from ..process.signals import StopRequest
from ..rundir.checkpoint import Checkpoint
from ..rundir.names import CHECKPOINT
from ..rundir.rundir import RunDir
from ..session.protocol import RoundProtocol
from ..session.session import Session
from ..transport.comm import Comm
from .folding import FoldThreads
from .progress import Progress
from .run_log import MetricsLog
from .server import Server
from .tracking.live import Tracking
from .tracking.tracker import FINISHED, STOPPED


def serve(cfg: RunConfig, comm: Comm, session: Session, run_dir: RunDir, resumed: Checkpoint | None,
          stop: StopRequest, processes: list[tuple[str, int]], fold_threads: tuple[int, bool],
          tracking: Tracking | None = None) -> str | None:
    """Rank 0's part of the run; returns the signal that stopped it early, if one did.  ``processes``: each rank's
    (pid, host and threads for the log, torch threads); ``fold_threads``: the threads that fold the uploads, and
    whether they fold behind rank 0's receives (:func:`~.folding.fold_threads`); ``tracking``: the live trackers
    (``--track``), started, which get every record and are ended here."""
    tracking = tracking or Tracking([])
    threads = [count for _, count in processes[1:]]
    n_clients, n_hosts = len(session.clients), comm.size - 1
    log_lines = [f"mpifl {__version__}: {cfg.algo} on {cfg.data} ({n_clients} clients, "
                 f"{len(session.manifest.domains)} domains) with {cfg.model}, {cfg.rounds} rounds, "
                 f"{n_hosts} client ranks{' (in-process)' if comm.in_process else ''}; run directory {run_dir.path}"]
    if resumed:
        log_lines.append(f"resuming after round {resumed.round} from {run_dir.path / CHECKPOINT}"
                         + ("" if len(resumed.ranks) == n_hosts else
                            f"; its clients were on {len(resumed.ranks)} client ranks, now placed on {n_hosts}"))
        if resumed.threads and set(resumed.threads) != set(threads):  # --threads, or automatic on other ranks
            fix = (f"; resume with --threads {resumed.threads[0]} to repeat it bit for bit"
                   if len(set(resumed.threads)) == 1 else "")
            log_lines.append(f"mpifl: warning: the client ranks run {_counts(threads)} torch threads, the run so far "
                             f"ran {_counts(resumed.threads)}: CPU kernels may round otherwise, so the numbers may "
                             f"differ slightly from those of an uninterrupted run{fix}")
    if n_hosts > n_clients:
        log_lines.append(f"mpifl: warning: {n_hosts} client ranks for {n_clients} clients; "
                         f"ranks {n_clients + 1}..{n_hosts} stay idle (use mpirun -n {n_clients + 1})")
    folds = FoldThreads(*fold_threads)
    log_lines.append(f"rank 0 ({processes[0][0]}): server, folds the uploads on {folds.count} "
                     f"thread{'s' * (folds.count > 1)} "
                     + ("behind its receives" if folds.behind else "between its receives (no core spare)"))
    if session.secure:
        log_lines.append(session.secure.describe())
    evaluated = session.evaluation().images  # mpifl.session.evaluation: the images each rank evaluates
    log_lines += [f"rank {h + 1} ({processes[h + 1][0]}): {describe_clients(ids)}; evaluates {evaluated[h]:,} images"
                  for h, ids in enumerate(session.placement)]
    if session.pretrained:
        log_lines.append(session.pretrained.summary())
    if session.privacy.describe():
        log_lines.append(session.privacy.describe())
    for line in log_lines:
        (_err if line.startswith("mpifl: warning") else print)(line)
    run_dir.log("".join(line + "\n" for line in log_lines))  # at once: a job killed later still leaves who ran where
    progress = Progress(cfg.rounds, metric=session.algo.task.metric)
    metrics = MetricsLog(run_dir, session.algo.evaluates, session.source_domains, cfg.holdout,
                         session.algo.selection, session.algo.task.metric, on_record=tracking.record)
    if resumed:
        metrics.resume(resumed.round, resumed.pending,
                       evaluated=RoundProtocol(session).evaluates_round(resumed.round))

    def on_round(r: int, evaluated: int | None, acc: float | None) -> None:
        progress.update(r, acc)
        run_dir.log(f"round {r}: " + ("not evaluated yet\n" if evaluated is None else
                                      f"mean test {session.algo.task.metric} {acc:.4f} (round {evaluated})\n"))

    with folds:
        server = Server(session, comm, metrics, on_round, run_dir, resumed, stop, threads, folds, tracking.runs)
        server.run()
    if server.stopped_by:
        line = (f"mpifl: stopped by {server.stopped_by} after round {server.stopped_after}; checkpoint in "
                f"{run_dir.path / CHECKPOINT}; continue with --resume {run_dir.path}")
        _err(line)
        run_dir.log(line + "\n")
        tracking.finish(STOPPED)
        return server.stopped_by
    summary = metrics.write_summary()
    print(summary)
    run_dir.log(summary)
    tracking.finish(FINISHED)
    return None


def _err(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def _counts(threads: list[int]) -> str:
    """Thread counts of the client ranks, in a few words: ``1``, or ``2 or 3``."""
    return " or ".join(str(n) for n in sorted(set(threads)))


def describe_clients(ids: list[int]) -> str:
    """A rank's client ids (ascending) for the log, exactly and in one short line at any scale: runs of three or
    more with one step are written ``first..last`` (step 1) or ``first..last step k``.

    ``[0, 1, 2, 3, 7]`` -> ``5 clients: 0..3, 7``; 500 even ids -> ``500 clients: 0..998 step 2``.
    """
    if not ids:
        return "no clients (idle)"
    parts, i = [], 0
    while i < len(ids):
        j = i + 1
        if j < len(ids):
            step = ids[j] - ids[i]
            while j + 1 < len(ids) and ids[j + 1] - ids[j] == step:
                j += 1
        if j - i >= 2:  # three or more ids
            parts.append(f"{ids[i]}..{ids[j]}" + (f" step {step}" if step != 1 else ""))
            i = j + 1
        else:
            parts.append(str(ids[i]))
            i += 1
    return f"{len(ids)} clients: {', '.join(parts)}" if len(ids) > 1 else f"client {ids[0]}"
