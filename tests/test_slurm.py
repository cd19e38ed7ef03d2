"""The slurm/*.sh batch scripts: their commands (dry runs, no Slurm needed), and real jobs on a Slurm.

The jobs need a Slurm controller that accepts the scripts unchanged: ``launch/local-slurm.sh start``
(as root) sets one up on this machine.  Without one the job tests skip, unless ``MPIFL_REQUIRE_SLURM=1``
(CI) makes them fail.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .conftest import REPO, launch, read_metrics

pytestmark = pytest.mark.slow

SLURM = REPO / "slurm"
VENV = Path(sys.executable).parent.parent
DOMAINS = {"pacs": 4, "office_caltech": 4, "officehome": 4, "domainnet": 6, "digits": 5, "styledigits": 5}
TINY = "--model smallcnn --threads 1"
JOB_TIMEOUT = 900  # seconds: CI machines are small and shared
FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL",
         "DEADLINE"}


# ---------------------------------------------------------------- helpers

def clean_env(**extra: str) -> dict:
    """This process's environment without Slurm's or mpifl's settings, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "MPIFL_"))}
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    return {**env, **extra}


def dry_run(script: str, tmp_path: Path, **env: str) -> tuple[str, list[str]]:
    """``MPIFL_DRY_RUN=1 bash slurm/SCRIPT``: the run directory and the command, as words."""
    proc = subprocess.run(["bash", str(SLURM / script)], capture_output=True, text=True, timeout=60, cwd=tmp_path,
                          env=clean_env(MPIFL_DRY_RUN="1", MPIFL_RUNS=str(tmp_path / "runs"), **env))
    assert proc.returncode == 0, proc.stderr
    run_line, command = proc.stdout.strip().splitlines()
    assert run_line.startswith("RUN_DIR=")
    words = subprocess.run(["bash", "-c", f"printf '%s\\n' {command}"], capture_output=True, text=True,
                           check=True).stdout.splitlines()
    return run_line[len("RUN_DIR="):], words


def option(words: list[str], name: str) -> str:
    """The value of the last ``name`` option (the one mpifl takes)."""
    return words[len(words) - 1 - words[::-1].index(name) + 1]


def dataset_domains(name: str) -> list[str]:
    from mpifl.data import digits, generated
    from mpifl.data.benchmarks import BENCHMARKS
    if name in BENCHMARKS:
        return [d.id for d in BENCHMARKS[name].domains]
    return list({"digits": digits.DOMAINS, "styledigits": generated.DOMAINS}[name])


def slurm_problem() -> str | None:
    if not shutil.which("sbatch"):
        return "sbatch is not on PATH"
    ping = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=30)
    if ping.returncode != 0 or "UP" not in ping.stdout:
        said = (ping.stdout + ping.stderr).strip().splitlines()
        return f"no Slurm controller answers `scontrol ping` ({said[0] if said else 'no output'})"
    states = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=30).stdout.split()
    if not any(s.rstrip("*~#").split("+")[0] in ("idle", "mixed", "allocated", "completing") for s in states):
        return f"no Slurm node is up (sinfo: {' '.join(states) or 'no nodes'})"
    return None


@pytest.fixture(scope="module")
def slurm() -> None:
    problem = slurm_problem()
    if problem:
        message = f"{problem}; start a local Slurm with `launch/local-slurm.sh start` (as root)"
        if os.environ.get("MPIFL_REQUIRE_SLURM") == "1":
            pytest.fail(f"MPIFL_REQUIRE_SLURM=1 but {message}")
        pytest.skip(message)


def submit(script: str, cwd: Path, data_root: Path, *sbatch_args: str, **env: str) -> str:
    """Submit slurm/SCRIPT unchanged from ``cwd`` (its output lands there); return the job id."""
    env = clean_env(MPIFL_VENV=str(VENV), MPIFL_DATA_ROOT=str(data_root), MPIFL_RUNS=str(cwd / "runs"), **env)
    proc = subprocess.run(["sbatch", "--parsable", *sbatch_args, str(SLURM / script)], capture_output=True,
                          text=True, timeout=60, cwd=cwd, env=env)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split(";")[0]


