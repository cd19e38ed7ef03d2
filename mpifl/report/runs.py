"""Run directories as data: find them, read ``config.json`` and ``metrics.jsonl``, group them by configuration.

Runs that differ only in options that name no result (the seed, and how they ran: devices, threads, output
directory, checkpoints ...: the run options declared with ``names_result=False``) are one *configuration*; the
report averages their numbers.  Leave-one-domain-out folds (``--holdout all`` writes ``<out>/holdout-<domain>/``)
that share everything else are one configuration too: each fold contributes the accuracy of its held-out domain.

A run is *complete* when its last record is the evaluated final round of its configuration (``rounds``
of its ``config.json``, which a resumed run updates); one killed, stopped or still running is not, and the
report leaves it out of the means over seeds unless asked to include it (:attr:`Run.complete`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from mpifl.errors import MpiflError
from mpifl.plan.config import CORE_TYPES, RUN_OPTIONS, Option, coerce
from mpifl.rundir.names import CONFIG, METRICS
from mpifl.algorithms import get_algorithm
from mpifl.server.run_log import metric_of, read_records, summary_rows


def ignored_keys(options: tuple[Option, ...]) -> tuple[str, ...]:
    """The config keys of the options that name no result: ignored when grouping runs into configurations."""
    return tuple(o.name for o in options if not o.names_result)


IGNORED_KEYS = ignored_keys(RUN_OPTIONS)


@dataclass
class Run:
    """One run directory: its flat configuration and its per-round records."""

    path: Path
    config: dict
    records: list[dict]

    @property
    def seed(self) -> int:
        return int(self.config.get("seed", 0))

    @property
    def holdout(self) -> str | None:
        return self.config.get("holdout")

    @property
    def last_round(self) -> int:
        return self.records[-1]["round"] if self.records else 0

    @property
    def rounds(self) -> int:
        return int(self.config.get("rounds", 0))

    @property
    def complete(self) -> bool:
        """Whether the run reached its last round and evaluated it (not killed, stopped or still running)."""
        return bool(self.records) and self.last_round == self.rounds and "eval" in self.records[-1]

    def progress(self) -> str:
        """'' for a complete run, else e.g. 'incomplete: round 3 of 10'."""
        return "" if self.complete else f"incomplete: round {self.last_round} of {self.rounds}"

    @cached_property
    def evaluated(self) -> list[dict]:
        return [r for r in self.records if "eval" in r]

    @property
    def kinds(self) -> tuple[str, ...]:
        """The model kinds the run evaluated ("global", "personal"), in the run's order."""
        return tuple(self.evaluated[0]["eval"]) if self.evaluated else ()

    @property
    def domains(self) -> list[str]:
        """Every domain with test scores, in manifest order (a held-out domain included)."""
        seen: dict[str, None] = {}
        for kind in self.kinds:
            seen.update(dict.fromkeys(self.evaluated[0]["eval"][kind]["test"]["domains"]))
        return list(seen)

    @cached_property
    def metric(self) -> str:
        """The run's score: ``acc``, or ``dice`` for a segmentation run (:func:`mpifl.server.run_log.metric_of`)."""
        return metric_of(self.records)

    @property
    def selection(self) -> str:
        """The best-round rule the run used (a run from before ``--select-by``: ``val-mean``)."""
        return get_algorithm(self.config["algo"]).selection_for(self.config.get("select_by", "val-mean"))

    @property
    def source_domains(self) -> list[str]:
        return [d for d in self.domains if d != self.holdout]

    @cached_property
    def scores(self) -> dict[str, dict[str, dict]]:
        """``scores[kind][domain]`` = {last, best (fractions), last_round, best_round}: test score (accuracy or
        Dice, :attr:`metric`) at the
        last evaluation and at the round of best mean validation accuracy (:func:`mpifl.server.run_log.summary_rows`,
        the rule of ``summary.csv``); ``domain`` ``mean`` is the mean over source domains."""
        out: dict[str, dict[str, dict]] = {}
        metric = self.metric
        for row in summary_rows(self.records, self.kinds, self.source_domains, self.holdout,
                                self.selection, metric):
            domain = row["domain"].removesuffix(" (held out)")
            out.setdefault(row["model"], {})[domain] = {
                "last": row[f"last_test_{metric}"], "best": row[f"best_test_{metric}"],
                "last_round": row["last_round"], "best_round": row["best_round"]}
        return out

    def relative(self, base: Path | None = None) -> str:
        """The run's directory, relative to ``base`` when inside it."""
        if base is not None:
            try:
                return str(self.path.relative_to(base))
            except ValueError:
                pass
        return str(self.path)

    def label(self, base: Path | None = None) -> str:
        """:meth:`relative`, and whether the run is incomplete."""
        return self.relative(base) + (f" ({self.progress()})" if self.progress() else "")


def load_run(path: str | Path) -> Run:
    path = Path(path)
    metrics, config = path / METRICS, path / CONFIG
    if not metrics.is_file() or not config.is_file():
        raise MpiflError(f"{path} is no run directory (it needs config.json and metrics.jsonl); pass the --out "
                         "directory of a run")
    records = read_records(metrics)  # a last line cut off by a killed run is left out
    fix = "restore it from a copy or leave the run out"
    try:
        cfg = json.loads(config.read_text())
    except ValueError as exc:
        raise MpiflError(f"{config} is unreadable ({exc}); {fix}") from None
    if not isinstance(cfg, dict):
        raise MpiflError(f"{config} holds no mapping of options; {fix}")
    try:  # the options every run has, as a run reads them back: a value of the wrong kind is named, once
        cfg.update({k: coerce(k, v, CORE_TYPES[k]) for k, v in cfg.items() if k in CORE_TYPES and v is not None})
    except MpiflError as exc:
        raise MpiflError(f"{config}: {exc}; {fix}") from None
    # an option newer than the run takes its default, which is how the run ran: its configuration groups with today's
    return Run(path=path, config={**{o.name: o.default for o in RUN_OPTIONS}, **cfg}, records=records)


def find_runs(paths: list[str | Path]) -> list[Run]:
    """The runs under ``paths``: a run directory itself and every run directory below it (e.g. the
    ``holdout-<domain>`` folds of ``--holdout all``, or a folder of runs), in path order."""
    runs, seen = [], set()
    for given in paths:
        path = Path(given)
        if not path.exists():
            raise MpiflError(f"{path} does not exist; pass run directories (the --out of mpifl.run)")
        found = sorted(p.parent for p in path.rglob(METRICS) if (p.parent / CONFIG).is_file())
        if not found:
            raise MpiflError(f"no run under {path} (no config.json + metrics.jsonl in it or below)")
        for run_dir in found:
            if run_dir.resolve() not in seen:
                seen.add(run_dir.resolve())
                runs.append(load_run(run_dir))
    return runs


def group_key(config: dict, ignored: tuple[str, ...] = IGNORED_KEYS) -> str:
    """What makes runs one configuration: the config minus the ``ignored`` keys (and the held-out domain: the
    folds of one leave-one-domain-out experiment are one configuration)."""
    kept = {k: v for k, v in config.items() if k not in ignored and k != "holdout"}
    kept["leave_one_domain_out"] = config.get("holdout") is not None
    return json.dumps(kept, sort_keys=True, default=str)


def group_runs(runs: list[Run]) -> list[list[Run]]:
    """Runs grouped by :func:`group_key`, groups and members in the order first seen."""
    groups: dict[str, list[Run]] = {}
    for run in runs:
        groups.setdefault(group_key(run.config), []).append(run)
    return list(groups.values())
