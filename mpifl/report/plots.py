"""PNG figures of runs over rounds, one figure per metric, one line per run.

* ``accuracy-<domain>.png``: test accuracy (%; Dice for segmentation runs) of the domain per evaluated
  round, and ``accuracy-mean.png`` for the mean over source domains (the
  papers' curves: FedWon Fig. 4 right / Fig. 10a, FedNN Fig. 5, FedRDN Fig. 1);
* ``bytes-per-round.png``: MB of the method's tensors per round, down + up
  (``bytes.down + bytes.up`` of ``metrics.jsonl``: the ``--show-manifest``
  figure times the round's clients);
* ``seconds-per-round.png``: rank 0's wall-clock seconds per round
  (``seconds.round``);
* ``accuracy-mean-simulated-time.png``, for runs with a simulated clock (docs/clients.md): the mean test accuracy
  against the simulated seconds at the end of the round evaluated (``sim.time``).

The model kind plotted is each run's first evaluated kind (global when it
has one), except for a held-out domain, whose curve is the global model's.
Runs of one configuration share a colour and differ in line style by seed;
leave-one-domain-out folds differ in marker, and a fold's curve of the
domain it holds out is drawn thicker.
Figures are :class:`matplotlib.figure.Figure` objects rendered by the Agg
backend; pyplot is never used, so no figure stays open and no display is
needed.
"""

from __future__ import annotations

import re
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from mpifl.report.runs import Run, group_key

_STYLES = ("-", "--", ":", "-.")
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)


def _primary_kind(run: Run, domain: str) -> str | None:
    kinds = run.kinds
    if domain == run.holdout:
        return "global" if "global" in kinds else None
    return kinds[0] if kinds else None


def _accuracy_curve(run: Run, domain: str, simulated: bool = False) -> tuple[list[float], list[float]]:
    """(rounds, or simulated seconds, and test scores in %) of the run's evaluated rounds."""
    kind = _primary_kind(run, domain)
    xs, ys = [], []
    for record in run.evaluated:
        test = record["eval"].get(kind, {}).get("test", {}) if kind else {}
        scores = test.get("mean", {}) if domain == "mean" else test.get("domains", {}).get(domain, {})
        value = scores.get(run.metric)
        if value is not None and (not simulated or "sim" in record):
            xs.append(record["sim"]["time"] if simulated else record["round"])
            ys.append(100 * value)
    return xs, ys


class _Styler:
    """Colour per configuration, line style per seed within it, marker per held-out domain (folds of
    leave-one-domain-out); a fold's curve of its held-out domain is drawn thicker."""

    def __init__(self, runs: list[Run], labels: dict[str, str]):
        keys = list(dict.fromkeys(group_key(r.config) for r in runs))
        self._colour = {k: f"C{i % 10}" for i, k in enumerate(keys)}
        self._seeds = {k: sorted({r.seed for r in runs if group_key(r.config) == k}) for k in keys}
        self._folds = {k: sorted({r.holdout for r in runs if group_key(r.config) == k and r.holdout}) for k in keys}
        self.labels = labels

    def kwargs(self, run: Run, kind: str | None = None, domain: str | None = None, points: int = 0) -> dict:
        key = group_key(run.config)
        suffix = f", seed {run.seed}" + (f", held out {run.holdout}" if run.holdout else "")
        suffix += f" ({kind} model)" if kind and kind != "global" else ""
        style = {"color": self._colour[key], "linewidth": 1.4,
                 "linestyle": _STYLES[self._seeds[key].index(run.seed) % len(_STYLES)],
                 "label": self.labels.get(key, run.config.get("algo", "?")) + suffix}
        if run.holdout:
            style["marker"] = _MARKERS[self._folds[key].index(run.holdout) % len(_MARKERS)]
            if domain == run.holdout:
                style["linewidth"] = 2.8
        elif points and points < 30:
            style["marker"] = "."
        return style


def _figure(title: str, ylabel: str, xlabel: str = "round") -> tuple[Figure, object]:
    fig = Figure(figsize=(8.0, 4.8), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    if xlabel == "round":
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    return fig, ax


def _save(fig: Figure, ax, path: Path, lines: int) -> Path | None:
    if not lines:
        return None
    ax.legend(fontsize="small", loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    fig.savefig(path)
    return path


def plot_runs(runs: list[Run], out: Path, labels: dict[str, str] | None = None) -> list[Path]:
    """Write the figures of ``runs`` into ``out``; returns the files written (stable names)."""
    out.mkdir(parents=True, exist_ok=True)
    runs = [r for r in runs if r.records]
    styler = _Styler(runs, labels or {})
    written = []
    domains = list(dict.fromkeys(d for run in runs for d in run.domains))
    metrics = {run.metric for run in runs}
    score = "Dice" if metrics == {"dice"} else "accuracy" if metrics <= {"acc"} else "score (accuracy or Dice)"
    for domain in domains + ["mean"]:
        what = "mean over source domains" if domain == "mean" else f"domain {domain}"
        fig, ax = _figure(f"Test {score} per round: {what}", f"test {score} (%)")
        lines = 0
        for run in runs:
            xs, ys = _accuracy_curve(run, domain)
            if xs:
                ax.plot(xs, ys, **styler.kwargs(run, _primary_kind(run, domain), domain, len(xs)))
                lines += 1
        written.append(_save(fig, ax, out / f"accuracy-{_safe(domain)}.png", lines))
    fig, ax = _figure(f"Test {score} against simulated time: mean over source domains", f"test {score} (%)",
                      "simulated seconds")
    lines = 0
    for run in runs:
        xs, ys = _accuracy_curve(run, "mean", simulated=True)
        if xs:
            ax.plot(xs, ys, **styler.kwargs(run, _primary_kind(run, "mean"), "mean", len(xs)))
            lines += 1
    written.append(_save(fig, ax, out / "accuracy-mean-simulated-time.png", lines))
    fig, ax = _figure("Bytes per round (the method's tensors, down + up, all participating clients)",
                      "MB per round (10^6 bytes)")
    lines = 0
    for run in runs:
        xs = [r["round"] for r in run.records if "bytes" in r]
        ys = [(r["bytes"].get("down", 0) + r["bytes"].get("up", 0)) / 1e6 for r in run.records if "bytes" in r]
        if xs:
            ax.plot(xs, ys, **styler.kwargs(run))
            lines += 1
    written.append(_save(fig, ax, out / "bytes-per-round.png", lines))
    fig, ax = _figure("Seconds per round (rank 0's wall clock, broadcast to aggregated)", "seconds per round")
    lines = 0
    for run in runs:
        xs = [r["round"] for r in run.records if "round" in r.get("seconds", {})]
        ys = [r["seconds"]["round"] for r in run.records if "round" in r.get("seconds", {})]
        if xs:
            ax.plot(xs, ys, **styler.kwargs(run))
            lines += 1
    written.append(_save(fig, ax, out / "seconds-per-round.png", lines))
    return [p for p in written if p is not None]
