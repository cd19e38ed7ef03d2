"""Per-domain tables of one or more runs: last round, best-validation round, mean ± std over seeds, and the
paper's numbers beside ours when the runs come from a preset (``--preset``, :mod:`mpifl.presets`).

For each configuration (:func:`mpifl.report.runs.group_runs`) and model kind
(global / personal), per domain: test accuracy (%) at the last evaluated
round and at the best-validation round of the run's ``--select-by`` rule
(as ``summary.csv``: :func:`mpifl.server.run_log.summary_rows`), as mean ± sample
standard deviation (n - 1) over the seeds.  With a preset, the paper's
number for the same method (:meth:`mpifl.presets.Preset.result_for`), its
standard deviation when the paper gives one, and ours minus the paper's at
the round the preset names (``selection``: last or best).

Leave-one-domain-out configurations (``--holdout``) have one row per
held-out domain: the global model's accuracy on that domain in the fold that
held it out, the protocol of gPerXAN Table 2; ``mean`` is the mean over the
held-out domains.

When our domains and the paper's differ (a run on 3 of the paper's 5
domains), the means are not comparable: the ``mean`` row then carries no
paper number, and a row ``mean (in common)`` compares our per-seed mean over
the domains both have with the paper's mean recomputed from its per-domain
numbers over those domains; a note names them.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mpifl.errors import MpiflError
from mpifl.presets import PaperResult, Preset, load_preset
from mpifl.report.runs import IGNORED_KEYS, Run, group_runs


@dataclass
class Row:
    """One domain of one configuration and model kind; accuracies in % per replicate (seed)."""

    domain: str
    last: list[float]
    best: list[float]
    paper: float | None = None
    paper_std: float | None = None


@dataclass
class GroupTable:
    """One configuration's table for one model kind."""

    label: str
    config: dict
    runs: list[Run]
    kind: str
    lodo: bool
    seeds: list[int]
    last_rounds: list[int]
    best_rounds: list[int]
    rows: list[Row]
    preset: Preset | None = None
    paper: PaperResult | None = None  # the paper's row, on the table of the kind it is compared with
    notes: list[str] = field(default_factory=list)

    @property
    def selection(self) -> str:
        return self.preset.selection if self.preset else "last"

    def row(self, domain: str) -> Row | None:
        return next((r for r in self.rows if r.domain == domain), None)


def mean_std(values: list[float]) -> tuple[float, float | None]:
    """Mean and sample standard deviation (n - 1; None for one value) of the finite values."""
    finite = [v for v in values if v is not None and math.isfinite(v)]
    if not finite:
        return float("nan"), None
    return float(np.mean(finite)), float(np.std(finite, ddof=1)) if len(finite) > 1 else None


def ours(row: Row, selection: str) -> float:
    return mean_std(row.best if selection == "best" else row.last)[0]


def diff(row: Row, selection: str) -> float | None:
    if row.paper is None:
        return None
    value = ours(row, selection)
    return value - row.paper if math.isfinite(value) else None


def build_tables(runs: list[Run], preset_name: str | None = None) -> list[GroupTable]:
    """One :class:`GroupTable` per configuration and model kind, in the order the runs came.

    ``preset_name`` compares every run with that preset's numbers; otherwise
    each run's own ``preset`` (from ``config.json``) is used, if any.
    """
    groups = group_runs([r for r in runs if r.evaluated])
    labels = _labels([g[0].config for g in groups])
    presets: dict[str, Preset] = {}
    tables = []
    for members, label in zip(groups, labels):
        config = members[0].config
        name = preset_name or config.get("preset")
        if name and name not in presets:
            presets[name] = load_preset(name)
        preset = presets[name] if name else None
        paper = preset.result_for(config) if preset else None
        if any(run.holdout for run in members):
            tables.append(_lodo_table(label, members, preset, paper))
        else:
            tables += _tables(label, members, preset, paper)
    return tables


def _labels(configs: list[dict]) -> list[str]:
    """The algorithm, plus the options in which configurations of that algorithm differ."""
    out = []
    for config in configs:
        same_algo = [c for c in configs if c.get("algo") == config.get("algo")]
        keys = sorted({k for c in same_algo for k in {**c, **config}
                       if k not in IGNORED_KEYS and k != "holdout" and c.get(k) != config.get(k)})
        extra = ", ".join(f"{k}={config.get(k)}" for k in keys)
        out.append(f"{config.get('algo')}" + (f" ({extra})" if extra else ""))
    return out


def _scope(paper: PaperResult | None, kinds: tuple[str, ...], lodo: bool) -> str | None:
    """The model kind the paper's number is compared with."""
    if paper is None:
        return None
    if lodo:
        return "global"
    return paper.scope if paper.scope in kinds else kinds[0]


