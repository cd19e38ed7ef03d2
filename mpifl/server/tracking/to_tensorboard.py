"""``--track tensorboard``: event files in ``<run>/tracking/tensorboard`` (``tensorboard --logdir`` it, or a folder
of runs), written through ``torch.utils.tensorboard``.

The run directory is the tracker run: a resumed run appends to it, and events it had logged after the checkpoint
are purged (``purge_step``), so TensorBoard shows each round once.  The configuration is a text (``config``), the
summary too (``summary``), the report's figures are images (``report/<figure>``).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ...rundir.names import TRACKING
from .tracker import TrackedRun, Tracker

FOLDER = "tensorboard"  # inside the run's tracking folder


class TensorBoardTracker(Tracker):
    name = "tensorboard"

    def __init__(self, run: TrackedRun):
        from torch.utils.tensorboard import SummaryWriter

        self.run_id = f"{TRACKING}/{FOLDER}"
        self.first_round = run.logs_from
        self.writer = SummaryWriter(log_dir=str(run.folder / FOLDER), purge_step=self.first_round)
        self.writer.add_text("config", _code(json.dumps(run.config, indent=1)), self.first_round - 1)
        self.writer.flush()

    def log(self, step: int, values: dict[str, float]) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()  # the live view: at once, not at torch's default of every two minutes

    def attach(self, files: dict[str, Path], summary: str, step: int) -> None:
        from PIL import Image

        self.writer.add_text("summary", summary, step)
        for name, path in files.items():
            if path.suffix == ".png":
                with Image.open(path) as image:
                    pixels = np.asarray(image.convert("RGB"))
                self.writer.add_image(name.removesuffix(".png"), pixels, step, dataformats="HWC")
        self.writer.flush()

    def close(self, status: str) -> None:
        self.writer.close()


def _code(text: str) -> str:
    """``text`` as a markdown code block (TensorBoard renders its texts as markdown)."""
    return "".join("    " + line + "\n" for line in text.splitlines())