def job_records(job: str) -> list[dict]:
    """``scontrol show job -o JOB``, one dict per job (per task of an array)."""
    out = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return [dict(re.findall(r"(\w+)=(\S*)", line)) for line in out.stdout.splitlines() if line.strip()]


def output_of(cwd: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()}" for p in sorted(cwd.glob("slurm-*.out")))


def wait_for(job: str, cwd: Path, timeout: float = JOB_TIMEOUT, tasks: int = 1) -> list[dict]:
    """Poll until every task of ``job`` is in a final state; cancel it and fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        records = job_records(job)
        if len(records) >= tasks and all(r["JobState"] in FINAL for r in records):
            return records
        time.sleep(2)
    subprocess.run(["scancel", job], timeout=30)
    pytest.fail(f"job {job} did not end within {timeout:.0f} s: {job_records(job)}\n{output_of(cwd)}")


def wait_for_file(path: Path, job: str, cwd: Path, until, timeout: float = JOB_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.is_file() and until(path.read_text()):
            return
        if all(r["JobState"] in FINAL for r in job_records(job)):
            pytest.fail(f"job {job} ended before {path} was ready\n{output_of(cwd)}")
        time.sleep(0.5)
    subprocess.run(["scancel", job], timeout=30)
    pytest.fail(f"{path} not ready within {timeout:.0f} s\n{output_of(cwd)}")


def assert_completed(record: dict, cwd: Path) -> None:
    assert (record["JobState"], record["ExitCode"]) == ("COMPLETED", "0:0"), f"{record}\n{output_of(cwd)}"


def numbers(run_dir: Path) -> list[dict]:
    """What a run computes, per round: training and evaluation metrics (no timings)."""
    return [{k: rec.get(k) for k in ("round", "clients", "train", "eval")} for rec in read_metrics(run_dir)]


# ---------------------------------------------------------------- the scripts' commands (no Slurm)

@pytest.mark.parametrize("name", sorted(DOMAINS))
def test_script_asks_for_one_task_per_client_plus_the_server(name, tmp_path):
    text = (SLURM / f"{name}.sh").read_text()
    header = dict(re.findall(r"^#SBATCH --([\w-]+)(?:=(\S+))?", text, re.M))
    assert header["ntasks"] == str(DOMAINS[name] + 1)
    assert "gpus-per-node" in header and header["requeue"] == "" and header["signal"].startswith("B:USR1@")
    assert "partition" not in header and "account" not in header  # sbatch -p/-A: the site's choice
    run_dir, words = dry_run(f"{name}.sh", tmp_path)
    assert words[:3] == ["mpirun", "-n", str(DOMAINS[name] + 1)]  # no Slurm: mpirun
    assert words[3:6] == ["python", "-m", "mpifl.run"]
    assert option(words, "--data") == name and option(words, "--out") == run_dir
    domains = re.search(r'MPIFL_DOMAINS:=([^}"]*)', text).group(1).split()
    assert domains == dataset_domains(name)  # MPIFL_ARRAY=holdout indexes them


def test_inside_a_job_the_run_directory_is_named_by_the_job_and_srun_launches(tmp_path):
    env = dict(SLURM_JOB_ID="123", SLURM_JOB_NAME="mpifl-pacs", SLURM_NTASKS="5", SLURM_CPUS_PER_TASK="8")
    run_dir, words = dry_run("pacs.sh", tmp_path, **env, MPIFL_ARGS="--lr 0.05 --note 'two words'")
    assert run_dir == str(tmp_path / "runs" / "mpifl-pacs-123")
    assert words[:3] == ["srun", "--ntasks=5", "--cpus-per-task=8"]
    assert option(words, "--lr") == "0.05" and option(words, "--note") == "two words"  # MPIFL_ARGS last, quoted
    assert option(words, "--ckpt-every") == "10"
    _, words = dry_run("pacs.sh", tmp_path, **env, MPIFL_LAUNCHER="mpirun", MPIFL_MPIRUN="/opt/mpi/bin/mpirun -x A")
    assert words[:5] == ["/opt/mpi/bin/mpirun", "-x", "A", "-n", "5"]


def test_array_tasks_pick_a_seed_a_held_out_domain_or_a_config(tmp_path):
    env = dict(SLURM_JOB_ID="124", SLURM_ARRAY_JOB_ID="120", SLURM_ARRAY_TASK_ID="2", SLURM_JOB_NAME="mpifl-pacs")
    run_dir, words = dry_run("pacs.sh", tmp_path, **env)
    assert option(words, "--seed") == "2" and run_dir.endswith("/mpifl-pacs-120_2")
    _, words = dry_run("pacs.sh", tmp_path, **env, MPIFL_ARRAY="holdout")
    assert option(words, "--holdout") == "photo"  # art_painting cartoon photo sketch
    configs = tmp_path / "sweep"
    configs.mkdir()
    for i in range(3):
        (configs / f"p{i}.json").write_text(json.dumps({"algo": "fedbn", "lr": 0.1 * (i + 1)}))
    (configs / "configs.txt").write_text("p0.json\np1.json\np2.json\n")
    run_dir, words = dry_run("pacs.sh", tmp_path, **env, MPIFL_CONFIG_LIST=str(configs / "configs.txt"))
    assert option(words, "--config") == str(configs / "p2.json") and run_dir.endswith("-120_2-p2")
    assert "--algo" not in words and "--seed" not in words  # the config's algo wins over the script's default
    assert option(words, "--model") == "resnet18"  # defaults the config does not set stay
    proc = subprocess.run(["bash", str(SLURM / "pacs.sh")], capture_output=True, text=True, timeout=60,
                          env=clean_env(MPIFL_DRY_RUN="1", **{**env, "SLURM_ARRAY_TASK_ID": "4"},
                                        MPIFL_ARRAY="holdout"))
    assert proc.returncode == 2 and "pacs has 4 domains" in proc.stderr and "--array=0-3" in proc.stderr


def test_a_requeued_job_resumes_its_run_directory(tmp_path):
    env = dict(SLURM_JOB_ID="125", SLURM_JOB_NAME="mpifl-styledigits", SLURM_RESTART_COUNT="1")
    run_dir = tmp_path / "runs" / "mpifl-styledigits-125"
    (run_dir / "checkpoint").mkdir(parents=True)
    (run_dir / "checkpoint" / "meta.json").write_text("{}")
    _, words = dry_run("styledigits.sh", tmp_path, **env, MPIFL_ARGS="--rounds 3")
    assert words[words.index("mpifl.run") + 1:] == ["--resume", str(run_dir)]  # nothing else: config.json has it
    _, words = dry_run("styledigits.sh", tmp_path, MPIFL_RUN_DIR=str(run_dir))  # a resubmission, by hand
    assert words[-2:] == ["--resume", str(run_dir)]
    proc = subprocess.run(["bash", str(SLURM / "styledigits.sh")], capture_output=True, text=True, timeout=60,
                          env=clean_env(MPIFL_DRY_RUN="1", MPIFL_RUNS=str(tmp_path / "runs"),
                                        **{**env, "SLURM_RESTART_COUNT": "0"}))
    assert proc.returncode == 2 and "exists already, from another job" in proc.stderr  # not its run: no resume
    proc = subprocess.run(["bash", str(SLURM / "styledigits.sh")], capture_output=True, text=True, timeout=60,
                          env=clean_env(MPIFL_DRY_RUN="1", MPIFL_ARGS="--out elsewhere"))
    assert proc.returncode == 2 and "set MPIFL_RUN_DIR instead" in proc.stderr


# ---------------------------------------------------------------- real jobs

def test_job_array_runs_one_seed_per_task_through_mpirun(slurm, data_root, tmp_path):
    job = submit("styledigits.sh", tmp_path, data_root, "--array=0-1", MPIFL_LAUNCHER="mpirun",
                 MPIFL_ARGS=f"{TINY} --rounds 1")
    records = wait_for(job, tmp_path, tasks=2)
    assert sorted(r["ArrayTaskId"] for r in records) == ["0", "1"]
    for record in records:
        assert_completed(record, tmp_path)
    runs = [tmp_path / "runs" / f"mpifl-styledigits-{job}_{task}" for task in (0, 1)]
    assert [json.loads((r / "config.json").read_text())["seed"] for r in runs] == [0, 1]
    first, second = (numbers(r) for r in runs)
    assert [m["round"] for m in first] == [m["round"] for m in second] == [1]
    assert first[0]["train"] != second[0]["train"]  # other seeds, other numbers
    assert all((r / "summary.csv").is_file() for r in runs)
    assert "mpirun -n 6" in output_of(tmp_path)


def test_sweep_submits_one_array_whose_tasks_run_their_configs(slurm, data_root, tmp_path):
    env = clean_env(MPIFL_VENV=str(VENV), MPIFL_DATA_ROOT=str(data_root))
    proc = subprocess.run([sys.executable, str(REPO / "launch" / "sweep.py"), "--grid", "lr=0.05,0.1",
                           "--slurm", str(SLURM / "styledigits.sh"), "--out", str(tmp_path / "sweep"), "--",
                           *TINY.split(), "--rounds", "1"], capture_output=True, text=True, timeout=60, env=env,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    job = proc.stdout.strip()
    for record in wait_for(job, tmp_path, tasks=2):
        assert_completed(record, tmp_path)
    for task, (point, lr) in enumerate([("p000-lr=0.05", 0.05), ("p001-lr=0.1", 0.1)]):
        run_dir = tmp_path / "sweep" / "runs" / f"mpifl-styledigits-{job}_{task}-{point}"
        config = json.loads((run_dir / "config.json").read_text())
        assert (config["lr"], config["model"], config["rounds"]) == (lr, "smallcnn", 1)
        assert [m["round"] for m in read_metrics(run_dir)] == [1]


STAND_IN = r'''
"""Stands in for mpifl.run: one second per round, a checkpoint and exit 75 on SIGUSR1/SIGTERM; with
STAND_IN_LOSE=R:CODE, the first attempt checkpoints round R and ends with CODE, as a job that lost a node."""
import json, os, signal, sys, time
from pathlib import Path

args = sys.argv[1:]
def last(name, default=None):
    return args[len(args) - 1 - args[::-1].index(name) + 1] if name in args else default

rank = int(os.environ.get("PMI_RANK", os.environ.get("SLURM_PROCID", "0")))  # mpirun's, else srun's
stop = []
for signum in (signal.SIGUSR1, signal.SIGTERM):
    signal.signal(signum, lambda n, f: stop.append(n))
out = Path(last("--resume") or last("--out"))
if last("--resume"):
    rounds = json.loads((out / "config.json").read_text())["rounds"]
    start = json.loads((out / "checkpoint" / "meta.json").read_text())["round"] + 1
else:
    rounds, start = int(last("--rounds")), 1
    if rank == 0:
        out.mkdir(parents=True)
        (out / "config.json").write_text(json.dumps({"rounds": rounds}))
for r in range(start, rounds + 1):
    time.sleep(1)
    if rank == 0:
        with open(out / "metrics.jsonl", "a") as f:
            f.write(json.dumps({"round": r, "resumed": start > 1, "ranks": os.environ.get("SLURM_NTASKS"),
                                "size": os.environ.get("PMI_SIZE", os.environ.get("SLURM_NTASKS"))}) + "\n")
    lose, code = map(int, os.environ.get("STAND_IN_LOSE", "0:0").split(":"))
    lost = r == lose and os.environ.get("SLURM_RESTART_COUNT", "0") == "0"
    if (stop or lost) and r < rounds:
        if rank == 0:
            (out / "checkpoint").mkdir(exist_ok=True)
            (out / "checkpoint" / "meta.json").write_text(json.dumps({"round": r}))
        sys.exit(code if lost else 75)
if rank == 0:  # what a finished run writes last (slurm/common.sh checks for summary.md)
    (out / "summary.csv").write_text("done\n")
    (out / "summary.md").write_text("done\n")
'''


def test_preempted_job_checkpoints_requeues_and_ends_like_an_uninterrupted_run(slurm, data_root, tmp_path):
    """slurm/styledigits.sh as submitted (srun, six ranks) writes its run directory; SIGUSR1 after round 1: the
    ranks checkpoint, the job requeues itself and resumes, and every round equals an uninterrupted run's."""
    settings = ["--model", "smallcnn", "--threads", "1", "--rounds", "6", "--lr", "0.05", "--seed", "3"]
    baseline = launch(3, "--data-root", str(data_root), *settings, "--out", str(tmp_path / "baseline"))
    assert baseline.returncode == 0, baseline.stderr
    job = submit("styledigits.sh", tmp_path, data_root, MPIFL_ARGS=" ".join(settings + ["--ckpt-every", "1"]))
    run_dir = tmp_path / "runs" / f"mpifl-styledigits-{job}"
    wait_for_file(run_dir / "metrics.jsonl", job, tmp_path, lambda text: '"round": 1' in text)
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], check=True, timeout=30)
    (record,) = wait_for(job, tmp_path)
    out = (tmp_path / f"slurm-{job}.out").read_text()
    assert_completed(record, tmp_path)
    assert record["Restarts"] == "1", out
    assert "job step ended with exit code 75" in out and f"--resume {run_dir}" in out
    assert "srun --ntasks=6 --cpus-per-task=2 python -m mpifl.run --data styledigits" in out
    assert out.rstrip().endswith("job step ended with exit code 0"), out
    assert [m["round"] for m in read_metrics(run_dir)] == [1, 2, 3, 4, 5, 6]
    assert numbers(run_dir) == numbers(tmp_path / "baseline")  # every round, bit for bit
    rows = (run_dir / "summary.csv").read_text().splitlines()
    assert rows[0].startswith("model,domain") and len(rows) == 1 + 6  # 5 domains and the mean
    assert rows == (tmp_path / "baseline" / "summary.csv").read_text().splitlines()


