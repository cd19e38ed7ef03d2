"""The run's records on rank 0: ``metrics.jsonl`` per round, ``summary.csv`` and ``summary.md`` (their rows; the
run directory, :class:`mpifl.rundir.rundir.RunDir`, writes them).

One JSON line per round::

    {"round": 3, "clients": [0, 2, 4],
     "train": {"loss": .., "acc": .., "local_val_acc": ..},   # "dice" in place of "acc" for segmentation
     "bytes": {"down": .., "up": .., "wire_down": .., "wire_up": ..},
     "seconds": {"round": .., "compute": .., "data": .., "evaluation": .., "communication": .., "waiting": ..,
                 "waiting_cpu": .., "aggregation": ..},
     "rank_seconds": {"compute": [..], "data": [..], "evaluation": [..], "communication": [..], "waiting": [..]},
     "memory": {"peak_rss": [..], "peak_gpu": [..]},
     "dp_sgd": {"epsilon_max": .., "epsilon_mean": ..},   # with --dpsgd-clip only
     "eval": {"global": {"test": {"mean": {"acc", "loss"}, "domains": {d: {"acc", "loss", "n"}},
                                  "clients": {"0": {"acc", "loss", "n"}}}, "val": {..}}}}

``seconds`` is where rank 0's round went: ``round`` is its wall clock from
broadcast to aggregated; ``communication`` its time while bytes moved (the
two collectives, and the clients' uploads once their senders send them);
``waiting`` its time waiting for other ranks (clients still training; and
``waiting_cpu``, the CPU it spent polling meanwhile); ``aggregation`` the
server rule (folding the uploads and the rest); ``compute``, ``data`` and
``evaluation`` the slowest client rank's training (without its time posting
uploads), producing batches within it, and evaluation.  ``rank_seconds``
gives each client rank's (rank 1 first) of those, and its own time in the
transport from the broadcast to the gather: ``communication`` (the
broadcast and its uploads moving) and ``waiting`` (for rank 0 to send the
broadcast or take its uploads).  The evaluation done in round r+1's message
scores round r's model (see server.py).

``dp_sgd`` (only under ``--dpsgd-clip``, :mod:`mpifl.privacy.dp_sgd`) is the largest and the mean epsilon, over
the round's clients, of each client's record-level guarantee over its records so far, each at its own delta
(:func:`dp_sgd_epsilons`); ``summary.md`` ends with the largest any client reached.

``train.local_val_acc`` (only under ``--select-by local-val``) is the
validation accuracy of the round's post-training local models, weighted by
the clients' training samples (:func:`local_val_acc`).  ``eval`` appears on
evaluation rounds.  Accuracies are fractions in [0, 1];
a domain pools its clients' counts; ``mean`` is the unweighted mean over
domains, as the papers' tables report.  ``bytes.down``/``up`` count the
method's tensors per participating client (the ``--show-manifest`` figure
times the clients of the round); ``wire_*`` count every byte MPI moved,
headers, metrics and the broadcast to every client rank included.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Callable

import numpy as np

from ..errors import MpiflError
from ..rundir.names import METRICS, SUMMARY_CSV
from ..rundir.rundir import RunDir
from ..transport.messages import EVAL_SPLITS


def local_val_acc(meta: np.ndarray) -> float:
    """``sum_i n_i acc_i / sum_i n_i`` over the round's clients with a val split, ``acc_i`` the validation
    accuracy of client i's model right after local training, ``n_i`` its training samples (gPerXAN's code
    weights the clients' reported accuracies by the sample counts they train on)."""
    has = meta["val_seen"] > 0
    if not has.any():
        return float("nan")
    weights = meta["num_samples"][has]
    return float(np.sum(weights * meta["val_correct"][has] / meta["val_seen"][has]) / weights.sum())


def dp_sgd_epsilons(meta: np.ndarray) -> dict:
    """The largest and the mean DP-SGD epsilon of a round's clients (``meta``: their CLIENT_META records)."""
    return {"epsilon_max": float(meta["dp_epsilon"].max()), "epsilon_mean": float(meta["dp_epsilon"].mean())}


def dp_sgd_line(records: list[dict]) -> str:
    """summary.md's line on DP-SGD ("" without it): the largest epsilon any client reached (each client's grows
    with its steps, so the largest of the rounds' largest), and the last round's mean."""
    rounds = [r for r in records if "dp_sgd" in r]
    if not rounds:
        return ""
    top = max(rounds, key=lambda r: r["dp_sgd"]["epsilon_max"])
    return (f"Record-level DP-SGD: largest client epsilon {top['dp_sgd']['epsilon_max']:.4g} (round {top['round']}); "
            f"mean over round {rounds[-1]['round']}'s clients {rounds[-1]['dp_sgd']['epsilon_mean']:.4g}; each at "
            "its own delta over its own records\n")


