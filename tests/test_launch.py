"""launch/local.sh picks the rank count from the clients and the node, then runs the job; launch/hosts.py refuses a
user other than root in one line."""

import json
import os
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import REPO, mpirun_path, read_metrics


@pytest.mark.slow
def test_local_launcher_sizes_the_job_and_runs_it(data_root, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "MPIRUN": mpirun_path(),
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    proc = subprocess.run([str(REPO / "launch" / "local.sh"), "--data-root", str(data_root), "--model", "smallcnn",
                           "--rounds", "1", "--out", str(tmp_path / "run")],
                          capture_output=True, text=True, env=env, timeout=180)
    assert proc.returncode == 0, proc.stderr
    cores = len(os.sched_getaffinity(0))
    expected = 1 + min(5, cores)
    assert f"5 clients, 0 GPUs, {cores} cores -> mpirun -n {expected}" in proc.stderr
    assert len(read_metrics(tmp_path / "run")) == 1


@pytest.mark.slow
@pytest.mark.parametrize("ranks", ["abc", "0", "-2", "1.5"])
def test_an_mpifl_ranks_that_is_no_number_of_ranks_is_refused_before_anything_runs(data_root, tmp_path, ranks):
    """Issue 48: ``MPIFL_RANKS=abc`` or ``0`` went to ``mpirun -n``, and the job ran in one process without a word."""
    launcher = tmp_path / "mpirun"
    launcher.write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path / 'launched'}\n")
    launcher.chmod(0o755)
    env = {**os.environ, "PYTHONPATH": str(REPO), "MPIRUN": str(launcher), "MPIFL_RANKS": ranks,
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    proc = subprocess.run([str(REPO / "launch" / "local.sh"), "--data-root", str(data_root), "--rounds", "1"],
                          capture_output=True, text=True, env=env, timeout=60, cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.splitlines() == [
        f"launch/local.sh: error: MPIFL_RANKS={ranks} is no number of ranks; set a whole number >= 1, or unset it "
        "for 1 + min(clients, GPUs or cores)"], proc.stderr
    assert not (tmp_path / "launched").exists()


def test_hosts_refuses_a_user_other_than_root_in_one_line_before_touching_anything(tmp_path, monkeypatch, capsys):
    """Issue 48: ``launch/hosts.py start 2`` as a user gave a 14-line PermissionError from its state folder."""
    monkeypatch.setenv("MPIFL_HOSTS_STATE", str(tmp_path / "state"))
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    for verb in (["start", "2"], ["stop"], ["cut", "node1"]):
        monkeypatch.setattr(sys, "argv", [str(REPO / "launch" / "hosts.py"), *verb])
        with pytest.raises(SystemExit) as ended:
            runpy.run_path(str(REPO / "launch" / "hosts.py"), run_name="__main__")
        assert ended.value.code == 1
        assert capsys.readouterr().err.splitlines() == [
            f"hosts: error: launch/hosts.py {verb[0]} needs root (network namespaces, {tmp_path / 'state'}); run it "
            "as root"]
    assert not (tmp_path / "state").exists()


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root and setpriv to be nobody")
def test_hosts_start_as_nobody_is_refused_in_one_line():
    proc = subprocess.run(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", sys.executable,
                           str(REPO / "launch" / "hosts.py"), "start", "2"], capture_output=True, text=True,
                          timeout=60, env={k: v for k, v in os.environ.items() if k != "MPIFL_HOSTS_STATE"})
    assert proc.returncode == 1 and proc.stderr.splitlines() == [
        "hosts: error: launch/hosts.py start needs root (network namespaces, /run/mpifl-hosts); run it as root"]


@pytest.mark.slow
def test_local_launcher_passes_mpifl_errors_through(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    proc = subprocess.run([str(REPO / "launch" / "local.sh"), "--algo", "nope"], capture_output=True, text=True,
                          env=env, timeout=60, cwd=tmp_path)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mpifl: error: unknown algorithm 'nope'; choose one of: ")
    assert ", fedavg, " in lines[0]


NODE_PROBE = """
import json
import os
import sys
import torch
from mpi4py import MPI
from mpifl.transport.mpi import MpiComm
from mpifl.client.devices import pick_device, threads_for

torch.cuda.is_available = lambda: True  # pretend: two GPUs on every node
torch.cuda.device_count = lambda: 2
layout = MpiComm().node_layout()
device = pick_device("auto", layout) if MPI.COMM_WORLD.rank else None
with open(f"{sys.argv[1]}/rank-{MPI.COMM_WORLD.rank}.json", "w") as f:  # not stdout: ranks' lines interleave
    json.dump({"rank": MPI.COMM_WORLD.rank, "node_ranks": layout.node_ranks, "clients": layout.client_ranks,
               "index": layout.client_index, "device": str(device), "threads": threads_for(layout, 0),
               "launcher_local_rank": int(os.environ["MPI_LOCALRANKID"])}, f)
"""


@pytest.mark.slow
def test_gpu_binding_is_node_local_on_a_fake_two_node_layout(tmp_path):
    """Hydra's fork bootstrap starts every "host" here, and MPI still sees one node per host name (as does
    the launcher's MPI_LOCALRANKID).

    ``-hosts nodea:2,nodeb:1``: ranks 0 (server) and 1 on nodea, rank 2 on nodeb, no ssh.  Binding by
    node-local client index gives rank 2 its node's first GPU (a global rank would give it cuda:1).
    """
    mpirun = mpirun_path()
    version = subprocess.run([mpirun, "--version"], capture_output=True, text=True).stdout
    if "HYDRA" not in version:
        pytest.skip("needs MPICH's Hydra mpirun (-bootstrap fork -hosts) for a fake two-node layout")
    probe = tmp_path / "probe.py"
    probe.write_text(NODE_PROBE)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([mpirun, "-bootstrap", "fork", "-hosts", "nodea:2,nodeb:1", "-n", "3", sys.executable,
                           str(probe), str(tmp_path)], capture_output=True, text=True, env=env, timeout=180)
    assert proc.returncode == 0, proc.stderr
    ranks = {r: json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(3)}
    assert [ranks[r]["node_ranks"] for r in range(3)] == [[0, 1], [0, 1], [2]]
    assert [ranks[r]["clients"] for r in range(3)] == [[1], [1], [2]]
    assert [ranks[r]["index"] for r in range(3)] == [-1, 0, 0]
    assert [ranks[r]["device"] for r in (1, 2)] == ["cuda:0", "cuda:0"]
    # the launcher's own node-local rank (Hydra's MPI_LOCALRANKID) agrees: on the server's node the client
    # ranks come after it
    assert [ranks[r]["launcher_local_rank"] for r in range(3)] == [0, 1, 0]
    assert all(ranks[r]["index"] == ranks[r]["launcher_local_rank"] - (0 in ranks[r]["node_ranks"]) for r in (1, 2))
    cores = len(os.sched_getaffinity(0))
    assert ranks[1]["threads"] == ranks[2]["threads"] == cores  # one client rank per node: all its cores
