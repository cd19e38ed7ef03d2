"""Rank 0's trackers of one run (:class:`Tracking`), each called from a thread of its own behind a bounded queue
(:class:`_Worker`), so that no tracker holds up a round, and one that fails is dropped while the run goes on.

* **start** (:meth:`Tracking.start`, once the run directory is made, or before a resumed run writes anything):
  each tracker opens its run, a new one or the one the checkpoint names, and records the options; one that cannot
  (an unwritable store, a server that refuses) refuses the run in one line naming it.  A missing package is
  refused earlier, while the ranks set up (:func:`check_installed`).
* **each record** of ``metrics.jsonl`` (:meth:`Tracking.record`): the round loop only queues it; the tracker's
  thread turns it into scalars (:mod:`mpifl.server.scalars`) and logs them at step = round.  A tracker whose call
  raises (a full disk, a server gone), or that falls :data:`QUEUE_CALLS` calls behind, stops with one line,
  ``mpifl: warning: tracking to <name> stopped: <cause>; the run goes on``, and is dropped.
* **end** (:meth:`Tracking.finish`): a finished run's report is made by ``python -m mpifl.report`` (the report
  sits a layer above rank 0's code, so it runs as the command) into ``<run>/tracking/report``; every tracker then
  gets config.json, the summaries, the report's tables and figures, and ends its run.  The end waits for the
  trackers at most :data:`FINISH_SECONDS`, :data:`STOP_SECONDS` after a stop signal (a scheduler's grace time
  runs), half ``--round-timeout`` (the other ranks' clock runs too); ``log.txt`` says what tracking cost the round
  loop and each thread.
"""

from __future__ import annotations

import contextlib
import functools
import queue
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

from ...errors import MpiflError
from ...plan.config import RunConfig, parse_names
from ...rundir.checkpoint import Checkpoint
from ...rundir.names import CONFIG, HOLDOUT_FOLD, SUMMARY_CSV, SUMMARY_MD, TRACKING
from ...rundir.rundir import RunDir
from ..scalars import scalars
from .to_mlflow import MlflowTracker
from .to_tensorboard import TensorBoardTracker
from .to_wandb import WandbTracker
from .tracker import FAILED, FINISHED, TrackedRun, Tracker

TRACKERS: dict[str, type[Tracker]] = {cls.name: cls for cls in (TensorBoardTracker, MlflowTracker, WandbTracker)}
QUEUE_CALLS = 256  # a tracker this many calls (rounds) behind the run is dropped
FINISH_SECONDS = 60.0  # the end of a finished run waits this long at most for its report and its trackers
STOP_SECONDS = 5.0  # and of a stopped run, for its trackers
REPORT = "report"  # inside the run's tracking folder: what python -m mpifl.report wrote at the end
COST_PER_RECORD = "CPU per record in each tracker's thread: "  # in log.txt's tracking line (tracking_cost)
RECORD, END = "record", "end"  # the kinds of a tracker's calls: a round's record, and the end of the run


def tracking_cost(log_text: str) -> dict[str, float] | None:
    """What the last ``tracking:`` line of a run's ``log.txt`` (:meth:`Tracking.finish`) says tracking cost, in
    seconds per record: the round loop's (``round loop``) and each tracker thread's CPU, by tracker; None when the
    run was not tracked."""
    lines = [line for line in log_text.splitlines() if line.startswith("tracking: ") and COST_PER_RECORD in line]
    if not lines:
        return None
    handed, loop = re.search(r"^tracking: (\d+) records? handed to the trackers in ([\d.]+) ms", lines[-1]).groups()
    threads = lines[-1].split(COST_PER_RECORD, 1)[1].split("; ending", 1)[0]
    cost = {"round loop": float(loop) / 1000 / max(1, int(handed))}
    cost.update((name, float(ms) / 1000) for name, ms in re.findall(r"(\w+) ([\d.]+) ms", threads))
    return cost


def check_installed(cfg: RunConfig) -> None:
    """Refuse, in one line naming the extra to install, a tracker whose packages are missing."""
    for name in parse_names(cfg.track):
        missing = TRACKERS[name].missing()
        if missing:
            one = len(missing) == 1
            raise MpiflError(f"--track {name} needs {' and '.join(missing)}, which {'is' if one else 'are'} not "
                             f"installed; install {'it' if one else 'them'} with `pip install 'mpifl[{name}]'`, or "
                             f"leave {name} out of --track")