def summarize_eval(raw: dict[int, np.ndarray], kinds: tuple[str, ...], domain_of: dict[int, str],
                   domains: list[str], source_domains: list[str], metric: str = "acc") -> dict:
    """Per-client, per-domain and mean score/loss from (kind, split, [loss, score sum, count]) arrays; the score
    under ``metric`` (the task's, :mod:`mpifl.plan.task`: ``acc``, or ``dice`` for segmentation).

    ``mean`` averages the source (training) domains; a held-out domain is
    reported under ``domains`` but not in the mean.
    """
    out = {}
    for k, kind in enumerate(kinds):
        out[kind] = {}
        for s, split in enumerate(EVAL_SPLITS):
            clients = {str(c): _score(raw[c][k, s], metric) for c in sorted(raw)}
            pooled = {d: _score(sum(raw[c][k, s] for c in raw if domain_of[c] == d), metric) for d in domains}
            pooled = {d: v for d, v in pooled.items() if v["n"] > 0}
            sources = [v for d, v in pooled.items() if d in source_domains]
            mean = {m: float(np.mean([v[m] for v in sources])) if sources else float("nan") for m in (metric, "loss")}
            out[kind][split] = {"mean": mean, "domains": pooled, "clients": clients}
    return out


def _score(total, metric: str = "acc") -> dict:
    loss, correct, count = (float(x) for x in np.broadcast_to(total, (3,)))
    n = int(count)
    return {metric: correct / n if n else float("nan"), "loss": loss / n if n else float("nan"), "n": n}


def metric_of(records: list[dict]) -> str:
    """The score key of a run's records: ``dice`` for a segmentation run, else ``acc``."""
    for record in records:
        if "dice" in record.get("train", {}):
            return "dice"
    return "acc"


class MetricsLog:
    """Appends round records in order and writes the summaries at the end, into ``run_dir``; ``on_record`` is
    handed each record written (a resumed run's kept records too), e.g. the live trackers' (``--track``)."""

    def __init__(self, run_dir: RunDir, kinds: tuple[str, ...], domains: list[str], holdout: str | None = None,
                 selection: str = "val-mean", metric: str = "acc", on_record: Callable[[dict], None] | None = None):
        self.run_dir = run_dir
        self.on_record = on_record or (lambda record: None)
        self.kinds = kinds
        self.domains = domains  # source domains
        self.holdout = holdout
        self.selection = selection  # the best-round rule (summary_rows)
        self.metric = metric  # the task's score key
        self.records: list[dict] = []
        self._pending: dict | None = None  # a round waiting for its evaluation

    @property
    def pending(self) -> dict | None:
        """The last round's record while it waits for its evaluation."""
        return self._pending

    def resume(self, round_index: int, pending: dict | None, evaluated: bool) -> None:
        """Continue a run checkpointed after ``round_index``: keep its records up to there (dropping any
        written after the checkpoint), and wait again for the evaluation of ``pending`` if the continued
        run evaluates that round (``evaluated``; a run extended past its last round may not)."""
        last = round_index - 1 if pending else round_index
        self.run_dir.check()  # before reading: what is at the path may be another run's
        self.records = [r for r in read_records(self.run_dir.path / METRICS) if r["round"] <= last]
        self.run_dir.rewrite_records(self.records)
        for record in self.records:
            self.on_record(record)
        if pending:
            pending.pop("eval", None)
            self.add_round(pending, awaits_eval=evaluated)

    def add_round(self, record: dict, awaits_eval: bool) -> None:
        if awaits_eval:
            self._pending = record
        else:
            self._write(record)

    def add_eval(self, round_index: int, results: dict) -> None:
        record, self._pending = self._pending, None
        if record is None or record["round"] != round_index:
            raise RuntimeError(f"evaluation of round {round_index} arrived with no such pending round")
        record["eval"] = results
        self._write(record)

    def _write(self, record: dict) -> None:
        self.run_dir.append_record(record)
        self.records.append(record)
        self.on_record(record)

    def last_mean_acc(self) -> tuple[int | None, float | None]:
        """(round, mean test accuracy) of the newest evaluated round; (None, None) before the first."""
        for record in reversed(self.records):
            if "eval" in record:
                return record["round"], record["eval"][self.kinds[0]]["test"]["mean"][self.metric]
        return None, None

    def write_summary(self) -> str:
        """``summary.csv`` and ``summary.md``; the latter's text."""
        self.run_dir.check()  # first: a run whose directory is gone stops with that line, whatever its records
        rows = summary_rows(self.records, self.kinds, self.domains, self.holdout, self.selection, self.metric)
        markdown = summary_markdown(rows) + privacy_line(self.records) + dp_sgd_line(self.records)
        self.run_dir.write_summaries(rows, markdown)
        return markdown


