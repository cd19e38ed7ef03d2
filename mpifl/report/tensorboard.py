"""TensorBoard scalars of runs, per round (``python -m mpifl.report ... --tensorboard``).

One event directory per run, ``<out>/tensorboard/<run>``, step = round, the scalars named as
:mod:`mpifl.server.scalars` names them (``train/loss``, ``global/test_acc/mean``, ``bytes/down``,
``seconds/round``, ...): the names ``--track tensorboard`` gives them while the run goes on.  A run with a
simulated clock (docs/clients.md) stamps each round's scalars with its simulated time as their wall time, so
TensorBoard's "Relative" horizontal axis shows accuracy against simulated time (from round 1's end).

Needs the ``tensorboard`` package (``pip install 'mpifl[tensorboard]'``),
used through ``torch.utils.tensorboard``; without it :func:`write_tensorboard`
fails with a one-line message that says how to install it.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from mpifl.errors import MpiflError
from mpifl.report.runs import Run
from mpifl.server.scalars import scalars as record_scalars

MISSING = ("--tensorboard needs the tensorboard package, which is not installed; install it with "
           "`pip install 'mpifl[tensorboard]'` (or `pip install tensorboard`), or leave out --tensorboard")


def available() -> bool:
    return importlib.util.find_spec("tensorboard") is not None


def scalars(run: Run) -> list[tuple[str, float, int, float | None]]:
    """(tag, value, round, simulated time or None) of every scalar of a run, in round order
    (:func:`mpifl.server.scalars.scalars`)."""
    return [(tag, value, int(record["round"]), record["sim"]["time"] if "sim" in record else None)
            for record in run.records for tag, value in record_scalars(record, run.metric).items()]


def write_tensorboard(runs: list[Run], out: Path, names: list[str] | None = None) -> list[Path]:
    """Event files of ``runs`` under ``out/tensorboard``; returns the run directories written."""
    if not available():
        raise MpiflError(MISSING)
    from torch.utils.tensorboard import SummaryWriter

    written = []
    names = names or [str(run.path) for run in runs]
    for run, name in zip(runs, names):
        log_dir = Path(out) / "tensorboard" / re.sub(r"[^A-Za-z0-9_.=-]+", "_", name).strip("_")
        writer = SummaryWriter(log_dir=str(log_dir))
        try:
            for tag, value, step, simulated in scalars(run):
                writer.add_scalar(tag, value, step, walltime=simulated)
        finally:
            writer.close()
        written.append(log_dir)
    return written