class Tracking:
    """The trackers of one run on rank 0 (none without ``--track``)."""

    def __init__(self, trackers: list[Tracker], metric: str = "acc", run_dir: RunDir | None = None,
                 round_timeout: float = 0.0):
        self.metric, self.run_dir, self.round_timeout = metric, run_dir, round_timeout
        self.workers = [_Worker(tracker, self._warn) for tracker in trackers]
        self.last_round = 0
        self.handed, self.handing = 0, 0.0  # records queued, and the round loop's seconds doing it

    @classmethod
    def start(cls, cfg: RunConfig, run_dir: RunDir, metric: str, resumed: Checkpoint | None) -> Tracking:
        """Open the trackers ``--track`` names (a resumed run: continue those of its checkpoint)."""
        path = run_dir.path
        fold = cfg.holdout is not None and path.name == HOLDOUT_FOLD.format(domain=cfg.holdout)
        continued = (resumed.tracking or {}) if resumed else {}
        # the first record a continued tracker run lacks: the checkpoint's round, if its record was still pending
        first = resumed.round + (0 if resumed.pending else 1) if resumed else 1
        trackers: list[Tracker] = []
        for name in parse_names(cfg.track):
            run = TrackedRun(path=path, name=f"{path.parent.name}/{path.name}" if fold else path.name,
                             group=path.parent.name if fold else None, config=cfg.to_flat(),
                             continues=continued.get(name), first_round=first)
            try:
                trackers.append(TRACKERS[name](run))
            except Exception as exc:  # whatever the tracker's package raises
                for started in trackers:
                    with contextlib.suppress(Exception):
                        started.close(FAILED)
                raise MpiflError(f"--track {name} cannot start: {_cause(exc)}; correct that, or leave {name} out "
                                 "of --track") from None
        return cls(trackers, metric, run_dir, cfg.round_timeout)

    @property
    def runs(self) -> dict[str, str] | None:
        """Each tracker's run, for the checkpoint (None without trackers)."""
        return {worker.tracker.name: worker.tracker.run_id for worker in self.workers} or None

    def record(self, record: dict) -> None:
        """Queue one record of ``metrics.jsonl`` (a resumed run's kept records too: each tracker logs those from
        its first round on)."""
        started = time.perf_counter()
        self.last_round = int(record["round"])
        for worker in self.workers:
            if self.last_round >= worker.tracker.first_round:
                worker.put(functools.partial(_log, record, self.metric), RECORD)
        self.handed += 1
        self.handing += time.perf_counter() - started

    def finish(self, status: str = FINISHED) -> None:
        """End every tracker run as ``status``; a finished run's files and report go with it."""
        if not self.workers:
            return
        bound = FINISH_SECONDS if status == FINISHED else STOP_SECONDS
        bound = min(bound, self.round_timeout / 2) if self.round_timeout else bound
        started = time.monotonic()
        deadline = started + bound
        if status == FINISHED:
            files, summary = self._files(deadline), ""
            with contextlib.suppress(OSError):  # written just before; a run directory removed since has none
                summary = (self.run_dir.path / SUMMARY_MD).read_text()
            for worker in self.workers:
                worker.put(lambda tracker: tracker.attach(files, summary, self.last_round), END)
        for worker in self.workers:
            worker.end(status)
        for worker in self.workers:
            worker.thread.join(max(0.0, deadline - time.monotonic()))
            if worker.thread.is_alive():
                worker.stop(f"it had not ended {bound:g} s after the run", "the run's results are all written")
        per_record = ", ".join(f"{w.tracker.name} {1000 * w.cpu[RECORD] / max(1, w.calls_done[RECORD]):.1f} ms"
                               for w in self.workers)
        self._log(f"tracking: {self.handed} record{'s' * (self.handed != 1)} handed to the trackers in "
                  f"{1000 * self.handing:.1f} ms of the round loop; {COST_PER_RECORD}{per_record}; ending them "
                  f"took {time.monotonic() - started:.1f} s"
                  + (" (the report's included)\n" if status == FINISHED else "\n"))

    def _files(self, deadline: float) -> dict[str, Path]:
        """What a finished run attaches, by name: config.json, the summaries, and the report of the run, made by
        ``python -m mpifl.report`` into ``<run>/tracking/report``."""
        path = self.run_dir.path
        out = path / TRACKING / REPORT
        command = [sys.executable, "-m", "mpifl.report", str(path), "--out", str(out)]
        try:
            done = subprocess.run(command, capture_output=True, text=True,
                                  timeout=max(1.0, deadline - time.monotonic()))
            failed = (_lines(done.stderr) or [f"exit code {done.returncode}"])[-1] if done.returncode else None
        except (OSError, subprocess.TimeoutExpired) as exc:
            failed = _cause(exc)
        if failed:
            self._warn(f"mpifl: warning: the trackers get no report: python -m mpifl.report said: {failed}; the "
                       "run's results are all written")
        report = sorted(out.iterdir()) if out.is_dir() and not failed else []
        return {name: path / name for name in (CONFIG, SUMMARY_MD, SUMMARY_CSV) if (path / name).is_file()} | {
            f"{REPORT}/{file.name}": file for file in report if file.is_file()}

    def abandon(self) -> None:
        """End the tracker runs of a run refused after they started."""
        for worker in self.workers:
            worker.end(FAILED)

    def _warn(self, line: str) -> None:
        with contextlib.suppress(OSError):
            sys.stderr.write(line + "\n")
            sys.stderr.flush()
        self._log(line + "\n")

    def _log(self, text: str) -> None:
        if self.run_dir is not None:
            self.run_dir.log(text, best_effort=True)


