"""``--track mlflow``: an MLflow run in the store ``MLFLOW_TRACKING_URI`` names, by default a SQLite store of the
run's own, ``<run>/tracking/mlflow/mlflow.db``, its artifacts beside it (``mlflow ui --backend-store-uri
sqlite:///<run>/tracking/mlflow/mlflow.db``).

Why SQLite, not MLflow's file store: from MLflow 3 on, the file store (``./mlruns``) is in maintenance mode and
refuses to open unless ``MLFLOW_ALLOW_FILE_STORE=true``; the SQLite store is the local store MLflow supports and
opens by default.  A ``file:`` URI in ``MLFLOW_TRACKING_URI`` is used as given.

The experiment is ``MLFLOW_EXPERIMENT_NAME`` (default ``mpifl``), the run named after the run directory; the
options are its parameters (a resumed run's changed options, which MLflow's parameters cannot take, are in
the ``config.json`` it attaches at the end), each round's scalars its metrics at step = round; tags name the
run directory and, for ``--holdout all``'s folds, the folder of folds.  A run stopped by a signal ends as
``KILLED``, and its resume sets it ``RUNNING`` again.
"""

from __future__ import annotations

import logging
import os
import posixpath
import time
from pathlib import Path
from urllib.parse import quote

from .tracker import FAILED, FINISHED, TrackedRun, Tracker

FOLDER = "mlflow"  # inside the run's tracking folder
EXPERIMENT = "mpifl"  # unless MLFLOW_EXPERIMENT_NAME says otherwise
BATCH = 1000  # metrics per call, MLflow's limit
STATUS = {FINISHED: "FINISHED", FAILED: "FAILED"}  # else KILLED: a stop, to be resumed


def _uri() -> str | None:
    return os.environ.get("MLFLOW_TRACKING_URI") or None


class MlflowTracker(Tracker):
    name = "mlflow"

    @classmethod
    def modules(cls) -> tuple[str, ...]:
        local = _uri() is None or _uri().startswith("sqlite:")  # a SQLite store needs SQLAlchemy and Alembic
        return ("mlflow",) + (("sqlalchemy", "alembic") if local else ())

    def __init__(self, run: TrackedRun):
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        for name in ("mlflow", "alembic"):  # their start-up lines (creating the store's tables) are not the run's
            logging.getLogger(name).setLevel(logging.WARNING)

        own = run.folder / FOLDER
        if _uri() is None:
            own.mkdir(parents=True, exist_ok=True)
        # the path quoted, as SQLAlchemy unquotes it: a '?' or '#' in a run directory's name must not cut it short
        self.client = MlflowClient(tracking_uri=_uri() or f"sqlite:///{quote(str((own / 'mlflow.db').absolute()))}")
        if run.continues:
            self.run_id, self.first_round = run.continues, run.logs_from
            found = self.client.get_run(self.run_id)  # a store without it raises: the run is refused, named
            if _uri() is None and not found.info.artifact_uri.startswith((own / "artifacts").absolute().as_uri()):
                raise RuntimeError(f"its artifacts are in {found.info.artifact_uri}, outside this run directory, "
                                   "which moved since")
            self.client.update_run(self.run_id, status="RUNNING")
            self.client.set_tag(self.run_id, "mpifl.resumed_from_round", str(run.first_round))
            return
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or EXPERIMENT
        experiment = self.client.get_experiment_by_name(name)
        experiment_id = (experiment.experiment_id if experiment else self.client.create_experiment(
            name, artifact_location=(own / "artifacts").absolute().as_uri() if _uri() is None else None))
        tags = {"mpifl.run_dir": str(run.path.absolute())} | ({"mpifl.folds": run.group} if run.group else {})
        self.run_id, self.first_round = self.client.create_run(experiment_id, run_name=run.name,
                                                               tags=tags).info.run_id, run.logs_from
        self.client.log_batch(self.run_id, params=[Param(k, str(v)) for k, v in run.config.items()])

    def log(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        stamp = int(time.time() * 1000)
        metrics = [Metric(tag, value, stamp, step) for tag, value in values.items()]
        for start in range(0, len(metrics), BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[start:start + BATCH])

    def attach(self, files: dict[str, Path], summary: str, step: int) -> None:
        for name, path in files.items():
            self.client.log_artifact(self.run_id, str(path), posixpath.dirname(name) or None)

    def close(self, status: str) -> None:
        self.client.set_terminated(self.run_id, STATUS.get(status, "KILLED"))
