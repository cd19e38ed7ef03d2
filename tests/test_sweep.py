"""launch/sweep.py: grid expansion, one config file per point, the commands, and a real local sweep."""

from __future__ import annotations

import csv
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import REPO, launch_script, mpirun_path, read_metrics

SWEEP = REPO / "launch" / "sweep.py"


@pytest.fixture(scope="module")
def sweep():
    return launch_script("sweep")


def run_sweep(*args: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SWEEP), *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})}, cwd=REPO)


def test_grid_expands_to_the_cartesian_product_with_seeds_innermost(sweep):
    grid = sweep.parse_grid(["lr=0.01,0.1", "local-epochs=1,2", "algo=fedavg,fedbn", "uniform_weights=true"])
    assert grid == [("lr", [0.01, 0.1]), ("local_epochs", [1, 2]), ("algo", ["fedavg", "fedbn"]),
                    ("uniform_weights", [True])]
    points = sweep.expand(grid, seeds=[0, 1, 2])
    assert len(points) == 2 * 2 * 2 * 3
    assert points[0] == {"lr": 0.01, "local_epochs": 1, "algo": "fedavg", "uniform_weights": True, "seed": 0}
    assert [p["seed"] for p in points[:4]] == [0, 1, 2, 0]  # seeds vary fastest, the first grid slowest
    assert [p["lr"] for p in points[::12]] == [0.01, 0.1]
    assert sweep.point_name(7, {"lr": 0.1, "algo": "fed avg"}) == "p007-lr=0.1-algo=fed_avg"


@pytest.mark.parametrize("grids, seeds, common, message", [
    (["lr"], None, [], "write KEY=V1,V2"),
    (["lr=0.1", "lr=0.2"], None, [], "--grid lr is given twice"),
    (["seed=1,2"], [0], [], "either as --seeds or as --grid seed"),
    (["out=a,b"], None, [], "the sweep sets --out itself"),
    (["lr=0.1,0.2"], None, ["--rounds", "2", "--lr", "0.3"], "--lr is both swept and a common option"),
    (["lr=0.1,0.2"], [0, 1], ["--seed=4"], "--seed is both swept"),
    (["lr=0.1,0.2"], None, ["--config", "x.json"], "--config among the common options"),
    # mpifl's own options and types, checked once: not N points failing alike
    (["bogus=1,2"], None, [], "--grid bogus: mpifl has no option --bogus; see `python -m mpifl.run --help`"),
    (["lr=0.1,abc"], None, [], "--grid lr: option lr must be float, got 'abc'"),
    (["lr=0.1"], None, ["--bogus", "3"], "the options after --: No such option '--bogus'"),
    (["lr=0.1"], None, ["--rounds", "x"], "the options after --: Invalid value for '--rounds': 'x' is not a valid"),
    (["lr=0.1"], None, ["--show-manifest"], "--show-manifest among the common options: the points would print"),
])
def test_bad_sweeps_are_refused(sweep, grids, seeds, common, message):
    with pytest.raises(sweep.SweepError, match=re.escape(message)):
        grid = sweep.parse_grid(grids)
        sweep.expand(grid, seeds)
        sweep.check_common(common, grid, seeds)


