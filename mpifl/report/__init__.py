"""Reports over run directories: per-domain tables, figures, TensorBoard scalars; the papers' numbers beside ours.

    python -m mpifl.report RUN_DIR [RUN_DIR ...] [--out DIR] [--preset NAME] [--tensorboard] [--no-plots]

* :mod:`mpifl.report.runs` finds runs and groups those that differ only in the seed;
* :mod:`mpifl.report.tables` writes ``report.md`` / ``report.csv`` (last round, best-validation round,
  mean ± std over seeds; with a preset, ours | paper | difference per domain);
* :mod:`mpifl.report.plots` writes the PNG figures (accuracy per domain over rounds, bytes and
  seconds per round);
* :mod:`mpifl.report.tensorboard` writes per-round scalars for TensorBoard (optional package).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from mpifl.errors import MpiflError
from mpifl.report.runs import Run, find_runs, group_key
from mpifl.report.tables import GroupTable, build_tables, markdown, write_tables
from mpifl.rundir.directory import check_output_folder


@dataclass
class Report:
    runs: list[Run]
    tables: list[GroupTable]
    out: Path
    files: list[Path] = field(default_factory=list)
    markdown: str = ""


def build_report(paths: list, out: Path, preset: str | None = None, plots: bool = True,
                 tensorboard: bool = False, include_incomplete: bool = False) -> Report:
    """Everything ``python -m mpifl.report`` writes, for the runs under ``paths``, into ``out``; runs that did not
    reach their last round are left out (and named) unless ``include_incomplete``."""
    if tensorboard:
        from mpifl.report import tensorboard as tb

        if not tb.available():  # before any work: a clear message, nothing half-written
            raise MpiflError(tb.MISSING)
    found = find_runs(paths)
    runs = [run for run in found if run.complete or include_incomplete]
    left_out = [run for run in found if run not in runs]
    if not runs:
        raise MpiflError(f"no complete run among the {len(found)} given ({left_out[0].label()}"
                         f"{', ...' if len(left_out) > 1 else ''}); pass --include-incomplete to report them anyway")
    base = Path.cwd()
    tables = build_tables(runs, preset)
    out = Path(out)
    check_output_folder(out, "pass --out DIR to write the report elsewhere")
    files = list(write_tables(tables, out, base, left_out))
    labels = {group_key(t.config): t.label for t in tables}
    if plots:
        from mpifl.report.plots import plot_runs

        files += plot_runs(runs, out, labels)
    if tensorboard:
        from mpifl.report.tensorboard import write_tensorboard

        files += write_tensorboard(runs, out, [run.relative(base) for run in runs])
    return Report(runs=runs, tables=tables, out=out, files=files, markdown=markdown(tables, base, left_out))


__all__ = ["Report", "build_report", "build_tables", "find_runs", "markdown"]
