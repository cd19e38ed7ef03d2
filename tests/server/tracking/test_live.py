"""Rank 0's trackers behind their threads: the round loop never waits for one, and one that fails, hangs or falls
behind is dropped with one warning line while the others go on."""

from __future__ import annotations

import threading
import time

import pytest

from mpifl.errors import MpiflError
from mpifl.plan.config import RunConfig
from mpifl.server.tracking import live
from mpifl.server.tracking.live import Tracking, check_installed, tracking_cost
from mpifl.server.tracking.tracker import FAILED, FINISHED, STOPPED, Tracker


class Recording(Tracker):
    """A tracker that remembers its calls; ``fail_at``: the round whose log raises; ``gate``: every log waits for
    it (a server that does not answer)."""

    name = "recording"

    def __init__(self, fail_at: int | None = None, gate: threading.Event | None = None, first_round: int = 1):
        self.run_id, self.first_round = "r1", first_round
        self.fail_at, self.gate = fail_at, gate
        self.logged: list[tuple[int, dict]] = []
        self.closed: list[str] = []
        self.attached = None
        self.called = threading.Event()  # its first log call began

    def log(self, step, values):
        self.called.set()
        if self.gate is not None:
            self.gate.wait()
        if step == self.fail_at:
            raise OSError(28, "No space left on device")
        self.logged.append((step, values))

    def attach(self, files, summary, step):
        self.attached = (files, summary, step)

    def close(self, status):
        self.closed.append(status)


def record(r: int) -> dict:
    return {"round": r, "train": {"loss": 1.0 / r, "acc": 0.5}, "seconds": {"round": 2.0}}


def warnings_of(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("mpifl: ")]


def test_each_record_reaches_each_tracker_in_order_from_its_first_round(capsys):
    fresh, continued = Recording(), Recording(first_round=3)
    tracking = Tracking([fresh, continued])
    for r in range(1, 5):
        tracking.record(record(r))
    tracking.finish(STOPPED)
    assert [step for step, _ in fresh.logged] == [1, 2, 3, 4]
    assert [step for step, _ in continued.logged] == [3, 4]  # a continued tracker run has the rounds before
    assert fresh.logged[1][1] == {"train/loss": 0.5, "train/acc": 50.0, "seconds/round": 2.0}
    assert fresh.closed == continued.closed == [STOPPED] and warnings_of(capsys) == []
    assert tracking.runs == {"recording": "r1"}


def test_a_finished_run_whose_report_fails_still_attaches_its_files_and_says_so_once(tmp_path, capsys):
    from mpifl.rundir.rundir import RunDir

    (tmp_path / "config.json").write_text("{}")  # no metrics.jsonl: the report finds no run there
    (tmp_path / "summary.md").write_text("| domain |")
    tracker = Recording()
    tracking = Tracking([tracker], run_dir=RunDir(tmp_path))
    tracking.record(record(1))
    tracking.finish(FINISHED)
    assert tracker.closed == [FINISHED]
    assert tracker.attached == ({"config.json": tmp_path / "config.json", "summary.md": tmp_path / "summary.md"},
                                "| domain |", 1)
    (line,) = warnings_of(capsys)
    assert line.startswith("mpifl: warning: the trackers get no report: python -m mpifl.report said: mpifl: error: "
                           f"no run under {tmp_path}") and line.endswith("; the run's results are all written")
    log = (tmp_path / "log.txt").read_text()
    assert line in log and "tracking: 1 record handed to the trackers in " in log and "(the report's included)" in log


def test_a_tracker_that_raises_is_dropped_with_one_warning_and_the_others_go_on(capsys):
    failing, healthy = Recording(fail_at=2), Recording()
    tracking = Tracking([failing, healthy])
    for r in range(1, 5):
        tracking.record(record(r))
    tracking.finish(STOPPED)
    assert warnings_of(capsys) == ["mpifl: warning: tracking to recording stopped: OSError: [Errno 28] No space left "
                                   "on device; the run goes on"]
    assert [step for step, _ in failing.logged] == [1] and failing.closed == [FAILED]
    assert [step for step, _ in healthy.logged] == [1, 2, 3, 4] and healthy.closed == [STOPPED]


def test_a_tracker_that_stops_answering_never_holds_up_the_round_loop(capsys, monkeypatch):
    monkeypatch.setattr(live, "QUEUE_CALLS", 4)
    monkeypatch.setattr(live, "STOP_SECONDS", 0.5)
    gate = threading.Event()
    hung = Recording(gate=gate)
    tracking = Tracking([hung])
    started = time.perf_counter()
    tracking.record(record(1))
    assert hung.called.wait(5)
    for r in range(2, 11):  # one call in the tracker's hands, four queued, then it is too far behind
        tracking.record(record(r))
    assert time.perf_counter() - started < 0.1
    tracking.finish(STOPPED)
    assert time.perf_counter() - started < 2
    assert warnings_of(capsys) == ["mpifl: warning: tracking to recording stopped: it fell 4 calls behind the run; "
                                   "the run goes on"]
    gate.set()  # the server answers again: the call in its hands ends, the tracker is closed, nothing more is logged
    hung_thread = tracking.workers[0].thread
    hung_thread.join(5)
    assert not hung_thread.is_alive() and [step for step, _ in hung.logged] == [1] and hung.closed == [FAILED]


@pytest.mark.parametrize("status,round_timeout,bound", [(STOPPED, 0.0, 0.5), (STOPPED, 0.6, 0.3),
                                                         (FINISHED, 0.0, 0.8)])
