"""Whole runs with ``--track``: what MLflow's local store, TensorBoard's event files and an offline W&B run hold
equals ``metrics.jsonl``; a resumed run continues the same tracker runs; a tracker that cannot start refuses the
run before it writes anything; one that fails mid-run leaves the run going, its records as without it."""

from __future__ import annotations

import json
import math
from urllib.parse import quote

import numpy as np
import pytest

from mpifl.server.scalars import scalars
from mpifl.server.tracking.live import tracking_cost
from mpifl.server.tracking.to_tensorboard import TensorBoardTracker

from ...conftest import read_metrics, run_here, untimed
from ...rundir.test_directory import one_error
from .stores import (mlflow_runs, mlflow_scalars, tensorboard_scalars, tensorboard_tags, wandb_run, wandb_runs,
                     wandb_scalars)

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def no_user_settings(monkeypatch, tmp_path):
    """The trackers' defaults, whatever the machine's environment sets; W&B's own logs and settings (by default in
    ~/.cache/wandb, ~/.config/wandb) go to the test's folder."""
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "WANDB_MODE", "WANDB_DIR", "WANDB_PROJECT",
                 "MPIFL_FAULT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))


def _args(data_root, out, *extra):
    return ["--data-root", str(data_root), "--model", "smallcnn", "--threads", "1", "--samples-per-client", "32",
            "--eval-batch-size", "256", "--out", str(out), *extra]


def _expected(run) -> dict[tuple[str, int], float]:
    return {(tag, record["round"]): value for record in read_metrics(run)
            for tag, value in scalars(record, "acc").items()}


def _same(found: dict, expected: dict, as_float32: bool = False) -> None:
    """Each scalar of ``metrics.jsonl`` logged once, with its value (float32 in TensorBoard's event files)."""
    assert set(found) == set(expected), set(found) ^ set(expected)
    for key, values in found.items():
        want = float(np.float32(expected[key])) if as_float32 else expected[key]
        assert len(values) == 1 and (values[0] == want or math.isnan(want) and math.isnan(values[0])), (key, values)


def _mlflow_uri(run) -> str:
    return f"sqlite:///{quote(str(run / 'tracking' / 'mlflow' / 'mlflow.db'))}"


def test_a_tracked_runs_trackers_hold_what_metrics_jsonl_holds(data_root, tmp_path):
    run = tmp_path / "a run?#%41"  # what a URI would cut short or decode
    job = run_here(*_args(data_root, run, "--rounds", "2", "--track", "mlflow,tensorboard,wandb"))
    assert job.returncode == 0, job.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a run?#%41", "wandb-cache"]  # nothing outside the run
    assert "mpifl:" not in job.stderr and "wandb" not in job.stderr.lower() and "mlflow" not in job.stderr.lower()
    records, expected = read_metrics(run), _expected(run)
    assert ("global/test_acc/mean", 2) in expected and ("seconds/round", 1) in expected
    config = json.loads((run / "config.json").read_text())

    (found,) = mlflow_runs(_mlflow_uri(run))
    assert found.info.status == "FINISHED" and found.info.run_name == "a run?#%41"
    assert found.data.params == {k: str(v) for k, v in config.items()}
    logged = mlflow_scalars(_mlflow_uri(run), found.info.run_id)
    _same(logged, expected)
    assert logged[("global/test_acc/mean", 2)] == [100 * records[1]["eval"]["global"]["test"]["mean"]["acc"]]
    assert logged[("seconds/round", 2)] == [records[1]["seconds"]["round"]]
    artifacts = run / "tracking" / "mlflow" / "artifacts" / found.info.run_id / "artifacts"
    assert (artifacts / "summary.md").read_text() == (run / "summary.md").read_text()
    assert (artifacts / "config.json").is_file() and (artifacts / "report" / "accuracy-mean.png").is_file()

    events = run / "tracking" / "tensorboard"
    _same(tensorboard_scalars(events), expected, as_float32=True)
    assert {"config/text_summary", "summary/text_summary"} <= set(tensorboard_tags(events, "tensors"))
    assert "report/accuracy-mean" in tensorboard_tags(events, "images")

    (offline,) = wandb_runs(run / "tracking")
    _same(wandb_scalars([offline]), expected)
    described = wandb_run(offline)
    assert described.display_name == "a run?#%41" and not described.run_group
    assert {u.key: json.loads(u.value_json) for u in described.config.update}["rounds"] == 2
    files = offline.parent / "files"
    assert (files / "summary.csv").read_text() == (run / "summary.csv").read_text()
    assert (files / "report" / "report.md").is_file()
    cost = tracking_cost((run / "log.txt").read_text())  # what mpifl.bench --track reads of it
    assert set(cost) == {"round loop", "mlflow", "tensorboard", "wandb"} and all(0 < s < 5 for s in cost.values())


