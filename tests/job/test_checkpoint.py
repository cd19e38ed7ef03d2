"""Checkpoint and resume: a resumed run repeats the uninterrupted one bit for bit."""

from __future__ import annotations

import json

import pytest
import torch

from mpifl.algorithms import ServerState, get_algorithm
from mpifl.job.checkpoint import Checkpoint, commit, identity, load, load_clients, save_clients, save_server
from mpifl.plan.config import RunConfig, resolve
from mpifl.errors import MpiflError

from ..conftest import launch, read_metrics, run_in_process

ALGO = "fedbn"  # private BN layers: the client ranks' state must survive the restart too


def _args(data_root, out, *extra):
    return ["--data-root", str(data_root), "--model", "smallcnn", "--algo", ALGO, "--threads", "1",
            "--fraction", "0.6", "--eval-every", "2", "--out", str(out), *extra]


def numbers(run_dir) -> list[dict]:
    """metrics.jsonl without what may differ between identical computations: timings and MPI framing bytes."""
    out = []
    for record in read_metrics(run_dir):
        record.pop("seconds")
        record["bytes"] = {k: record["bytes"][k] for k in ("down", "up")}
        out.append(record)
    return out


@pytest.fixture(scope="module")
def uninterrupted(data_root, tmp_path_factory):
    run = tmp_path_factory.mktemp("full") / "run"
    job = launch(3, *_args(data_root, run, "--rounds", "6"))
    assert job.returncode == 0, job.stderr
    return numbers(run)


def test_three_rounds_then_resume_on_another_rank_count_equals_six_rounds(data_root, tmp_path, uninterrupted):
    run = tmp_path / "run"
    first = launch(3, *_args(data_root, run, "--rounds", "3", "--ckpt-every", "3"))
    assert first.returncode == 0, first.stderr
    assert json.loads((run / "checkpoint" / "meta.json").read_text())["round"] == 3
    resumed = launch(4, "--resume", str(run), "--rounds", "6")
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming after round 3" in resumed.stdout and "were on 2 client ranks, now placed on 3" in resumed.stdout
    assert numbers(run) == uninterrupted
    assert json.loads((run / "config.json").read_text())["rounds"] == 6


@pytest.mark.parametrize("stop_in_process", [False, True])
def test_a_stop_signal_checkpoints_and_the_resumed_run_finishes_identically(data_root, tmp_path, uninterrupted,
                                                                            stop_in_process):
    """Stopped over MPI and resumed in one process, or the other way round: the same numbers."""
    run = tmp_path / "run"
    args, env = _args(data_root, run, "--rounds", "6"), {"MPIFL_FAULT": "stop:rank=0,round=3"}
    stopped = run_in_process(*args, env=env) if stop_in_process else launch(3, *args, env=env)
    assert stopped.returncode == 75, stopped.stderr
    assert stopped.lines("mpifl: stopped by SIGTERM after round 3") and "Traceback" not in stopped.stderr
    assert [r["round"] for r in read_metrics(run)] == [1, 2, 3]
    assert sorted(p.name for p in (run / "checkpoint").iterdir()) == ["meta.json", "round-3"]
    resumed = launch(3, "--resume", str(run)) if stop_in_process else run_in_process("--resume", str(run))
    assert resumed.returncode == 0, resumed.stderr
    assert numbers(run) == uninterrupted


def test_a_crash_after_a_checkpoint_leaves_it_intact_and_resumable(data_root, tmp_path, uninterrupted):
    run = tmp_path / "run"
    crashed = launch(3, *_args(data_root, run, "--rounds", "6", "--ckpt-every", "2"),
                     env={"MPIFL_FAULT": "raise:rank=0,round=4"})
    assert crashed.returncode != 0
    assert json.loads((run / "checkpoint" / "meta.json").read_text())["round"] == 2
    assert not list((run / "checkpoint").glob("round-*/*.tmp"))
    resumed = launch(3, "--resume", str(run))
    assert resumed.returncode == 0, resumed.stderr
    assert numbers(run) == uninterrupted  # rounds logged after the checkpoint were dropped and redone


@pytest.mark.parametrize("extra,pattern", [
    (("--lr", "0.5"), "drop --lr (only --rounds"),
    (("--out", "elsewhere"), "drop --out"),
])
def test_resume_refuses_to_change_what_the_run_computes(tmp_path, extra, pattern):
    (tmp_path / "config.json").write_text(json.dumps({"algo": "fedavg"}))
    job = run_in_process("--resume", str(tmp_path), *extra, timeout=60)
    assert job.returncode == 2 and pattern in job.stderr and len(job.stderr.strip().splitlines()) == 1


def test_resume_without_a_checkpoint_or_past_its_rounds_is_refused(data_root, tmp_path):
    run = tmp_path / "run"
    assert run_in_process(*_args(data_root, run, "--rounds", "1"), timeout=120).returncode == 0
    job = run_in_process("--resume", str(run), "--rounds", "2", timeout=60)
    assert job.returncode == 2 and "no checkpoint in" in job.stderr
    (run / "checkpoint").mkdir()
    flat = json.loads((run / "config.json").read_text())
    cfg = resolve(flat, {}, {o.name: o for o in get_algorithm(flat["algo"]).options})
    commit(run, Checkpoint(round=1, clients=5, ranks={}, pending=None, identity=identity(cfg)))
    job = run_in_process("--resume", str(run), "--rounds", "1", timeout=60)
    assert job.returncode == 2 and "pass --rounds above 1" in job.stderr


def _cfg(**kw):
    return RunConfig(**kw, algo_options={"mu": 0.01})


def test_a_checkpoint_of_another_run_is_refused(tmp_path):
    commit_to = tmp_path / "checkpoint"
    commit_to.mkdir()
    commit(tmp_path, Checkpoint(round=2, clients=5, ranks={1: [0]}, pending=None, identity=identity(_cfg())))
    assert load(tmp_path, _cfg(), 5).round == 2
    with pytest.raises(MpiflError, match="another run .*algo 'fedavg' vs 'fedprox'"):
        load(tmp_path, _cfg(algo="fedprox"), 5)
    with pytest.raises(MpiflError, match="5 clients, this run 6"):
        load(tmp_path, _cfg(), 6)


def test_files_round_trip_and_commit_keeps_only_the_named_round(tmp_path):
    for r in (2, 4):
        save_server(tmp_path, r, ServerState(model={"w": torch.full((2,), float(r))}, extra={"m": torch.ones(1)}))
        save_clients(tmp_path, r, 1, {0: {"p": torch.tensor([r, 0.5])}})
        save_clients(tmp_path, r, 2, {3: {"p": torch.tensor([r, 1.5])}})
        commit(tmp_path, Checkpoint(round=r, clients=4, ranks={1: [0], 2: [3]}, pending={"round": r},
                                    identity=identity(_cfg())))
    assert [p.name for p in (tmp_path / "checkpoint").glob("round-*")] == ["round-4"]
    meta = load(tmp_path, _cfg(), 4)
    assert meta.pending == {"round": 4}
    assert torch.equal(load_clients(tmp_path, meta, [3, 0])[3]["p"], torch.tensor([4, 1.5]))
    with pytest.raises(MpiflError, match=r"lacks the state of clients \[1\]"):
        load_clients(tmp_path, meta, [1])