def test_the_end_of_a_run_waits_a_bounded_time_for_a_tracker(capsys, monkeypatch, tmp_path, status, round_timeout,
                                                             bound):
    """After a stop not long (a scheduler's grace time runs), never half --round-timeout or more (the other ranks'
    clocks run)."""
    from mpifl.rundir.rundir import RunDir

    monkeypatch.setattr(live, "STOP_SECONDS", 0.5)
    monkeypatch.setattr(live, "FINISH_SECONDS", 0.8)
    gate = threading.Event()
    tracking = Tracking([Recording(gate=gate)], run_dir=RunDir(tmp_path), round_timeout=round_timeout)
    tracking.record(record(1))
    started = time.perf_counter()
    tracking.finish(status)
    assert bound <= time.perf_counter() - started < bound + 1.5  # a finished run's report fails at once here
    assert warnings_of(capsys)[-1] == (f"mpifl: warning: tracking to recording stopped: it had not ended {bound:g} s "
                                       "after the run; the run's results are all written")
    gate.set()


@pytest.mark.parametrize("track,module,extra", [("wandb", "wandb", "wandb"), ("mlflow", "mlflow", "mlflow"),
                                                 ("tensorboard", "tensorboard", "tensorboard"),
                                                 ("mlflow", "alembic", "mlflow")])
def test_a_missing_package_is_named_with_its_extra(monkeypatch, track, module, extra):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setitem(__import__("sys").modules, module, None)  # what importlib then finds: nothing
    with pytest.raises(MpiflError) as info:
        check_installed(RunConfig(track=f"none,{track}"))
    assert str(info.value) == (f"--track {track} needs {module}, which is not installed; install it with "
                               f"`pip install 'mpifl[{extra}]'`, or leave {track} out of --track")


def test_a_tracking_server_needs_no_local_store(monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    monkeypatch.setitem(__import__("sys").modules, "sqlalchemy", None)
    check_installed(RunConfig(track="mlflow"))


class Capturing(Recording):
    """A tracker that keeps what it was told of the run."""

    name = "capturing"
    told: list = []

    def __init__(self, run):
        super().__init__(first_round=run.logs_from)
        Capturing.told.append(run)


def test_each_fold_of_holdout_all_is_a_tracker_run_grouped_by_its_folder(tmp_path, monkeypatch):
    from mpifl.rundir.checkpoint import Checkpoint
    from mpifl.rundir.rundir import RunDir

    monkeypatch.setattr(live, "TRACKERS", {"capturing": Capturing})
    monkeypatch.setattr("mpifl.server.tracking.live.parse_names", lambda text: ("capturing",))
    stopped = Checkpoint(round=4, clients=3, ranks={}, pending={"round": 4}, identity={}, files={},
                         tracking={"capturing": "c7"})  # after round 4, its record waiting for its evaluation
    for domain, resumed in (("photo", None), ("sketch", stopped)):
        (tmp_path / "folds" / f"holdout-{domain}").mkdir(parents=True)
        cfg = RunConfig(holdout=domain, out=str(tmp_path / "folds" / f"holdout-{domain}"))
        tracking = Tracking.start(cfg, RunDir(tmp_path / "folds" / f"holdout-{domain}"), "acc", resumed)
        tracking.finish(STOPPED)
    (tmp_path / "one").mkdir()
    Tracking.start(RunConfig(holdout="photo"), RunDir(tmp_path / "one"), "acc", None).finish(STOPPED)
    photo, sketch, one = Capturing.told
    assert (photo.name, photo.group, photo.continues, photo.first_round) == ("folds/holdout-photo", "folds", None, 1)
    assert photo.config["holdout"] == "photo"
    # a resumed fold continues its tracker run from the checkpoint's pending round on
    assert (sketch.name, sketch.group, sketch.continues, sketch.first_round) == ("folds/holdout-sketch", "folds", "c7",
                                                                                4)
    assert (one.name, one.group) == ("one", None)  # --holdout DOMAIN alone is no fold of a folder


def test_the_cost_line_of_the_log_reads_back_per_record():
    log = ("round 1 ...\ntracking: 4 records handed to the trackers in 0.8 ms of the round loop; CPU per record in "
           "each tracker's thread: mlflow 8.1 ms, tensorboard 0.5 ms; ending them took 2.3 s (the report's included)\n")
    assert tracking_cost(log) == pytest.approx({"round loop": 0.0002, "mlflow": 0.0081, "tensorboard": 0.0005})
    assert tracking_cost("round 1 ...\n") is None


def test_a_tracker_failing_on_a_full_disk_is_still_said_once_and_closed(tmp_path, monkeypatch, capsys):
    """The warning also goes to log.txt, which the full disk refuses: the line is still said on stderr, once, and
    the tracker's thread closes it (the log's refusal does not end the thread with a traceback)."""
    import errno

    from mpifl.rundir.rundir import RunDir

    run_dir = RunDir(tmp_path)
    monkeypatch.setattr(run_dir, "append", lambda name, text: (_ for _ in ()).throw(
        run_dir.failed(name, OSError(errno.ENOSPC, "No space left on device"))))
    tracker = Recording(fail_at=1)
    tracking = Tracking([tracker], run_dir=run_dir)
    tracking.record(record(1))
    tracking.finish(STOPPED)
    assert warnings_of(capsys) == ["mpifl: warning: tracking to recording stopped: OSError: [Errno 28] No space left "
                                   "on device; the run goes on"]
    assert tracker.closed == [FAILED]