def test_a_resumed_run_continues_its_tracker_runs_and_a_tracker_added_then_gets_every_round(data_root, tmp_path,
                                                                                              monkeypatch):
    run = tmp_path / "run"
    monkeypatch.setenv("MPIFL_FAULT", "stop:rank=0,round=2")  # stopped after round 2, its record still pending
    first = run_here(*_args(data_root, run, "--rounds", "4", "--track", "mlflow,tensorboard"))
    assert first.returncode == 75, first.stderr
    meta = json.loads((run / "checkpoint" / "meta.json").read_text())
    assert meta["round"] == 2 and meta["tracking"].keys() == {"mlflow", "tensorboard"}
    (begun,) = mlflow_runs(_mlflow_uri(run))
    assert begun.info.status == "KILLED" and begun.info.run_id == meta["tracking"]["mlflow"]
    monkeypatch.setenv("MPIFL_FAULT", "stop:rank=0,round=3")  # W&B added: it gets round 1 from metrics.jsonl
    second = run_here("--resume", str(run), "--track", "mlflow,tensorboard,wandb")
    assert second.returncode == 75, second.stderr
    meta = json.loads((run / "checkpoint" / "meta.json").read_text())
    assert meta["round"] == 3 and meta["tracking"]["mlflow"] == begun.info.run_id
    monkeypatch.delenv("MPIFL_FAULT")
    last = run_here("--resume", str(run), "--track", "mlflow,tensorboard,wandb", "--ckpt-every", "4")
    assert last.returncode == 0, last.stderr
    assert [r["round"] for r in read_metrics(run)] == [1, 2, 3, 4]
    expected = _expected(run)

    (found,) = mlflow_runs(_mlflow_uri(run))  # the same MLflow run, finished now, each round once
    assert found.info.run_id == begun.info.run_id and found.info.status == "FINISHED"
    _same(mlflow_scalars(_mlflow_uri(run), found.info.run_id), expected)
    _same(tensorboard_scalars(run / "tracking" / "tensorboard"), expected, as_float32=True)
    offline = wandb_runs(run / "tracking")  # offline: one folder per part, the same W&B run id
    assert len(offline) == 2 and {wandb_run(path).run_id for path in offline} == {meta["tracking"]["wandb"]}
    _same(wandb_scalars(offline), expected)
    assert json.loads((run / "checkpoint" / "meta.json").read_text())["tracking"] == meta["tracking"]


def test_a_tracker_failing_mid_run_is_dropped_with_one_warning_and_the_run_is_as_without_it(data_root, tmp_path,
                                                                                            monkeypatch):
    plain = run_here(*_args(data_root, tmp_path / "plain", "--rounds", "3"))
    assert plain.returncode == 0, plain.stderr
    log = TensorBoardTracker.log

    def disk_full(self, step, values):
        if step == 2:
            raise OSError(28, "No space left on device")
        log(self, step, values)

    monkeypatch.setattr(TensorBoardTracker, "log", disk_full)
    run = tmp_path / "run"
    job = run_here(*_args(data_root, run, "--rounds", "3", "--track", "tensorboard,wandb"))
    assert job.returncode == 0, job.stderr
    warning = ("mpifl: warning: tracking to tensorboard stopped: OSError: [Errno 28] No space left on device; the run "
               "goes on")
    assert job.lines("mpifl: ") == [warning] and warning in (run / "log.txt").read_text()
    assert untimed(read_metrics(run)) == untimed(read_metrics(tmp_path / "plain"))
    expected = _expected(run)
    _same(wandb_scalars(wandb_runs(run / "tracking")), expected)  # the other tracker has every round
    assert {step for _, step in tensorboard_scalars(run / "tracking" / "tensorboard")} == {1}


def test_a_tracker_that_cannot_start_refuses_the_run_before_it_writes_anything(data_root, tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'file' / 'mlflow.db'}")  # a file in the way
    run = tmp_path / "run"
    job = run_here(*_args(data_root, run, "--rounds", "1", "--track", "tensorboard,mlflow"))
    assert job.returncode == 2
    one_error(job, "mpifl: error: --track mlflow cannot start: ", "leave mlflow out of --track")
    assert not run.exists()


def test_a_missing_package_refuses_the_run_before_it_writes_anything(data_root, tmp_path, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "wandb", None)
    run = tmp_path / "run"
    job = run_here(*_args(data_root, run, "--rounds", "1", "--track", "wandb"))
    assert job.returncode == 2
    one_error(job, "mpifl: error: --track wandb needs wandb, which is not installed; install it with "
                   "`pip install 'mpifl[wandb]'`")
    assert not run.exists()
