"""A client rank posts each trained client's summed upload as soon as it is trained and keeps at most
``SEND_WINDOW_BYTES`` of them (at least one client's) until rank 0 has them: rank 0 folds them while the rank
trains the next, to the same numbers as folding after the gather."""

from __future__ import annotations

import pytest

from mpifl.algorithms import ALGORITHMS
from mpifl.client import host
from mpifl.client.host import ClientHost

from ..conftest import read_metrics, run_here, untimed

pytestmark = pytest.mark.slow


def test_uploads_leave_one_client_at_a_time_and_fold_to_the_numbers_of_folding_after_the_gather(
        data_root, tmp_path, monkeypatch):
    held = []  # the bytes of summed uploads the client rank keeps, each round

    def recording(init):
        def __init__(self, *args, **kwargs):
            init(self, *args, **kwargs)
            get = self.summed_buffer.get
            self.summed_buffer.get = lambda nbytes: held.append(nbytes) or get(nbytes)
        return __init__

    monkeypatch.setattr(ClientHost, "__init__", recording(ClientHost.__init__))
    monkeypatch.setattr(host, "SEND_WINDOW_BYTES", 1)  # one client's upload at a time
    args = ["--data-root", str(data_root), "--model", "smallcnn", "--rounds", "2", "--clients-per-domain", "2",
            "--fraction", "0.5", "--seed", "3", "--threads", "1"]
    job = run_here(*args, "--out", str(tmp_path / "during"))
    assert job.returncode == 0, job.stderr
    monkeypatch.setattr(ALGORITHMS["fedavg"], "reductions_need_results", True)
    job = run_here(*args, "--out", str(tmp_path / "after"))
    assert job.returncode == 0, job.stderr
    size = held[0]
    # 5 clients a round, all on the one client rank; the message after the last round only evaluates
    assert size > 0 and held == [size, size, 0, 5 * size, 5 * size, 0]
    during, after = (untimed(read_metrics(run)) for run in (tmp_path / "during", tmp_path / "after"))
    assert during == after and len(during) == 2
