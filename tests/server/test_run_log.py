import csv
import json

import numpy as np

import pytest

from mpifl.errors import MpiflError
from mpifl.rundir.rundir import RunDir
from mpifl.server.run_log import (MetricsLog, fold_summary, local_val_acc, metric_of, read_records,
                                  summarize_eval, summary_rows)
from mpifl.transport.messages import CLIENT_META


def _raw(correct_by_client):
    """(1 kind, 2 splits, [loss, correct, count]) with count 10 and loss = 10 - correct."""
    return {c: np.array([[[10 - k, k, 10], [10 - k, k, 10]]], dtype=np.float64)
            for c, k in correct_by_client.items()}


def test_domains_pool_clients_and_mean_is_over_source_domains():
    out = summarize_eval(_raw({0: 2, 1: 4, 2: 9}), ("global",), {0: "a", 1: "a", 2: "b"}, ["a", "b"], ["a"])
    test = out["global"]["test"]
    assert test["domains"]["a"] == {"acc": 0.3, "loss": 0.7, "n": 20}
    assert test["clients"]["2"]["acc"] == 0.9
    assert test["mean"]["acc"] == 0.3  # b is held out: not in the mean


def _record(r, val_acc, test_a):
    ev = {"global": {"val": {"mean": {"acc": val_acc}},
                     "test": {"mean": {"acc": test_a}, "domains": {"a": {"acc": test_a}, "b": {"acc": 0.5}}}}}
    return {"round": r, "eval": ev}


def test_summary_picks_best_validation_round_earliest_on_ties_and_reports_held_out():
    records = [_record(1, 0.2, 0.1), _record(2, 0.6, 0.4), _record(3, 0.6, 0.9), {"round": 4}, _record(5, 0.5, 0.8)]
    rows = summary_rows(records, ("global",), ["a"], holdout="b")
    by_domain = {r["domain"]: r for r in rows}
    assert list(by_domain) == ["a", "mean", "b (held out)"]
    assert by_domain["a"]["best_round"] == 2 and by_domain["a"]["best_test_acc"] == 0.4
    assert by_domain["a"]["last_round"] == 5 and by_domain["a"]["last_test_acc"] == 0.8
    assert by_domain["b (held out)"]["best_test_acc"] == 0.5


def test_local_val_acc_weights_clients_post_training_accuracy_by_training_samples():
    meta = np.zeros(3, dtype=CLIENT_META)
    meta["num_samples"] = [10, 30, 50]
    meta["val_correct"], meta["val_seen"] = [1, 0, 0], [1, 10, 0]  # acc 1.0 and 0.0; the third has no val split
    assert local_val_acc(meta) == 0.25  # (10 * 1 + 30 * 0) / 40; weighting by val counts would give 1/11


def test_local_val_selection_takes_the_round_of_best_post_training_local_accuracy():
    records = [_record(1, 0.9, 0.1), _record(2, 0.1, 0.4), _record(3, 0.2, 0.7), _record(4, 0.3, 0.8)]
    for r, local in zip(records, (0.5, 0.8, 0.8, 0.6)):
        r["train"] = {"local_val_acc": local}
    rows = summary_rows(records, ("global",), ["a"], selection="local-val")
    assert rows[0]["best_round"] == 2 and rows[0]["best_test_acc"] == 0.4 and rows[0]["selection"] == "local-val"
    assert summary_rows(records, ("global",), ["a"])[0]["best_round"] == 1  # val-mean: the evaluated model's
    del records[0]["train"]["local_val_acc"]
    with pytest.raises(MpiflError, match="no train.local_val_acc"):
        summary_rows(records, ("global",), ["a"], selection="local-val")