def _files(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _main(sweep, capsys, *args: str) -> tuple[int, list[str]]:
    """The sweep's command line in this process: its exit code and the lines it printed on stderr."""
    code = sweep.main(list(args))
    return code, capsys.readouterr().err.splitlines()


@pytest.mark.parametrize("mode", [["--local"], ["--slurm", "slurm/pacs.sh"]])
def test_a_sweep_folder_holds_one_sweep_and_another_grid_is_refused_before_anything_is_written(sweep, capsys,
                                                                                               tmp_path, mode):
    out = tmp_path / "SW"
    first = ["--grid", "lr=0.1,0.05", *mode, "--out", str(out), "--dry-run", "--", "--rounds", "1"]
    assert _main(sweep, capsys, *first)[0] == 0
    (out / "results.csv").write_text("the first sweep's results\n")
    (out / "runs" / "p001-lr=0.05").mkdir(parents=True)
    before = _files(out)
    for other in (["--grid", "lr=0.2", *mode, "--out", str(out), "--dry-run", "--", "--rounds", "1"],
                  ["--grid", "lr=0.1,0.05", *mode, "--out", str(out), "--dry-run", "--", "--rounds", "2"],
                  ["--grid", "lr=0.1,0.05", "--seeds", "0,1", *mode, "--out", str(out), "--dry-run", "--",
                   "--rounds", "1"],
                  ["--grid", "lr=0.1,0.05", *(["--slurm", "slurm/pacs.sh"] if mode == ["--local"] else ["--local"]),
                   "--out", str(out), "--dry-run", "--", "--rounds", "1"]):
        code, lines = _main(sweep, capsys, *other)
        assert code == 2 and len(lines) == 1, lines
        assert lines[0].startswith(f"sweep: error: {out} holds another sweep (") and "pass another --out" in lines[0]
        assert _files(out) == before  # the first sweep's configs, list, sweep.json and results as they were
    code, lines = _main(sweep, capsys, *first)  # the same sweep again: it continues
    assert code == 0 and _files(out) == before, lines
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    code, lines = _main(sweep, capsys, "--grid", "lr=0.1", *mode, "--out", str(tmp_path / "other"), "--dry-run")
    assert code == 2 and lines == [f"sweep: error: {tmp_path / 'other'} holds files but no sweep.json: it is no "
                                   "sweep folder; pass a new or empty --out"]
    assert _files(tmp_path / "other") == {"notes.txt": b"mine"}


def test_an_unknown_grid_key_or_common_option_is_refused_once_and_nothing_is_written(sweep, capsys, tmp_path):
    for args in (["--grid", "bogus=1,2"], ["--grid", "lr=0.1,0.2", "--", "--bogus", "3"],
                 ["--grid", "lr=0.1,-1"]):  # a value mpifl refuses: said once, for the point, before any runs
        code, lines = _main(sweep, capsys, *args[:2], "--local", "--out", str(tmp_path / "SW"), "--dry-run",
                            *args[2:])
        assert code == 2 and len(lines) == 1, lines
        assert ("--bogus" in lines[0] or "point p001-lr=-1: --lr must be > 0" in lines[0]), lines
        assert not (tmp_path / "SW").exists()


def _run_config(args: list[str]) -> dict:
    """config.json of ``python -m mpifl.run ARGS``, as mpifl's command line resolves it."""
    from mpifl.job.cli import configuration

    return json.loads(json.dumps(configuration(args)[0].to_flat()))


def test_a_point_is_done_only_if_its_run_has_the_whole_configuration_it_asks_now(sweep, capsys, tmp_path):
    """Issue 48, broken promise 3: a run of FedAvg for 1 round is no result of a point asking FedProx for 2."""
    out, data = tmp_path / "SW", str(tmp_path / "data")
    args = ["--grid", "lr=0.1", "--local", "--out", str(out), "--", "--rounds", "2", "--algo", "fedprox",
            "--data-root", data]
    assert _main(sweep, capsys, *args[:-7], "--dry-run", *args[-7:])[0] == 0  # the sweep folder, nothing run
    run = out / "runs" / "p000-lr=0.1"
    run.mkdir(parents=True)
    (run / "summary.csv").write_text("domain,model,last_round,last_test_acc,best_round,best_test_acc\n"
                                     "mean,global,1,0.5,1,0.5\n")
    config = out / "configs" / "p000-lr=0.1.json"
    ran = _run_config(["--config", str(config), "--out", str(run), "--rounds", "1", "--data-root", data])
    (run / "config.json").write_text(json.dumps(ran))
    code, lines = _main(sweep, capsys, *args)
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"sweep: error: {run} was run with another configuration than its point asks now (it "
                               "has --algo fedavg --mu unset --rounds 1 --schedule-rounds 1; the point asks --algo "
                               "fedprox --mu 0.01 --rounds 2 --schedule-rounds 2)"), lines
    assert not (out / "results.csv").exists()
    asked = _run_config(["--config", str(config), "--out", str(run), "--rounds", "2", "--algo", "fedprox",
                         "--data-root", data])
    (run / "config.json").write_text(json.dumps(asked))  # the very configuration: done, skipped, collected
    code, lines = _main(sweep, capsys, *args)
    assert code == 0 and "sweep: [1/1] p000-lr=0.1: done already, skipped" in lines
    assert (out / "results.csv").read_text().splitlines()[1] == "p000-lr=0.1,0.1,global,1,0.5,1,0.5"