def _tables(label: str, members: list[Run], preset: Preset | None, paper: PaperResult | None) -> list[GroupTable]:
    kinds = members[0].kinds
    domains = members[0].source_domains + ["mean"]
    compared = _scope(paper, kinds, False)
    tables = []
    for kind in kinds:
        rows = []
        for domain in domains:
            scores = [run.scores.get(kind, {}).get(domain) for run in members]
            rows.append(Row(domain, last=[100 * s["last"] if s else float("nan") for s in scores],
                            best=[100 * s["best"] if s else float("nan") for s in scores]))
        mean_scores = [run.scores.get(kind, {}).get("mean", {}) for run in members]
        table = GroupTable(label=label, config=members[0].config, runs=members, kind=kind, lodo=False,
                           seeds=[run.seed for run in members],
                           last_rounds=[s.get("last_round") for s in mean_scores],
                           best_rounds=[s.get("best_round") for s in mean_scores], rows=rows, preset=preset)
        if paper is not None and kind == compared:
            _attach(table, paper, set(domains))
        tables.append(table)
    return tables


def _lodo_table(label: str, members: list[Run], preset: Preset | None, paper: PaperResult | None) -> GroupTable:
    """Leave-one-domain-out: each seed's folds give one replicate of per-held-out-domain accuracies."""
    by_seed: dict[int, dict[str, Run]] = {}
    for run in members:
        if run.holdout:
            by_seed.setdefault(run.seed, {})[run.holdout] = run
    order = members[0].domains
    domains = [d for d in order if any(d in folds for folds in by_seed.values())]
    domains += sorted({d for folds in by_seed.values() for d in folds} - set(domains))
    rows = []
    for domain in domains:
        scores = [folds[domain].scores.get("global", {}).get(domain) if domain in folds else None
                  for folds in by_seed.values()]
        rows.append(Row(domain, last=[100 * s["last"] if s else float("nan") for s in scores],
                        best=[100 * s["best"] if s else float("nan") for s in scores]))
    complete = [all(d in folds for d in domains) for folds in by_seed.values()]
    rows.append(Row("mean", last=[float(np.mean([r.last[i] for r in rows])) if ok else float("nan")
                                  for i, ok in enumerate(complete)],
                    best=[float(np.mean([r.best[i] for r in rows])) if ok else float("nan")
                          for i, ok in enumerate(complete)]))
    notes = []
    if not all(complete):
        missing = {seed: sorted(set(domains) - set(folds)) for seed, folds in by_seed.items()
                   if set(folds) != set(domains)}
        notes.append("folds missing (seed: held-out domains): "
                     + "; ".join(f"{s}: {', '.join(d)}" for s, d in missing.items()) + "; their mean is left out")
    fold_runs = [run for folds in by_seed.values() for run in folds.values()]
    table = GroupTable(label=label, config=members[0].config, runs=members, kind="global", lodo=True,
                       seeds=sorted(by_seed), last_rounds=sorted({r.scores["global"]["mean"]["last_round"]
                                                                  for r in fold_runs}),
                       best_rounds=[r.scores["global"]["mean"]["best_round"] for r in fold_runs],
                       rows=rows, preset=preset, notes=notes)
    if paper is not None:
        _attach(table, paper, set(domains) | {"mean"})
    return table


def changed_settings(preset: Preset, config: dict) -> dict[str, tuple]:
    """The preset's values a run did not keep (``--config`` or command-line overrides): key -> (ours, preset's)."""
    out = {}
    for key, value in preset.values(config.get("algo", "")).items():
        ours = config.get(key)
        if key == "holdout" and value == "all" and ours:
            continue  # the folds of --holdout all
        if ours != value:
            out[key] = (ours, value)
    return out


def _attach(table: GroupTable, paper: PaperResult, ours_domains: set[str]) -> None:
    table.paper = paper
    changed = changed_settings(table.preset, table.config)
    if changed:
        table.notes.append("this configuration changed the preset's settings, so the paper's numbers are not "
                           "its target: " + ", ".join(f"{k} {ours} (preset: {theirs})"
                                                      for k, (ours, theirs) in changed.items()))
    for row in table.rows:
        if row.domain in paper.acc:
            row.paper, row.paper_std = paper.acc[row.domain], paper.std.get(row.domain)
    ours_only = ours_domains - {"mean"}
    common = [d for d in paper.domains if d in ours_only]
    if common and set(common) != set(paper.domains) | ours_only:
        _common_mean(table, paper, common, len(ours_only))
        return
    missing = [d for d in paper.acc if d not in ours_domains]
    if missing:
        table.notes.append(f"the paper's domains {', '.join(missing)} are not among this run's domains "
                           f"({', '.join(sorted(ours_domains - {'mean'}))}): another dataset?")


