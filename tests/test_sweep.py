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


def _main(sweep, capsys, *args: str) -> tuple[int, list[str]]:
    """The sweep's command line in this process: its exit code and the lines it printed on stderr."""
    code = sweep.main(list(args))
    return code, capsys.readouterr().err.splitlines()


def test_an_unknown_grid_key_or_common_option_is_refused_once_and_nothing_is_written(sweep, capsys, tmp_path):
    for args in (["--grid", "bogus=1,2"], ["--grid", "lr=0.1,0.2", "--", "--bogus", "3"],
                 ["--grid", "lr=0.1,-1"]):  # a value mpifl refuses: said once, for the point, before any runs
        code, lines = _main(sweep, capsys, *args[:2], "--local", "--out", str(tmp_path / "SW"), "--dry-run",
                            *args[2:])
        assert code == 2 and len(lines) == 1, lines
        assert ("--bogus" in lines[0] or "point p001-lr=-1: --lr must be > 0" in lines[0]), lines
        assert not (tmp_path / "SW").exists()


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
