"""``python -m mpifl.analysis COMMAND RUN_DIR``: analyses over a run's checkpoint (CSV + PNG).

Commands: ``bn-divergence`` (FedWon Fig. 1b/12) and ``feature-similarity``
(FedWon Fig. 5); see :mod:`mpifl.analysis`.  Output goes to ``--out``
(default ``RUN_DIR/analysis``); a short summary is printed.

User errors print one line, ``mpifl: error: <message>``, and exit with 2.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import click

from mpifl.errors import MpiflError


def _common(command):
    options = [
        click.argument("run_dir"),
        click.option("--out", type=click.Path(file_okay=False), default=None,
                     help="output directory (default RUN_DIR/analysis)"),
        click.option("--models", type=click.Choice(["local", "checkpoint"]), default="local", show_default=True,
                     help="client models: local = after one more round of local training from the checkpoint "
                          "(what the papers compare; needs the data), checkpoint = the personal models as "
                          "checkpointed (shared entries + the client's private ones)"),
        click.option("--clients", default=None,
                     help="client ids separated by commas (default: the first client of each training domain)"),
        click.option("--data-root", default=None, help="dataset directory (default: the run's)"),
        click.option("--device", type=click.Choice(["cpu", "cuda", "auto"]), default="cpu", show_default=True),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def _guarded(function):
    @functools.wraps(function)
    def run(**kwargs):
        try:
            function(**kwargs)
        except MpiflError as exc:
            click.echo(f"mpifl: error: {exc}", err=True)
            sys.exit(exc.exit_code)
        except OSError as exc:  # a file that vanished or a disk that filled up while reading or writing
            click.echo(f"mpifl: error: {exc}; check it and run the analysis again", err=True)
            sys.exit(2)
    return run


@click.group("mpifl.analysis", context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
def main() -> None:
    """Analyses over a run's checkpoint (run with --ckpt-every N): CSV tables and PNG figures."""


def _load(run_dir, out, data_root, device, clients):
    """The run at its checkpoint, the clients to analyse, and the output folder, found writable before the work."""
    from mpifl.analysis import load_checkpointed, pick_clients
    from mpifl.rundir.directory import check_output_folder

    ckpt = load_checkpointed(run_dir, data_root, device)
    folder = Path(out) if out else Path(run_dir) / "analysis"
    check_output_folder(folder, "pass --out DIR to write the analysis elsewhere")
    return ckpt, pick_clients(ckpt, clients), folder


def _title(ckpt) -> str:
    return f"{ckpt.cfg.algo} on {ckpt.cfg.data} ({ckpt.cfg.model})"


@main.command("bn-divergence")
@_common
@_guarded
def bn_divergence(run_dir, out, models, clients, data_root, device) -> None:
    """BN running-statistic divergence per layer, between clients and client vs server (FedWon Fig. 1b/12)."""
    from mpifl.analysis import bn_divergence as analysis

    ckpt, ids, folder = _load(run_dir, out, data_root, device, clients)
    result = analysis.compute(ckpt, ids, models)
    files = analysis.write(result, folder, _title(ckpt))
    click.echo(f"{_title(ckpt)}: {len(result.layers)} BN layers, models {', '.join(result.models)}; {result.note}")
    for kind, values in result.summary().items():
        click.echo(f"  {kind}: " + ", ".join(f"{k} {v:.4g}" for k, v in values.items())
                   + " (mean over layers and pairs)")
    click.echo("wrote " + ", ".join(str(f) for f in files))


@main.command("feature-similarity")
@_common
@click.option("--images", type=int, default=64, show_default=True, help="test images per analysed client")
@_guarded
def feature_similarity(run_dir, out, models, clients, data_root, device, images) -> None:
    """Cosine similarity of last-conv feature maps between client models and with the server (FedWon Fig. 5)."""
    from mpifl.analysis import feature_similarity as analysis

    ckpt, ids, folder = _load(run_dir, out, data_root, device, clients)
    result = analysis.compute(ckpt, ids, models, images)
    files = analysis.write(result, folder, _title(ckpt))
    summary = result.summary()
    click.echo(f"{_title(ckpt)}: layer {result.layer}; {result.note}")
    click.echo(f"  mean cosine similarity of feature maps: C<->C {summary['C<->C']:.4f}, "
               f"S<->C {summary['S<->C']:.4f}")
    click.echo("wrote " + ", ".join(str(f) for f in files))


if __name__ == "__main__":
    main()
