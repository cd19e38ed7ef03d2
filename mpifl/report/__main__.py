"""``python -m mpifl.report RUN_DIR [RUN_DIR ...]``: tables, figures and TensorBoard scalars of runs.

Prints the markdown report (per configuration and domain: last round,
best-validation round, mean ± std over seeds; with a preset, the paper's
numbers and the difference) and writes into ``--out`` (default
``RUN_DIR/report`` for one run directory, ``./report`` for several):
``report.md``, ``report.csv``, ``accuracy-<domain>.png``,
``accuracy-mean.png``, ``bytes-per-round.png``, ``seconds-per-round.png`` (and
``accuracy-mean-simulated-time.png`` for runs with a simulated clock) and, with ``--tensorboard``,
``tensorboard/<run>/`` event files.

User errors print one line, ``mpifl: error: <message>``, and exit with 2.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from mpifl.errors import MpiflError


@click.command("mpifl.report", context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.argument("run_dirs", nargs=-1, required=True)
@click.option("--out", type=click.Path(file_okay=False), default=None,
              help="output directory (default: RUN_DIR/report for one run directory, ./report for several)")
@click.option("--preset", default=None,
              help="compare every run with this preset's paper numbers (default: each run's own --preset, "
                   "from its config.json); see python -m mpifl.run --list-presets")
@click.option("--tensorboard", is_flag=True, default=False,
              help="also write per-round scalars for TensorBoard into OUT/tensorboard (needs the tensorboard "
                   "package: pip install 'mpifl[tensorboard]')")
@click.option("--no-plots", is_flag=True, default=False, help="tables only, no PNG figures")
@click.option("--include-incomplete", is_flag=True, default=False,
              help="count runs that did not reach their last round (killed, stopped, still running) in the means; "
                   "by default they are left out and named")
def main(run_dirs: tuple[str, ...], out: str | None, preset: str | None, tensorboard: bool, no_plots: bool,
         include_incomplete: bool) -> None:
    """Per-domain tables (markdown and CSV) and figures of one or more runs: RUN_DIR is a run's --out, or a
    folder holding runs (e.g. the holdout-<domain> folds of --holdout all)."""
    from mpifl.report import build_report

    target = Path(out) if out else (Path(run_dirs[0]) / "report" if len(run_dirs) == 1 else Path("report"))
    try:
        report = build_report(list(run_dirs), target, preset=preset, plots=not no_plots, tensorboard=tensorboard,
                              include_incomplete=include_incomplete)
    except MpiflError as exc:
        click.echo(f"mpifl: error: {exc}", err=True)
        sys.exit(exc.exit_code)
    except OSError as exc:  # a file that vanished or a disk that filled up while reading or writing
        click.echo(f"mpifl: error: {exc}; check it and run the report again", err=True)
        sys.exit(2)
    click.echo(report.markdown, nl=False)
    click.echo(f"\nwrote {len(report.files)} files to {report.out}: "
               + ", ".join(p.name for p in report.files), err=True)


if __name__ == "__main__":
    main()