def test_a_point_stopped_with_a_checkpoint_is_resumed_and_one_stopped_without_is_not_run_again(sweep, tmp_path):
    run, wanted = tmp_path / "run", {"algo": "fedavg", "rounds": 3, "out": "anywhere"}
    assert sweep.point_state(run, wanted) == "new"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({**wanted, "out": "elsewhere"}))  # moved: the same run
    assert sweep.point_state(run, wanted) == "ended"
    (run / "checkpoint").mkdir()
    (run / "checkpoint" / "meta.json").write_text(json.dumps({"round": 2}))
    assert sweep.point_state(run, wanted) == "resume"
    assert sweep.local_command(tmp_path, Path("c/run.json"), ["--rounds", "3"], "resume") == [
        str(sweep.LOCAL), "--config", "c/run.json", "--resume", str(tmp_path / "runs" / "run"), "--rounds", "3"]
    (run / "summary.csv").write_text("domain\n")
    assert sweep.point_state(run, wanted) == "done"
    with pytest.raises(sweep.SweepError, match=re.escape("(it has --rounds 3; the point asks --rounds 4)")):
        sweep.point_state(run, {**wanted, "rounds": 4})


@pytest.mark.slow
def test_dry_run_writes_one_config_per_point_and_prints_the_local_commands(tmp_path):
    out = tmp_path / "sweep"
    proc = run_sweep("--grid", "lr=0.01,0.1", "--grid", "algo=fedavg,fedbn", "--local", "--out", str(out),
                     "--dry-run", "--", "--rounds", "2", "--data-root", "two words")
    assert proc.returncode == 0, proc.stderr
    listed = (out / "configs.txt").read_text().splitlines()
    assert listed == ["configs/p000-lr=0.01-algo=fedavg.json", "configs/p001-lr=0.01-algo=fedbn.json",
                      "configs/p002-lr=0.1-algo=fedavg.json", "configs/p003-lr=0.1-algo=fedbn.json"]
    assert json.loads((out / listed[3]).read_text()) == {"lr": 0.1, "algo": "fedbn"}
    commands = [shlex.split(line) for line in proc.stdout.splitlines()]
    assert len(commands) == 4
    assert commands[1] == [str(REPO / "launch" / "local.sh"), "--config", str(out / listed[1]),
                           "--out", str(out / "runs" / "p001-lr=0.01-algo=fedbn"), "--rounds", "2", "--data-root",
                           "two words"]
    assert not (out / "runs").exists()  # nothing ran
    assert json.loads((out / "sweep.json").read_text())["common"] == ["--rounds", "2", "--data-root", "two words"]


@pytest.mark.slow
def test_dry_run_prints_one_sbatch_array_that_reads_the_config_list(tmp_path):
    out = tmp_path / "sweep"
    proc = run_sweep("--grid", "lr=0.01,0.1", "--seeds", "0,1,2", "--slurm", "slurm/pacs.sh", "--out", str(out),
                     "--sbatch-args", "-p gpu -A proj", "--max-parallel", "2", "--dry-run", "--", "--rounds", "5")
    assert proc.returncode == 0, proc.stderr
    words = shlex.split(proc.stdout)
    env = dict(w.split("=", 1) for w in words[:4])
    assert env == {"MPIFL_ARRAY": "config", "MPIFL_CONFIG_LIST": str(out / "configs.txt"),
                   "MPIFL_RUNS": str(out / "runs"), "MPIFL_ARGS": "--rounds 5"}
    assert words[4:] == ["sbatch", "--parsable", "--array=0-5%2", "-p", "gpu", "-A", "proj", "slurm/pacs.sh"]
    assert len((out / "configs.txt").read_text().splitlines()) == 6
    # what task 5 of that array runs: the slurm script picks line 6 of the list
    dry = subprocess.run(["bash", str(REPO / "slurm" / "pacs.sh")], capture_output=True, text=True, timeout=60,
                         env={**os.environ, **env, "MPIFL_DRY_RUN": "1", "SLURM_JOB_ID": "9", "SLURM_NTASKS": "5",
                              "SLURM_ARRAY_JOB_ID": "7", "SLURM_ARRAY_TASK_ID": "5", "SLURM_JOB_NAME": "mpifl-pacs"})
    assert dry.returncode == 0, dry.stderr
    run_dir, command = dry.stdout.splitlines()
    assert run_dir == f"RUN_DIR={out}/runs/mpifl-pacs-7_5-p005-lr=0.1-seed=2"
    assert f"--config {out}/configs/p005-lr=0.1-seed=2.json" in command and command.endswith("--rounds 5 ")