COMMON_MEAN = "mean (in common)"


def _common_mean(table: GroupTable, paper: PaperResult, common: list[str], n_ours: int) -> None:
    """Compare means over the domains both have: ours per seed, the paper's from its per-domain numbers."""
    rows = [table.row(d) for d in common]
    mean_row = table.row("mean")
    mean_row.paper = mean_row.paper_std = None
    table.rows.append(Row(COMMON_MEAN, last=[float(np.mean(v)) for v in zip(*(r.last for r in rows))],
                          best=[float(np.mean(v)) for v in zip(*(r.best for r in rows))],
                          paper=float(np.mean([paper.acc[d] for d in common]))))
    theirs = f" ({paper.acc['mean']:.2f})" if "mean" in paper.acc else ""
    table.notes.append(f"{COMMON_MEAN} is the mean over the {len(common)} domains in common: {', '.join(common)}; "
                       f"the paper's mean{theirs} is over its {len(paper.domains)} domains and ours ('mean') over "
                       f"{n_ours}, so those two are not compared")


# ----------------------------------------------------------------------------------------- formatting

def _fmt(values: list[float]) -> str:
    mean, std = mean_std(values)
    if not math.isfinite(mean):
        return "–"
    return f"{mean:.2f}" if std is None else f"{mean:.2f} ± {std:.2f}"


def _fmt_paper(value: float | None, std: float | None) -> str:
    if value is None:
        return "–"
    return f"{value:.2f}" if std is None else f"{value:.2f} ± {std:.2f}"


def _fmt_diff(value: float | None) -> str:
    return "–" if value is None else f"{value:+.2f}"


def _rounds(rounds: list) -> str:
    unique = list(dict.fromkeys(r for r in rounds if r is not None))
    return ", ".join(str(r) for r in unique)


def _describe(table: GroupTable) -> str:
    cfg = table.config
    parts = [f"{cfg.get('data')}", f"model {cfg.get('model')}", f"{cfg.get('rounds')} rounds"]
    if table.preset:
        parts.append(f"preset {table.preset.name}")
    return ", ".join(parts)


def markdown(tables: list[GroupTable], base: Path | None = None, left_out: list[Run] = ()) -> str:
    """The report as markdown: one section per configuration, then one comparison per preset; ``left_out``:
    incomplete runs not counted, named first."""
    lines = ["# mpifl report", "",
             "Test accuracy (%; Dice (%) for segmentation runs, marked), mean ± sample std (n - 1) over the seeds "
             "of each configuration; "
             "'best val' = the best round of each run's --select-by rule (as summary.csv: mean validation "
             "accuracy, or for gPerXAN its clients' post-training local validation accuracy).", ""]
    if left_out:
        lines += ["Left out, incomplete (killed, stopped or still running; --include-incomplete counts them): "
                  + ", ".join(run.label(base) for run in left_out), ""]
    for table in tables:
        n = len(table.seeds)
        dice = " (Dice)" if table.runs[0].metric == "dice" else ""
        lines.append(f"## {table.label} — {_describe(table)}: {table.kind} model{dice}")
        lines.append("")
        what = "leave-one-domain-out: each domain's accuracy when held out, " if table.lodo else ""
        lines.append(f"{what}{len(table.runs)} run{'s' * (len(table.runs) != 1)}, {n} seed{'s' * (n != 1)} "
                     f"({', '.join(str(s) for s in table.seeds)}): "
                     + ", ".join(run.label(base) for run in table.runs))
        lines.append("")
        header = ["domain", f"last (round {_rounds(table.last_rounds)})",
                  f"best val (round {_rounds(table.best_rounds)})"]
        if table.paper:
            source = table.paper.table or table.preset.source.get("table", "").split(" (")[0]
            header += [f"paper: {table.paper.method} ({source})", f"{table.selection} − paper"]
        lines.append("| " + " | ".join(header) + " |")
        lines.append("| --- |" + " ---: |" * (len(header) - 1))
        for row in table.rows:
            name = f"{row.domain} (held out)" if table.lodo and row.domain != "mean" else row.domain
            cells = [name, _fmt(row.last), _fmt(row.best)]
            if table.paper:
                cells += [_fmt_paper(row.paper, row.paper_std), _fmt_diff(diff(row, table.selection))]
            lines.append("| " + " | ".join(cells) + " |")
        for note in table.notes:
            lines += ["", f"note: {note}"]
        lines.append("")
    lines += _comparisons(tables)
    return "\n".join(lines).rstrip() + "\n"