def test_log_holds_a_round_until_its_evaluation_and_writes_summaries(tmp_path):
    log = MetricsLog(RunDir(tmp_path), ("global",), ["a"])
    assert log.last_mean_acc() == (None, None)
    log.add_round({"round": 1}, awaits_eval=True)
    assert not (tmp_path / "metrics.jsonl").exists()
    log.add_eval(1, _record(1, 0.5, 0.25)["eval"])
    log.add_round({"round": 2}, awaits_eval=False)
    lines = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [l["round"] for l in lines] == [1, 2] and "eval" in lines[0]
    assert log.last_mean_acc() == (1, 0.25)
    log.write_summary()
    rows = list(csv.DictReader((tmp_path / "summary.csv").open()))
    assert [r["domain"] for r in rows] == ["a", "mean"] and float(rows[0]["last_test_acc"]) == 0.25
    assert "| a | 25.00 | 25.00 |" in (tmp_path / "summary.md").read_text()


def test_fold_summary_table(tmp_path):
    for domain, (best, last) in {"a": (0.5, 0.4), "b": (0.7, 0.8)}.items():
        (tmp_path / domain).mkdir()
        with (tmp_path / domain / "summary.csv").open("w", newline="") as f:
            writer = csv.DictWriter(f, ["model", "domain", "last_test_acc", "best_test_acc"])
            writer.writeheader()
            writer.writerow({"model": "global", "domain": "mean", "last_test_acc": 0, "best_test_acc": 0})
            writer.writerow({"model": "global", "domain": f"{domain} (held out)", "last_test_acc": last,
                             "best_test_acc": best})
    table = fold_summary({"a": tmp_path / "a", "b": tmp_path / "b"})
    assert "| best source val | 50.00 | 70.00 | 60.00 |" in table
    assert "| last round | 40.00 | 80.00 | 60.00 |" in table


def test_a_run_directory_removed_and_made_again_under_the_run_stops_it_before_its_records_mix(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    log = MetricsLog(RunDir(run), ("global",), ["a"])
    log.add_round({"round": 1}, awaits_eval=False)
    for path in run.iterdir():
        path.unlink()
    run.rmdir()
    run.mkdir()  # another run's directory now (a new inode: the log holds the old one open)
    (run / "metrics.jsonl").write_text('{"round": 7}\n')
    with pytest.raises(MpiflError, match=rf"^the run directory {run} was removed or replaced while this run was "
                                         "writing it; the run stops"):
        log.add_round({"round": 2}, awaits_eval=False)
    with pytest.raises(MpiflError, match="removed or replaced"):
        log.write_summary()
    assert (run / "metrics.jsonl").read_text() == '{"round": 7}\n' and not (run / "summary.md").exists()


def test_a_segmentation_run_reports_dice_under_its_own_key():
    out = summarize_eval(_raw({0: 2, 1: 4}), ("global",), {0: "a", 1: "b"}, ["a", "b"], ["a", "b"], metric="dice")
    test = out["global"]["test"]
    assert test["domains"]["a"] == {"dice": 0.2, "loss": 0.8, "n": 10} and test["mean"]["dice"] == pytest.approx(0.3)
    records = [{"round": 1, "train": {"loss": 1.0, "dice": 0.5}, "eval": out}]
    rows = summary_rows(records, ("global",), ["a", "b"], metric="dice")
    assert rows[2]["domain"] == "mean" and rows[2]["last_test_dice"] == pytest.approx(0.3)
    assert "last_test_acc" not in rows[0] and metric_of(records) == "dice" and metric_of([{"train": {}}]) == "acc"


def test_records_leave_out_a_last_line_cut_off_and_refuse_a_changed_one(tmp_path):
    path = tmp_path / "metrics.jsonl"
    assert read_records(path) == []  # none yet
    good = "".join(json.dumps({"round": r, "train": {"loss": 1.0}}) + "\n" for r in (1, 2))
    path.write_text(good + '{"round": 3, "tra')  # killed while writing round 3's
    assert [r["round"] for r in read_records(path)] == [1, 2]
    path.write_text(good + '{"round": 3}')  # complete but for its line break: still a record
    assert [r["round"] for r in read_records(path)] == [1, 2, 3]
    for changed, number in ((good + "[1, 2]\n", 3), ('{"round": 1}\nxx\n{"round": 3}\n', 2), ('{"no": 1}\n', 1)):
        path.write_text(changed)
        with pytest.raises(MpiflError, match=f"^{path}, line {number}, is no round record .*restore it from a copy$"):
            read_records(path)
