"""``--track wandb``: a Weights & Biases run, offline by default (``<run>/tracking/wandb/offline-run-*``, sent
later with ``wandb sync``), which needs no network; ``WANDB_MODE=online`` sends it live.  ``WANDB_DIR`` (default
``<run>/tracking``), ``WANDB_PROJECT`` (default ``mpifl``) and W&B's other variables are honoured.

The run is named after the run directory, ``--holdout all``'s folds are grouped by their folder; the options are
its config, each round's scalars are logged at step = round, and a finished run saves config.json, the summaries
and the report's files.  A resumed run continues the W&B run of the checkpoint (same id; offline, a second
``offline-run-*`` folder that ``wandb sync`` adds to it).  W&B's console capture, code and git saving and system
metrics are off: they would write into the run's output or take rank 0's CPU.
"""

from __future__ import annotations

import os
import secrets
import shutil
import string
from pathlib import Path

from .tracker import FINISHED, STOPPED, TrackedRun, Tracker

PROJECT = "mpifl"  # unless WANDB_PROJECT says otherwise
ID_CHARACTERS = string.ascii_lowercase + string.digits  # of a W&B run id
EXIT_CODES = {FINISHED: 0, STOPPED: 75}  # else failed: 1


class WandbTracker(Tracker):
    name = "wandb"

    def __init__(self, run: TrackedRun):
        import wandb

        self.run_id = run.continues or "".join(secrets.choice(ID_CHARACTERS) for _ in range(8))
        self.first_round = run.logs_from
        folder = os.environ.get("WANDB_DIR") or str(run.folder)
        os.makedirs(folder, exist_ok=True)
        settings = wandb.Settings(console="off", silent=True, save_code=False, disable_git=True,
                                  disable_job_creation=True, x_disable_stats=True)
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT") or PROJECT, dir=folder, id=self.run_id,
                              name=run.name, group=run.group, config=run.config, resume="allow",
                              mode=os.environ.get("WANDB_MODE") or "offline", settings=settings)
        if run.continues:
            self.run.config.update(run.config, allow_val_change=True)  # the options a resume may change

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def attach(self, files: dict[str, Path], summary: str, step: int) -> None:
        for name, path in files.items():  # the W&B run's files folder is sent with the run
            target = Path(self.run.dir) / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target)

    def close(self, status: str) -> None:
        self.run.finish(exit_code=EXIT_CODES.get(status, 1))