def _log(record: dict, metric: str, tracker: Tracker) -> None:
    tracker.log(int(record["round"]), scalars(record, metric))


class _Worker:
    """One tracker, called in order from a thread of its own, its calls queued (at most :data:`QUEUE_CALLS`)."""

    def __init__(self, tracker: Tracker, warn):
        self.tracker, self.warn = tracker, warn
        self.calls: queue.Queue = queue.Queue(QUEUE_CALLS)
        self.stopped = False  # it failed or fell behind: later calls are dropped, the thread ends
        self.cpu = {RECORD: 0.0, END: 0.0}  # seconds of CPU its thread spent in the tracker, by kind of call
        self.calls_done = {RECORD: 0, END: 0}
        self._lock = threading.Lock()
        self.thread = threading.Thread(target=self._serve, name=f"mpifl-tracking-{tracker.name}", daemon=True)
        self.thread.start()

    def put(self, call, kind: str) -> None:
        """Queue ``call(tracker)`` (a :data:`RECORD`'s or the :data:`END`'s), without waiting: a tracker that far
        behind stops."""
        if self.stopped:
            return
        try:
            self.calls.put_nowait((call, kind))
        except queue.Full:
            self.stop(f"it fell {QUEUE_CALLS} calls behind the run", "the run goes on")

    def end(self, status: str) -> None:
        """Queue the tracker run's end as ``status``, the thread's last call."""
        self.put(lambda tracker: tracker.close(status), END)
        if not self.stopped:
            with contextlib.suppress(queue.Full):
                self.calls.put_nowait(None)

    def stop(self, cause: str, after: str) -> None:
        """Drop the tracker, saying so once."""
        with self._lock:
            if self.stopped:
                return
            self.stopped = True
        self.warn(f"mpifl: warning: tracking to {self.tracker.name} stopped: {cause}; {after}")
        with contextlib.suppress(queue.Full):
            self.calls.put_nowait(None)  # an idle thread wakes up and ends

    def _serve(self) -> None:
        while True:
            item = self.calls.get()
            if item is None or self.stopped:
                break
            call, kind = item
            started = time.thread_time()
            try:
                call(self.tracker)
            except Exception as exc:  # whatever the tracker's package raises: the tracker stops, the run goes on
                self.stop(_cause(exc), "the run goes on")
            self.cpu[kind] += time.thread_time() - started
            self.calls_done[kind] += 1
        if self.stopped:
            with contextlib.suppress(Exception):
                self.tracker.close(FAILED)


def _cause(exc: BaseException) -> str:
    """An exception in one short line: its type and its message's first line."""
    lines = _lines(str(exc))
    return f"{type(exc).__name__}: {lines[0]}"[:300] if lines else type(exc).__name__


def _lines(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip()]
