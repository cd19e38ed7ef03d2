"""BN running-statistic divergence between clients and between a client and the server, per BN layer.

FedWon (Zhuang & Lyu, ICLR 2024) Fig. 1b and Fig. 12 plot the channel-wise running means
and variances of the BN layers of a 6-layer CNN for two clients of different
domains, and for a client and the server, to show that they differ (the
motivation for removing BN).  The paper shows the curves only; it defines no
distance.  Here, for BN layer l with C channels and two models a, b with
running means mu and running variances var (``running_mean``/``running_var``
of the layer, BN eps 1e-5 added to the variances):

* ``mean_rmsd`` = sqrt(1/C sum_c (mu_a,c - mu_b,c)^2), the RMS difference of
  the running means;
* ``var_rmsd``  = sqrt(1/C sum_c (var_a,c - var_b,c)^2), of the running variances;
* ``sym_kl``    = 1/C sum_c (KL(N_a,c || N_b,c) + KL(N_b,c || N_a,c)) / 2, the
  symmetric Kullback-Leibler divergence of the per-channel Gaussians
  N(mu, var) the statistics describe, averaged over channels:
  ``((var_a + d^2) / var_b + (var_b + d^2) / var_a) / 4 - 1/2`` with
  ``d = mu_a - mu_b``; 0 for equal statistics, scale-free.

Pairs: every pair of analysed clients (C<->C) and every client with the
server (S<->C).  What the models are (:mod:`mpifl.analysis.checkpoints`):
``--models local`` (default) trains each client one more round from the
checkpoint, so a FedAvg client's statistics are those its local training
tracked on its own domain, as in FedWon's figures; ``--models checkpoint``
takes the personal models, which differ between clients only for methods
that keep BN statistics private (FedBN, SiloBN, gPerXAN's BN side,
SingleSet): for FedAvg/FedProx/FedStein/FixBN all clients then hold the
server's statistics and every divergence is 0.  The server's statistics are
``server.pt``'s when the method shares them, else the clients' average
(FedBN, SiloBN).  Models without BN (FedWon, FedAvg+GN/LN, FedNN's AGN) have
nothing to compare: an error says so.

Outputs: ``bn-divergence.csv`` (one row per layer and pair),
``bn-divergence.png`` (per layer, the mean over C<->C pairs and over S<->C
pairs of each measure) and ``bn-statistics.png`` (FedWon Fig. 12's view:
channel-wise running mean and variance of two clients and the server, for up
to six BN layers).
"""

from __future__ import annotations

import csv
import itertools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from mpifl.analysis.checkpoints import Checkpointed, client_states, describe
from mpifl.errors import MpiflError
from mpifl.models import state_entries

BN_EPS = 1e-5
MEASURES = ("mean_rmsd", "var_rmsd", "sym_kl")


def bn_layers(ckpt: Checkpointed) -> list[str]:
    """Names of the model's BatchNorm layers (PerXAN BN sides included) that track running statistics."""
    entries = state_entries(ckpt.session.build_model())
    return [e.key.removesuffix(".running_mean") for e in entries
            if e.attr == "running_mean" and (e.module_kind == "bn" or e.is_bn_side)]


def divergence(mean_a: torch.Tensor, var_a: torch.Tensor, mean_b: torch.Tensor, var_b: torch.Tensor) -> dict:
    """The three measures of the module docstring for one layer and one pair of models."""
    mean_a, mean_b = mean_a.double(), mean_b.double()
    var_a, var_b = var_a.double() + BN_EPS, var_b.double() + BN_EPS
    d2 = (mean_a - mean_b) ** 2
    sym_kl = ((var_a + d2) / var_b + (var_b + d2) / var_a) / 4 - 0.5
    return {"mean_rmsd": float(d2.mean().sqrt()), "var_rmsd": float(((var_a - var_b) ** 2).mean().sqrt()),
            "sym_kl": float(sym_kl.mean())}


@dataclass
class BNDivergence:
    layers: list[str]
    rows: list[dict]  # one per layer and pair
    stats: dict[str, dict[str, tuple[np.ndarray, np.ndarray]]]  # model name -> layer -> (mean, var)
    models: list[str]
    note: str
    caption: str = ""

    def summary(self) -> dict[str, dict[str, float]]:
        """Per kind (C<->C, S<->C) and measure, the mean over layers and pairs."""
        out = {}
        for kind in ("C<->C", "S<->C"):
            rows = [r for r in self.rows if r["kind"] == kind]
            out[kind] = {m: float(np.mean([r[m] for r in rows])) if rows else float("nan") for m in MEASURES}
        return out


