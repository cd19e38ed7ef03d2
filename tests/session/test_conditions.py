"""Simulated client conditions in whole runs (docs/clients.md): an ideal profile changes nothing, a lost upload never
reaches the sums while its client trains, a late client trains exactly the steps that fit (FedBuff's K updates a
step: ``test_conditions_ranks.py``); bad conditions are refused in one line, printed once."""

from __future__ import annotations

import pytest
import torch

from mpifl.algorithms.core.deltas import local_steps
from mpifl.client import host as host_module
from mpifl.server import server as server_module

from ..conftest import launch, read_metrics, run_here, untimed

pytestmark = pytest.mark.slow


def _args(data_root, out, *extra):
    return ["--data-root", str(data_root), "--model", "smallcnn", "--out", str(out), "--threads", "1",
            "--clients-per-domain", "2", "--samples-per-client", "40", "--batch-size", "16", "--lr", "0.05",
            "--rounds", "3", "--fraction", "0.5", "--ckpt-every", "3", *extra]


def test_an_always_online_equal_speed_profile_waiting_for_all_gives_todays_numbers_bit_for_bit(data_root, tmp_path):
    today = run_here(*_args(data_root, tmp_path / "today", "--algo", "scaffold"))
    ideal = run_here(*_args(data_root, tmp_path / "ideal", "--algo", "scaffold", "--client-speed", "50",
                            "--client-bandwidth", "10", "--availability", "1"))
    assert today.returncode == 0 == ideal.returncode, ideal.stderr
    clocked = untimed(read_metrics(tmp_path / "ideal"))
    assert all(r["sim"]["time"] > 0 for r in clocked)
    assert [{k: v for k, v in r.items() if k != "sim"} for r in clocked] == untimed(read_metrics(tmp_path / "today"))
    states = [torch.load(tmp_path / run / "checkpoint" / "round-3" / "server.pt", weights_only=True)
              for run in ("today", "ideal")]
    assert all(torch.equal(states[0]["model"][k], states[1]["model"][k]) for k in states[0]["model"])
    assert all(torch.equal(states[0]["extra"][k], states[1]["extra"][k]) for k in states[0]["extra"])


def _watch(monkeypatch):
    """What the run's hosts train (client, round, step cap) and which clients' uploads rank 0 folds, per round."""
    trained, folded = [], []
    train = host_module.ClientHost._train

    def _train(self, client, download, round_index, max_steps):
        trained.append((client.id, round_index, max_steps))
        return train(self, client, download, round_index, max_steps)

    class Counting(server_module.Folding):
        def add(self, window):
            folded[-1] += len(window)
            super().add(window)

    def counting(*args):
        folded.append(0)
        return Counting(*args)

    monkeypatch.setattr(host_module.ClientHost, "_train", _train)
    monkeypatch.setattr(server_module, "Folding", counting)
    return trained, folded


def test_a_lost_upload_never_reaches_the_sums_and_its_client_still_trains(data_root, tmp_path, monkeypatch):
    trained, folded = _watch(monkeypatch)
    job = run_here(*_args(data_root, tmp_path / "r", "--algo", "fedavg", "--drop-after", "0.4", "--drop-before",
                          "0.2", "--rounds", "4"))
    assert job.returncode == 0, job.stderr
    records = read_metrics(tmp_path / "r")
    assert sum(len(r["sim"].get("lost", ())) for r in records) >= 2
    for r in records:
        lost, before = set(r["sim"].get("lost", ())), set(r["sim"].get("dropped_before", ()))
        here = {c for c, k, _ in trained if k == r["round"]}
        assert here == set(r["clients"]) | lost and not here & before  # the lost trained; the dropped did not
        assert sorted(here) == r["sim"].get("trained", r["clients"])
        assert not lost & set(r["clients"])
    assert folded == [len(r["clients"]) for r in records]  # rank 0 folded the arrivals, and only those


def test_a_late_client_trains_exactly_the_steps_that_fit_and_fednova_normalizes_by_them(data_root, tmp_path,
                                                                                        monkeypatch):
    trained, _ = _watch(monkeypatch)
    steps = []
    from mpifl.algorithms.fednova import FedNova
    prepare = FedNova.prepare
    monkeypatch.setattr(FedNova, "prepare", lambda self, server, uploads: steps.append(
        dict(zip(uploads.clients.tolist(), uploads.num_steps.tolist()))) or prepare(self, server, uploads))
    job = run_here(*_args(data_root, tmp_path / "r", "--algo", "fednova", "--client-speed", "lognormal:20,1",
                          "--client-bandwidth", "100", "--deadline", "2", "--late", "partial", "--local-epochs", "2"))
    assert job.returncode == 0, job.stderr
    full = local_steps(40, 16, 2)
    cut = 0
    for record, taken in zip(read_metrics(tmp_path / "r"), steps):
        caps = {int(c): s for c, s in record["sim"].get("cut", {}).items()}
        assert taken == {c: float(caps.get(c, full)) for c in record["clients"]}
        assert {c: s for c, k, s in trained if k == record["round"] and s is not None} == caps
        assert all(0 < s < full for s in caps.values())
        cut += len(caps)
    assert cut >= 2


def _one_line(job, pattern):
    lines = [line for line in (job.stdout + job.stderr).splitlines() if line.startswith("mpifl: error")]
    assert len(lines) == 1 and pattern in lines[0], job.stderr
    assert "Traceback" not in job.stderr


@pytest.mark.parametrize("extra, pattern", [
    (("--client-speed", "lognormal:50,-1"), "--client-speed: sigma -1 must be a finite number at least 0"),
    (("--availability", "quickdraw=0.5"), "'quickdraw=0.5' names no domain of this run"),
    (("--deadline", "nan"), "--deadline must be a finite number, got nan"),
    (("--drop-after", "1"), "--drop-after must be in [0, 1), got 1.0"),
    (("--over-select", "0.5"), "--over-select must be >= 1, got 0.5"),
    (("--late", "partial"), "--late partial acts only with --deadline"),
    (("--algo", "fedbuff", "--deadline", "5"), "--deadline: fedbuff aggregates asynchronously"),
    (("--algo", "fedbuff", "--buffer-size", "9"), "FedBuff needs buffer size <= concurrency"),
    (("--dp-clip", "1", "--dp-noise", "1", "--availability", "0.5"), "--dp-clip: --availability lets sampled"),
])
def test_bad_conditions_fail_once_on_three_ranks(data_root, tmp_path, extra, pattern):
    job = launch(3, *_args(data_root, tmp_path / "r", *extra), timeout=60)
    assert job.returncode == 2
    _one_line(job, pattern)
    assert not (tmp_path / "r").exists() or not any((tmp_path / "r").iterdir())


def test_a_trace_with_a_bad_row_is_refused_naming_the_row(data_root, tmp_path):
    trace = tmp_path / "trace.csv"
    trace.write_text("client,speed,down,up,active\n0,50,,,\n1,nan,,,\n")
    job = launch(3, *_args(data_root, tmp_path / "r", "--client-trace", str(trace)), timeout=60)
    assert job.returncode == 2
    _one_line(job, "trace.csv line 3")
