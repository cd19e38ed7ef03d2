"""TensorBoard scalars of runs, per round (``python -m mpifl.report ... --tensorboard``).

One event directory per run, ``<out>/tensorboard/<run>``, step = round:

* ``<kind>/test_acc/<domain>``, ``<kind>/test_loss/<domain>``,
  ``<kind>/val_acc/<domain>`` (``<domain>`` ``mean`` too; accuracies in %;
  kind = global or personal; ``dice`` in place of ``acc`` for a segmentation run) on evaluation rounds;
* ``train/loss``, ``train/acc`` (%), ``bytes/<down|up|wire_down|wire_up>``,
  ``seconds/<round|compute|...>`` every round.

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

MISSING = ("--tensorboard needs the tensorboard package, which is not installed; install it with "
           "`pip install 'mpifl[tensorboard]'` (or `pip install tensorboard`), or leave out --tensorboard")


def available() -> bool:
    return importlib.util.find_spec("tensorboard") is not None


def scalars(run: Run) -> list[tuple[str, float, int]]:
    """(tag, value, round) of every scalar of a run, in round order."""
    out = []
    score = run.metric  # acc, or dice for a segmentation run
    for record in run.records:
        step = int(record["round"])
        train = record.get("train", {})
        if "loss" in train:
            out.append(("train/loss", float(train["loss"]), step))
        if score in train:
            out.append((f"train/{score}", 100 * float(train[score]), step))
        out += [(f"bytes/{k}", float(v), step) for k, v in record.get("bytes", {}).items()]
        out += [(f"seconds/{k}", float(v), step) for k, v in record.get("seconds", {}).items()]
        for kind, splits in record.get("eval", {}).items():
            for split, metrics in (("test", (score, "loss")), ("val", (score,))):
                scores = splits.get(split, {})
                per_domain = {"mean": scores.get("mean", {}), **scores.get("domains", {})}
                for domain, values in per_domain.items():
                    for metric in metrics:
                        if metric in values:
                            scale = 100 if metric == score else 1
                            out.append((f"{kind}/{split}_{metric}/{domain}", scale * float(values[metric]), step))
    return out


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
            for tag, value, step in scalars(run):
                writer.add_scalar(tag, value, step)
        finally:
            writer.close()
        written.append(log_dir)
    return written
