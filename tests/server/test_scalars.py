"""One naming of a record's scalars for the live trackers and the report's TensorBoard scalars."""

import pytest

from mpifl.server.scalars import scalars


def test_a_records_scalars_are_its_numbers_scores_in_percent():
    record = {"round": 3, "clients": [0, 2], "train": {"loss": 0.5, "acc": 0.25, "local_val_acc": 0.75},
              "bytes": {"down": 10, "up": 20}, "seconds": {"round": 1.5}, "rank_seconds": {"compute": [1.0]},
              "memory": {"peak_rss": [1, 2]},
              "eval": {"global": {"test": {"mean": {"acc": 0.5, "loss": 2.0},
                                           "domains": {"mono": {"acc": 0.4, "loss": 2.5, "n": 10}},
                                           "clients": {"0": {"acc": 0.4, "loss": 2.5, "n": 10}}},
                                  "val": {"mean": {"acc": 0.6, "loss": 1.0}, "domains": {}, "clients": {}}}}}
    assert scalars(record, "acc") == pytest.approx({
        "train/loss": 0.5, "train/acc": 25.0, "train/local_val_acc": 75.0, "bytes/down": 10, "bytes/up": 20,
        "seconds/round": 1.5, "global/test_acc/mean": 50.0, "global/test_loss/mean": 2.0,
        "global/test_acc/mono": 40.0, "global/test_loss/mono": 2.5, "global/val_acc/mean": 60.0})