def _comparisons(tables: list[GroupTable]) -> list[str]:
    """Per preset, the paper's table beside ours: rows ours / paper / difference per method."""
    lines = []
    presets = {t.preset.name: t.preset for t in tables if t.preset and t.paper}
    for name, preset in presets.items():
        compared = [t for t in tables if t.preset and t.preset.name == name and t.paper]
        domains = list(dict.fromkeys(d for t in compared for d in t.paper.acc if d != "mean")) + ["mean"]
        if any(t.row(COMMON_MEAN) for t in compared):
            domains.append(COMMON_MEAN)
        when = "the best-validation round (--select-by)" if preset.selection == "best" else "the last round"
        lines += [f"## {preset.title} — ours beside the paper", "",
                  f"{preset.citation}; ours at {when}, mean over seeds; difference = ours − paper "
                  "(percentage points).", "",
                  "| method | | " + " | ".join(domains) + " |", "| --- | --- |" + " ---: |" * len(domains)]
        for table in compared:
            ours_cells, paper_cells, diff_cells = [], [], []
            for domain in domains:
                row = table.row(domain)
                value = ours(row, preset.selection) if row else float("nan")
                ours_cells.append(f"{value:.2f}" if math.isfinite(value) else "–")
                paper_value = row.paper if row and row.paper is not None else table.paper.acc.get(domain)
                paper_cells.append("–" if paper_value is None else f"{paper_value:.2f}")
                delta = diff(row, preset.selection) if row else None
                diff_cells.append(_fmt_diff(delta))
            n = len(table.seeds)
            changed = ", preset settings changed" if changed_settings(preset, table.config) else ""
            lines.append(f"| {table.paper.method} | ours: {table.label} ({n} seed{'s' * (n != 1)}{changed}) | "
                         + " | ".join(ours_cells) + " |")
            lines.append("| | paper | " + " | ".join(paper_cells) + " |")
            lines.append("| | difference | " + " | ".join(diff_cells) + " |")
        missing = [r.method for r in preset.results if not any(t.paper.method == r.method for t in compared)]
        if missing:
            lines += ["", f"not run: {', '.join(missing)}"]
        if preset.notes:
            lines += ["", "Where this setup differs from the paper's (the preset's notes):", ""]
            lines += [f"- {note}" for note in preset.notes]
        lines.append("")
    return lines


CSV_FIELDS = ["configuration", "algo", "data", "model", "preset", "kind", "domain", "held_out", "runs", "seeds",
              "last_round", "last_acc_mean", "last_acc_std", "best_acc_mean", "best_acc_std", "paper_method",
              "paper_table", "paper_acc", "paper_std", "selection", "diff"]


def csv_rows(tables: list[GroupTable]) -> list[dict]:
    """One row per configuration, model kind and domain; accuracies and differences in %."""
    out = []
    for table in tables:
        for row in table.rows:
            last, last_std = mean_std(row.last)
            best, best_std = mean_std(row.best)
            delta = diff(row, table.selection)
            out.append({
                "configuration": table.label, "algo": table.config.get("algo"), "data": table.config.get("data"),
                "model": table.config.get("model"), "preset": table.preset.name if table.preset else "",
                "kind": table.kind, "domain": row.domain, "held_out": table.lodo and row.domain != "mean",
                "runs": len(table.runs), "seeds": " ".join(str(s) for s in table.seeds),
                "last_round": _rounds(table.last_rounds), "last_acc_mean": _num(last),
                "last_acc_std": _num(last_std), "best_acc_mean": _num(best), "best_acc_std": _num(best_std),
                "paper_method": table.paper.method if table.paper else "",
                "paper_table": (table.paper.table or table.preset.source.get("table", "")) if table.paper else "",
                "paper_acc": _num(row.paper), "paper_std": _num(row.paper_std),
                "selection": table.selection if table.paper else "", "diff": _num(delta)})
    return out


def _num(value: float | None) -> str:
    return "" if value is None or not math.isfinite(value) else f"{value:.4f}"


def write_tables(tables: list[GroupTable], out: Path, base: Path | None = None,
                 left_out: list[Run] = ()) -> tuple[Path, Path]:
    """``report.md`` and ``report.csv`` in ``out``."""
    if not tables:
        raise MpiflError("no evaluated round in the given runs; a run writes metrics after its first evaluation")
    out.mkdir(parents=True, exist_ok=True)
    md, table_csv = out / "report.md", out / "report.csv"
    md.write_text(markdown(tables, base, left_out))
    with table_csv.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        writer.writeheader()
        writer.writerows(csv_rows(tables))
    return md, table_csv