def compute(ckpt: Checkpointed, clients: list[int], models: str = "local") -> BNDivergence:
    layers = bn_layers(ckpt)
    if not layers:
        raise MpiflError(f"the {ckpt.cfg.model} of --algo {ckpt.cfg.algo} has no BatchNorm layer with running "
                         "statistics: there is nothing to compare (FedWon removes normalization; GN/LN/AGN keep no "
                         "running statistics)")
    states = {f"client {c} ({ckpt.domain(c)})": s for c, s in client_states(ckpt, clients, models).items()}
    server = ckpt.server_state()
    names = list(states) + ["server"]
    states["server"] = server
    stats = {n: {l: (states[n][f"{l}.running_mean"].detach().cpu().double().numpy(),
                     states[n][f"{l}.running_var"].detach().cpu().double().numpy()) for l in layers} for n in names}
    rows = []
    clients_names = names[:-1]
    pairs = [(a, b, "C<->C") for a, b in itertools.combinations(clients_names, 2)]
    pairs += [(a, "server", "S<->C") for a in clients_names]
    for index, layer in enumerate(layers):
        for a, b, kind in pairs:
            (ma, va), (mb, vb) = stats[a][layer], stats[b][layer]
            rows.append({"layer": layer, "index": index, "channels": len(ma), "kind": kind, "a": a, "b": b,
                         **divergence(torch.from_numpy(ma), torch.from_numpy(va), torch.from_numpy(mb),
                                      torch.from_numpy(vb))})
    note, caption = describe(ckpt, models)
    return BNDivergence(layers=layers, rows=rows, stats=stats, models=names, note=note, caption=caption)


def write(result: BNDivergence, out: Path, title: str) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    table = out / "bn-divergence.csv"
    with table.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["layer", "index", "channels", "kind", "a", "b", *MEASURES])
        writer.writeheader()
        writer.writerows(result.rows)
    return [table, _plot_divergence(result, out / "bn-divergence.png", title),
            _plot_statistics(result, out / "bn-statistics.png", title)]


def _plot_divergence(result: BNDivergence, path: Path, title: str) -> Path:
    fig = Figure(figsize=(12, 4.2), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 3)
    x = np.arange(len(result.layers))
    labels = {"mean_rmsd": "RMS difference of running means", "var_rmsd": "RMS difference of running variances",
              "sym_kl": "symmetric KL of N(mean, var), per channel"}
    for ax, measure in zip(axes, MEASURES):
        for kind, colour in (("C<->C", "C0"), ("S<->C", "C3")):
            per_layer = [np.mean([r[measure] for r in result.rows if r["kind"] == kind and r["index"] == i] or
                                 [np.nan]) for i in x]
            ax.plot(x, per_layer, marker="o", color=colour,
                    label="between clients (mean over pairs)" if kind == "C<->C" else "client vs server (mean)")
        ax.set_title(labels[measure], fontsize="medium")
        ax.set_xlabel("BN layer")
        ax.set_ylabel(measure)
        ax.set_xticks(x, [_short(l) for l in result.layers], rotation=45 if len(x) > 6 else 0, fontsize="small",
                      ha="right" if len(x) > 6 else "center")
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize="small")
    fig.suptitle(f"{title}: BN running-statistic divergence per layer\n{result.caption}", fontsize="medium")
    fig.savefig(path)
    return path


def _plot_statistics(result: BNDivergence, path: Path, title: str) -> Path:
    """FedWon Fig. 12: channel-wise running mean and variance of two clients and the server."""
    chosen = result.layers if len(result.layers) <= 6 else \
        [result.layers[i] for i in np.linspace(0, len(result.layers) - 1, 6).round().astype(int)]
    shown = result.models[:2] + (["server"] if "server" not in result.models[:2] else [])
    fig = Figure(figsize=(11, 2.3 * len(chosen) + 0.8), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = np.atleast_2d(fig.subplots(len(chosen), 2, squeeze=False))
    for row, layer in zip(axes, chosen):
        for name, style in zip(shown, ("-", "-", "--")):
            mean, var = result.stats[name][layer]
            row[0].plot(mean, style, linewidth=1, label=name)
            row[1].plot(var, style, linewidth=1, label=name)
        row[0].set_ylabel(f"{_short(layer)}\nrunning mean")
        row[1].set_ylabel("running variance")
        for ax in row:
            ax.grid(True, alpha=0.3)
    axes[-1][0].set_xlabel("channel")
    axes[-1][1].set_xlabel("channel")
    axes[0][0].legend(fontsize="small")
    fig.suptitle(f"{title}: BN running statistics per channel\n{result.caption}", fontsize="medium")
    fig.savefig(path)
    return path


def _short(layer: str) -> str:
    return layer if len(layer) <= 18 else "…" + layer[-17:]