@pytest.mark.parametrize("code", [69, 0])
def test_a_job_that_lost_a_node_is_requeued_and_resumes(slurm, data_root, tmp_path, code):
    """69: mpifl found a node lost (--peer-timeout); 0 with no summary.md: the launcher ended the job as if done
    (Open MPI's prterun after it lost a node).  Either way the script requeues the job, which resumes."""
    stand_in = tmp_path / "stand_in.py"
    stand_in.write_text(STAND_IN)
    job = submit("styledigits.sh", tmp_path, data_root, MPIFL_PROGRAM=f"python {stand_in}", MPIFL_ROUNDS="4",
                 MPIFL_LAUNCHER="mpirun", STAND_IN_LOSE=f"2:{code}")
    (record,) = wait_for(job, tmp_path)
    out = (tmp_path / f"slurm-{job}.out").read_text()
    assert_completed(record, tmp_path)
    assert record["Restarts"] == "1" and f"job step ended with exit code {code}" in out, out
    assert ("counted as a lost node" in out) == (code == 0) and "(a node was lost)" in out
    run_dir = tmp_path / "runs" / f"mpifl-styledigits-{job}"
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["round"] for m in lines] == [1, 2, 3, 4] and lines[2]["resumed"]


def test_sigterm_stops_with_a_checkpoint_without_requeue_and_a_resubmission_continues(slurm, data_root, tmp_path):
    """scancel's SIGTERM: the ranks checkpoint and stop, the job ends (75); MPIFL_RUN_DIR resumes it by hand."""
    stand_in = tmp_path / "stand_in.py"
    stand_in.write_text(STAND_IN)
    env = dict(MPIFL_PROGRAM=f"python {stand_in}", MPIFL_ROUNDS="6", MPIFL_LAUNCHER="mpirun")
    job = submit("styledigits.sh", tmp_path, data_root, **env)
    run_dir = tmp_path / "runs" / f"mpifl-styledigits-{job}"
    wait_for_file(run_dir / "metrics.jsonl", job, tmp_path, lambda text: '"round": 1' in text)
    subprocess.run(["scancel", "--signal=TERM", "--batch", job], check=True, timeout=30)
    (record,) = wait_for(job, tmp_path)
    assert (record["JobState"], record["ExitCode"], record["Restarts"]) == ("FAILED", "75:0", "0"), output_of(tmp_path)
    assert "resubmit with MPIFL_RUN_DIR" in (tmp_path / f"slurm-{job}.out").read_text()
    done = json.loads((run_dir / "checkpoint" / "meta.json").read_text())["round"]
    again = submit("styledigits.sh", tmp_path, data_root, **env, MPIFL_RUN_DIR=str(run_dir))
    (record,) = wait_for(again, tmp_path)
    assert_completed(record, tmp_path)
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["round"] for m in lines] == list(range(1, 7)) and lines[done]["resumed"]
    assert all(m["size"] == "6" for m in lines)  # mpirun started all 6 ranks