@pytest.mark.slow
def test_local_sweep_runs_every_point_and_collects_the_results(data_root, tmp_path):
    out = tmp_path / "sweep"
    env = {"PYTHONPATH": str(REPO), "MPIRUN": mpirun_path(), "MPIFL_RANKS": "3",
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    proc = run_sweep("--grid", "lr=0.05,0.1", "--local", "--out", str(out), "--", "--data-root", str(data_root),
                     "--model", "smallcnn", "--rounds", "1", "--threads", "1", env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr
    runs = [out / "runs" / "p000-lr=0.05", out / "runs" / "p001-lr=0.1"]
    assert [json.loads((r / "config.json").read_text())["lr"] for r in runs] == [0.05, 0.1]
    assert all(len(read_metrics(r)) == 1 for r in runs)
    results = list(csv.DictReader((out / "results.csv").open()))
    assert [(r["point"], r["lr"], r["model"], r["last_round"]) for r in results] == [
        ("p000-lr=0.05", "0.05", "global", "1"), ("p001-lr=0.1", "0.1", "global", "1")]
    assert all(0 <= float(r["last_test_acc"]) <= 1 for r in results)
    again = run_sweep("--grid", "lr=0.05,0.1", "--local", "--out", str(out), "--", "--data-root", str(data_root),
                      "--model", "smallcnn", "--rounds", "1", "--threads", "1", env=env, timeout=120)
    assert again.returncode == 0 and again.stderr.count("done already, skipped") == 2
    # issue 48, broken promises 2 and 3: another grid, or the same points asking other options, into this folder
    kept = {name: (out / name).read_bytes() for name in ("results.csv", "sweep.json", "configs.txt")}
    for grid, options in (("lr=0.2", ["--rounds", "1"]), ("lr=0.05,0.1", ["--rounds", "2", "--algo", "fedprox"])):
        other = run_sweep("--grid", grid, "--local", "--out", str(out), "--", "--data-root", str(data_root),
                          "--model", "smallcnn", *options, "--threads", "1", env=env, timeout=120)
        assert other.returncode == 2 and other.stderr.startswith(f"sweep: error: {out} holds another sweep ("), \
            other.stderr
        assert len(other.stderr.splitlines()) == 1 and "done already" not in other.stderr
        assert {name: (out / name).read_bytes() for name in kept} == kept


@pytest.mark.slow
def test_a_rerun_sweep_resumes_the_point_stopped_with_a_checkpoint(data_root, tmp_path):
    out = tmp_path / "sweep"
    env = {"PYTHONPATH": str(REPO), "MPIRUN": mpirun_path(), "MPIFL_RANKS": "1",  # one process: the cheapest job
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    args = ["--grid", "lr=0.1", "--local", "--out", str(out), "--", "--data-root", str(data_root), "--model",
            "smallcnn", "--rounds", "2", "--threads", "1", "--samples-per-client", "64"]
    stopped = run_sweep(*args, env={**env, "MPIFL_FAULT": "stop:rank=0,round=1"}, timeout=300)  # SIGTERM in round 1
    assert stopped.returncode == 1 and "failed: p000-lr=0.1" in stopped.stderr, stopped.stderr
    run = out / "runs" / "p000-lr=0.1"
    assert (run / "checkpoint" / "meta.json").is_file() and not (run / "summary.csv").exists()
    again = run_sweep(*args, env=env, timeout=300)
    assert again.returncode == 0, again.stderr
    assert "sweep: [1/1] p000-lr=0.1: continued from its checkpoint (round 1)" in again.stderr
    assert [r["round"] for r in read_metrics(run)] == [1, 2]
    (result,) = csv.DictReader((out / "results.csv").open())
    assert (result["point"], result["last_round"]) == ("p000-lr=0.1", "2")