def read_records(path: Path) -> list[dict]:
    """The records of a ``metrics.jsonl`` (none when it is missing).  A last line cut off (no line break, not
    JSON: the run was killed while writing it, after its last checkpoint) is left out; any other line that is not
    a record is refused, naming it."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    except (OSError, UnicodeDecodeError) as exc:
        raise MpiflError(f"cannot read {path} ({exc}); restore it from a copy") from None
    lines = text.split("\n")
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if not (isinstance(record, dict) and isinstance(record.get("round"), int)):
            if number == len(lines):  # no line break after it: cut off while written
                break
            raise MpiflError(f"{path}, line {number}, is no round record ({line[:40]!r}): the file was changed "
                             "after the run wrote it; restore it from a copy")
        records.append(record)
    return records


def summary_rows(records: list[dict], kinds: tuple[str, ...], domains: list[str],
                 holdout: str | None = None, selection: str = "val-mean", metric: str = "acc") -> list[dict]:
    """Test score (``metric``: accuracy, or Dice) per source domain, their mean, and the held-out domain if any,
    at the last round and at the best-validation round (column ``selection``: the rule); columns
    ``last_test_<metric>`` and ``best_test_<metric>``.

    The best round, among the evaluated ones and the earliest on ties, maximises
    under ``val-mean`` the mean validation accuracy of that model kind over the
    source domains; under ``local-val`` the round's ``train.local_val_acc``
    (the clients' post-training local models, gPerXAN's code), one round for
    every model kind.
    """
    evaluated = [r for r in records if "eval" in r]
    if selection == "local-val" and any("local_val_acc" not in r["train"] for r in evaluated):
        raise MpiflError("these metrics have no train.local_val_acc for the best round under --select-by local-val; "
                         "run again with --select-by local-val, or use val-mean")
    rows = []
    for kind in kinds:
        last = evaluated[-1]
        if selection == "local-val":
            best = max(evaluated, key=lambda r: (r["train"]["local_val_acc"], -r["round"]))
        else:
            best = max(evaluated, key=lambda r: (r["eval"][kind]["val"]["mean"][metric], -r["round"]))
        targets = [holdout] if holdout and holdout in last["eval"][kind]["test"]["domains"] else []
        for domain in domains + ["mean"] + targets:
            def score(record):
                test = record["eval"][kind]["test"]
                return test["mean"][metric] if domain == "mean" else test["domains"][domain][metric]
            rows.append({"model": kind, "domain": domain + (" (held out)" if domain in targets else ""),
                         "last_round": last["round"], f"last_test_{metric}": score(last),
                         "best_round": best["round"], f"best_test_{metric}": score(best), "selection": selection})
    return rows


def summary_markdown(rows: list[dict]) -> str:
    metric = "dice" if "last_test_dice" in rows[0] else "acc"
    lines = []
    for kind in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == kind]
        lines += [f"### {kind} model: test {'Dice' if metric == 'dice' else 'accuracy'} (%)", "",
                  f"| domain | last (round {mine[0]['last_round']}) | best val (round {mine[0]['best_round']}, "
                  f"{mine[0]['selection']}) |",
                  "| --- | ---: | ---: |"]
        lines += [f"| {r['domain']} | {100 * r[f'last_test_{metric}']:.2f} | {100 * r[f'best_test_{metric}']:.2f} |"
                  for r in mine]
        lines.append("")
    return "\n".join(lines)


def privacy_line(records: list[dict]) -> str:
    """summary.md's statement of the run's guarantee, from its last record ("" without one)."""
    spent = records[-1].get("privacy") if records else None
    if not spent:
        return ""
    return (f"privacy: client-level DP ({spent['mode']}), epsilon {spent['epsilon']:.4g} at delta {spent['delta']:.3g} "
            f"after round {records[-1]['round']} (Opacus RDP accountant; noise multiplier "
            f"{spent['noise_multiplier']:.4g}, clip {spent['clip']:.4g}); docs/privacy.md states the threat model\n")


def fold_summary(fold_dirs: dict[str, Path]) -> str:
    """Leave-one-domain-out table: each held-out domain's test accuracy and their mean.

    Per fold, the global model at the round of best mean source validation
    accuracy, and at the last round (the papers' per-target-domain columns).
    """
    best, last = {}, {}
    for domain, run_dir in fold_dirs.items():
        with (run_dir / SUMMARY_CSV).open() as f:
            row = next(r for r in csv.DictReader(f) if r["model"] == "global" and r["domain"].endswith("(held out)"))
        metric = "dice" if "best_test_dice" in row else "acc"
        best[domain], last[domain] = float(row[f"best_test_{metric}"]), float(row[f"last_test_{metric}"])
    name = "Dice" if metric == "dice" else "accuracy"
    lines = [f"### leave-one-domain-out: held-out domain test {name} (%), global model", "",
             "| | " + " | ".join(fold_dirs) + " | mean |", "| --- |" + " ---: |" * (len(fold_dirs) + 1)]
    for name, values in (("best source val", best), ("last round", last)):
        lines.append(f"| {name} | " + " | ".join(f"{100 * v:.2f}" for v in values.values())
                     + f" | {100 * float(np.mean(list(values.values()))):.2f} |")
    return "\n".join(lines) + "\n"
