"""Several nodes for real: jobs across the emulated hosts of launch/hosts.py, started on node1 by the launcher of
the MPI under test (MPICH's Hydra or Open MPI's PRRTE) through the hosts' remote shell.

Messages between hosts take the network (TCP over each host's eth0, said by the MPI itself and counted on the
interfaces); a job across 2 or 3 hosts gives the one-host job's numbers and checkpoint bit for bit; each client
rank binds the GPU of its own node and spills to its own node's TMPDIR; a node killed or cut off ends the job in
a bounded time, its checkpoint intact, and the run resumes on the node that remains with the uninterrupted numbers.

Needs root and network namespaces: without them the module skips with the reason, unless ``MPIFL_REQUIRE_HOSTS=1``
(CI) makes that a failure.  The hosts are torn down however the tests end.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path

import pytest
import torch

from .conftest import AS_ROOT, REPO, Job, launch_script, mpirun_path, open_mpi, read_metrics, run_here

pytestmark = pytest.mark.slow

HOSTS = REPO / "launch" / "hosts.py"
REMOTE_SHELL = REPO / "launch" / "hosts-ssh"
PEER_TIMEOUT = 6  # seconds: --peer-timeout of the lost-node jobs
# Open MPI's launcher notices a lost node through its own TCP keepalive (docs/clusters.md, "Several nodes")
PRRTE_KEEPALIVE = ("--prtemca", "oob_tcp_keepalive_time", "5", "--prtemca", "oob_tcp_keepalive_intvl", "2",
                   "--prtemca", "oob_tcp_keepalive_probes", "3")
TINY = ("--model", "smallcnn", "--clients-per-domain", "2", "--fraction", "0.5", "--samples-per-client", "64",
        "--seed", "0", "--threads", "1", "--lr", "0.05", "--momentum", "0.9", "--eval-every", "1")


# ---------------------------------------------------------------- the hosts

def hosts(*args: str, check: bool = True) -> str:
    proc = subprocess.run([sys.executable, str(HOSTS), *args], capture_output=True, text=True, timeout=120)
    if check and proc.returncode:
        raise AssertionError(f"launch/hosts.py {' '.join(args)}: {proc.stderr.strip()}")
    return proc.stdout


def cannot_make_hosts() -> str | None:
    """Why this machine cannot emulate hosts, or None."""
    if os.geteuid() != 0:
        return "not root"
    probe = subprocess.run(["ip", "netns", "add", "mpifl-probe"], capture_output=True, text=True)
    if probe.returncode:
        return f"cannot make a network namespace ({probe.stderr.strip()})"
    subprocess.run(["ip", "netns", "del", "mpifl-probe"], capture_output=True)
    return None


@pytest.fixture(scope="module")
def nodes():
    """Three emulated hosts for the module, started afresh and always torn down."""
    reason = cannot_make_hosts()
    if reason:
        message = f"emulated hosts need root and network namespaces: {reason}"
        if os.environ.get("MPIFL_REQUIRE_HOSTS") == "1":
            pytest.fail(message)
        pytest.skip(message)
    hosts("stop", check=False)
    try:
        hosts("start", "3")
        yield ["node1", "node2", "node3"]
    finally:
        hosts("stop", check=False)


def all_up() -> None:
    """Every host up and on the network (a test before may have killed or cut one)."""
    if subprocess.run([sys.executable, str(HOSTS), "status"], capture_output=True).returncode:
        hosts("start", "3")


@pytest.fixture
def up(nodes):
    all_up()
    return nodes


def processes(host: str) -> list[str]:
    return hosts("procs", host).splitlines()


def on_node1(layout: dict[str, int], *program: str, env: dict | None = None,
             launcher: tuple[str, ...] = ()) -> tuple[list[str], dict]:
    """The command and environment of ``mpirun`` of the MPI under test, started on node1, with ``layout`` (host ->
    ranks, in rank order) and ``python PROGRAM`` on every rank; ``env`` reaches every rank (Open MPI passes only
    what ``-x`` names)."""
    env = {"PYTHONPATH": str(REPO), **(env or {})}
    where = ",".join(f"{host}:{n}" for host, n in layout.items())
    ranks = str(sum(layout.values()))
    if open_mpi():
        mpirun = [mpirun_path(), "--mca", "plm_rsh_agent", str(REMOTE_SHELL), "--host", where, "-n", ranks,
                  "--bind-to", "none", *PRRTE_KEEPALIVE, *(w for name in env for w in ("-x", name))]
    else:
        mpirun = [mpirun_path(), "-launcher", "ssh", "-launcher-exec", str(REMOTE_SHELL), "-hosts", where, "-n", ranks]
    command = [sys.executable, str(HOSTS), "run", "node1", *mpirun, *launcher, sys.executable, *program]
    return command, {**os.environ, **AS_ROOT, **env}


def across(layout: dict[str, int], *args: str, env: dict | None = None, timeout: float = 300,
           script: Path | None = None, launcher: tuple[str, ...] = ()) -> Job:
    """``python -m mpifl.run ARGS`` (or ``python SCRIPT ARGS``) on every rank of ``layout``, to its end."""
    program = (str(script),) if script else ("-m", "mpifl.run")
    command, full_env = on_node1(layout, *program, *args, env=env, launcher=launcher)
    started = time.monotonic()
    proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=full_env)
    return Job(proc.returncode, proc.stdout, proc.stderr, time.monotonic() - started)


def run_on(host: str, shell: str) -> str:
    """``shell`` (a sh command line) on ``host``, as the hosts' ``run`` gives it: this folder and environment."""
    return hosts("run", host, "sh", "-c", shell)


def wait_for(condition, seconds: float, what: str):
    deadline = time.monotonic() + seconds
    while not (found := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {seconds:.0f} s: {what}")
        time.sleep(0.2)
    return found


# ---------------------------------------------------------------- what the emulation gives

def test_each_host_is_a_node_of_its_own(up, tmp_path):
    """Its own name, routes (none beyond the hosts' network), processes, shared memory and scratch folder; the
    rest of the file system shared."""
    assert [run_on(h, "hostname").strip() for h in up] == up
    assert "default" not in run_on("node1", "ip route") and "10.211.0.0/24 dev eth0" in run_on("node1", "ip route")
    run_on("node1", f'echo x > /dev/shm/mpifl-probe && echo x > "$TMPDIR/probe" && echo x > {tmp_path}/shared')
    assert run_on("node2", 'ls /dev/shm/mpifl-probe "$TMPDIR/probe" 2>/dev/null; echo gone') == "gone\n"
    assert run_on("node2", f"cat {tmp_path}/shared") == "x\n"
    assert not Path("/dev/shm/mpifl-probe").exists() and not any(Path("/run/mpifl-hosts/node-tmp").iterdir())
    seen = run_on("node2", "ls /proc | grep -c '^[0-9]'")  # pid 1, sh, ls, grep: node2 sees no other host's
    assert int(seen) <= 5
    run_on("node1", 'rm /dev/shm/mpifl-probe "$TMPDIR/probe"')


def interface_tables(output: str) -> dict[str, dict[str, set[str]]]:
    """UCX_PROTO_INFO's protocol tables, per host: {host: {'inter-node' | 'intra-node' | 'self': transports}}."""
    tables: dict[str, dict[str, set[str]]] = {}
    kind = None
    for line in output.splitlines():
        found = re.search(r"\[(node\d+):[^]]*\]\s+\|\s+ucp_context_\d+ (\S+) cfg#\d+ \|", line)
        if found:
            host, kind = found.groups()
            continue
        cells = [c.strip() for c in line.split("|")[1:-1]]
        row = re.search(r"\[(node\d+):", line)
        if kind and row and len(cells) == 3 and cells[0][:1].isdigit():
            tables.setdefault(row.group(1), {}).setdefault(kind, set()).add(cells[2])
    return tables


def test_messages_between_hosts_take_the_network(up, data_root, tmp_path):
    """Rank 0 on node1, rank 1 on node2: the MPI's own diagnostics say the peer is on another node, reached over
    TCP on eth0, and node2's interface carried at least every byte that crossed (no shared memory between hosts)."""
    before = hosts("bytes", "node2").split()
    if open_mpi():
        job = across({"node1": 1, "node2": 1}, "--data-root", str(data_root), *TINY, "--rounds", "2", "--out",
                     str(tmp_path / "run"), launcher=("--mca", "btl_base_verbose", "100"))
        assert job.returncode == 0, job.stderr
        assert re.search(r"\[node2:\d+\] mca: bml: Using tcp btl for send to \[\[\d+,\d+\],0\] on node node1",
                         job.stderr), job.stderr[-3000:]
        assert not re.search(r"Using (sm|vader) btl for send to \[\[\d+,\d+\],[01]\] on node node[12]", job.stderr)
    else:
        job = across({"node1": 1, "node2": 1}, "--data-root", str(data_root), *TINY, "--rounds", "2", "--out",
                     str(tmp_path / "run"), env={"UCX_PROTO_INFO": "y"})
        assert job.returncode == 0, job.stderr
        tables = interface_tables(job.stdout + job.stderr)
        assert set(tables) == {"node1", "node2"}, job.stderr[-3000:]
        for host in ("node1", "node2"):
            assert tables[host]["inter-node"] == {"tcp/eth0"} and "intra-node" not in tables[host]
    sent, received = (int(after) - int(b) for after, b in zip(hosts("bytes", "node2").split(), before))
    records = read_metrics(tmp_path / "run")
    assert received >= sum(r["bytes"]["wire_down"] for r in records)  # the broadcasts, to node2's one rank
    assert sent >= sum(r["bytes"]["wire_up"] for r in records)  # every upload came from node2


# ---------------------------------------------------------------- the same numbers on any hosts

def placement_free(run: Path) -> tuple[list[dict], dict[str, str]]:
    """What a run computed, whatever its ranks and hosts: ``metrics.jsonl`` less timings and the MPI framing bytes,
    and each tensor of its last checkpoint by what it belongs to (the server, or a client id), not by rank file."""
    fingerprint = launch_script("fingerprint")
    records = [fingerprint.untimed(r) for r in read_metrics(run)]
    for record in records:
        record["bytes"] = {k: record["bytes"][k] for k in ("down", "up")}
    done = json.loads((run / "checkpoint" / "meta.json").read_text())["round"]
    states = {}
    for path in sorted((run / "checkpoint" / f"round-{done}").iterdir()):
        if path.suffix == ".zip":
            with zipfile.ZipFile(path) as archive:
                items = [(name, archive.read(name)) for name in archive.namelist()]
        else:
            items = [(path.name, path.read_bytes())]
        for name, data in items:
            digest = hashlib.sha256()
            fingerprint._hash_state(digest, name, torch.load(io.BytesIO(data), weights_only=True))
            states.setdefault(name, set()).add(digest.hexdigest())  # adopted.pt: one per rank, all alike
    return records, states


THREE_HOSTS = {"node1": 2, "node2": 1, "node3": 1}  # rank 0 (the server) and rank 1 on node1
TWO_HOSTS = {"node1": 2, "node2": 2}


@pytest.mark.parametrize("algo,layout", [("fedavg", THREE_HOSTS), ("fedbn", THREE_HOSTS), ("scaffold", THREE_HOSTS),
                                         ("gperxan", TWO_HOSTS), ("fednova", TWO_HOSTS)])
def test_a_job_across_hosts_computes_what_one_host_does(up, data_root, tmp_path, algo, layout):
    """FedNova gathers what its clients trained (their step counts) before it aggregates; SCAFFOLD and FedBN keep
    state on the client ranks; gPerXAN keeps its BN side personal."""
    fingerprint = launch_script("fingerprint")
    one = run_here(*map(str, fingerprint.run_args(algo, data_root, tmp_path / "one", tmp_path / "no-style-model")))
    assert one.returncode == 0, one.stderr
    job = across(layout, *map(str, fingerprint.run_args(algo, data_root, tmp_path / "hosts", tmp_path / "none")))
    assert job.returncode == 0, job.stderr
    assert placement_free(tmp_path / "hosts") == placement_free(tmp_path / "one")
    ranks = [line.split(" on ")[1].split(",")[0] for line in (tmp_path / "hosts" / "log.txt").read_text().splitlines()
             if line.startswith("rank ")]
    assert ranks == [host for host, n in layout.items() for _ in range(n)]  # where each rank ran
    files = {run: sorted(p.name for p in (tmp_path / run).iterdir()) for run in ("hosts", "one")}
    assert files["hosts"] == files["one"]
    for host in up:  # the launcher's daemons and every rank are gone
        wait_for(lambda: not processes(host), 10, f"{host}'s processes to end: {processes(host)}")


# ---------------------------------------------------------------- node-local things

NODE_PROBE = """
import json, os, socket, sys
import torch
from mpi4py import MPI
from mpifl.client.devices import pick_device
from mpifl.transport.mpi import MpiComm

torch.cuda.is_available = lambda: True  # pretend: two GPUs on every node
torch.cuda.device_count = lambda: 2
layout = MpiComm().node_layout()
local = os.environ.get("MPI_LOCALRANKID", os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK"))
with open(f"{sys.argv[1]}/rank-{MPI.COMM_WORLD.rank}.json", "w") as f:
    json.dump({"host": socket.gethostname(), "node_ranks": layout.node_ranks, "index": layout.client_index,
               "device": str(pick_device("auto", layout)) if MPI.COMM_WORLD.rank else None,
               "launcher_local_rank": int(local)}, f)
"""


def test_each_client_rank_binds_a_gpu_of_its_own_node(up, tmp_path):
    """1, 2 and 3 ranks on node1..3 (rank 0, the server, alone on node1): each client rank's GPU is its index among
    its node's client ranks, modulo the node's GPUs, as the launcher's own node-local rank says."""
    probe = tmp_path / "probe.py"
    probe.write_text(NODE_PROBE)
    job = across({"node1": 1, "node2": 2, "node3": 3}, str(tmp_path), script=probe, timeout=120)
    assert job.returncode == 0, job.stderr
    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(6)]
    assert [r["host"] for r in ranks] == ["node1", "node2", "node2", "node3", "node3", "node3"]
    assert [r["node_ranks"] for r in ranks] == [[0], [1, 2], [1, 2], [3, 4, 5], [3, 4, 5], [3, 4, 5]]
    assert [r["index"] for r in ranks] == [-1, 0, 1, 0, 1, 2]
    assert [r["launcher_local_rank"] for r in ranks] == [0, 0, 1, 0, 1, 2]
    assert [r["device"] for r in ranks] == [None, "cuda:0", "cuda:1", "cuda:0", "cuda:1", "cuda:0"]


def test_a_run_directory_that_the_nodes_do_not_share_is_refused_and_left_as_it_was(up, data_root):
    """``--out`` on node-local disk (each host's TMPDIR): the client rank on node2 sees no run directory, and the
    client ranks write their part of each checkpoint into it; refused in one line, rank 0's new directory removed."""
    run = "/run/mpifl-hosts/node-tmp/run"  # every host's own tmpfs at this path
    job = across({"node1": 2, "node2": 1}, "--data-root", str(data_root), *TINY, "--rounds", "1", "--out", run,
                 timeout=120)
    assert job.returncode == 2
    pid = re.search(r"rank 2 \(pid (\d+) on node2\)", job.stderr)
    assert job.lines("mpifl: ") == [f"mpifl: error: --out {run} is not on a file system that every node shares: rank "
                                    f"2 (pid {pid.group(1)} on node2) cannot see the config.json rank 0 wrote there "
                                    "(on node1), and the client ranks write their part of each checkpoint into it; "
                                    "pass an --out on a shared file system"], job.stderr
    assert run_on("node1", f"ls {run} 2>/dev/null; echo end") == "end\n"


# ---------------------------------------------------------------- a node lost

def spilled(host: str) -> list[str]:
    """The ranks whose private-state spill folders lie in ``host``'s TMPDIR ('node2-rank2', ...)."""
    return sorted(re.sub(r"^mpifl-private-(.*-rank\d+)-.*$", r"\1", name)
                  for name in run_on(host, 'ls "$TMPDIR"').split() if name.startswith("mpifl-private-"))


def lost_run_args(data_root: Path, run: Path) -> list[str]:
    return ["--data-root", str(data_root), *TINY, "--algo", "fedbn", "--rounds", "4", "--ckpt-every", "1",
            "--private-memory", "0", "--peer-timeout", str(PEER_TIMEOUT), "--out", str(run)]


@pytest.fixture(scope="module")
def uninterrupted(data_root, tmp_path_factory) -> tuple[list[dict], dict[str, str]]:
    run = tmp_path_factory.mktemp("uninterrupted") / "run"
    job = run_here(*lost_run_args(data_root, run))
    assert job.returncode == 0, job.stderr
    return placement_free(run)


def ranks_on(host: str) -> list[str]:
    """mpifl's processes on ``host`` (a launcher's command line may name mpifl.run too: not counted)."""
    return [line for line in processes(host) if Path(line.split()[1]).name.startswith("python")
            and "mpifl.run" in line]


class Output:
    """A process's standard error, line by line as it comes, each with the time it came."""

    def __init__(self, process: subprocess.Popen):
        self.lines: list[tuple[float, str]] = []
        self._reader = threading.Thread(target=self._read, args=(process.stderr,), daemon=True)
        self._reader.start()

    def _read(self, stream) -> None:
        for line in stream:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def first(self, prefix: str) -> tuple[float, str] | None:
        return next(((t, line) for t, line in self.lines if line.startswith(prefix)), None)

    def text(self) -> str:
        self._reader.join(5)
        return "\n".join(line for _, line in self.lines)


@pytest.mark.parametrize("loss", ["kill", "cut"])
def test_a_node_lost_ends_the_job_in_bounded_time_and_the_run_resumes_on_the_node_that_remains(up, data_root, tmp_path,
                                                                                               uninterrupted, loss):
    """Rank 2, alone on node2, stops in round 3 (an injected hang: it keeps answering heartbeats) and node2 is then
    killed (every process at once) or cut off (its link down).

    Killed: the launcher sees it at once and ends the job, before any rank can say a word (MPICH's with its own
    lines, Open MPI's naming the node).  Cut off: nothing tells anyone; after --peer-timeout rank 0 names rank 2 and
    node2, once, ends its ranks (MPI_Abort), and rank 2 ends itself a quarter later.  MPICH's launcher ends with
    rank 0's abort; Open MPI's waits for its daemon on node2 until TCP gives up on it (docs/clusters.md), which the
    link mended ends at once.  Either way the checkpoint of round 1 (round 2's was never committed: rank 2 never
    answered round 3's message) is intact, no process is left on any host, and the run resumes on node1 alone with
    the uninterrupted numbers; node-local spill folders stayed on their nodes, and the one a dead rank left on
    node1 is swept by the resumed run."""
    run = tmp_path / "run"
    command, env = on_node1({"node1": 2, "node2": 1}, "-m", "mpifl.run", *lost_run_args(data_root, run),
                            env={"MPIFL_FAULT": "hang:rank=2,round=3"})
    job = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=REPO, env=env)
    output = Output(job)
    try:
        wait_for(lambda: spilled("node2") and spilled("node1") and (run / "checkpoint" / "round-2").is_dir(), 180,
                 "rank 2 to stop in round 3, each node's client ranks having spilled")
        assert (spilled("node1"), spilled("node2"), spilled("node3")) == (["node1-rank1"], ["node2-rank2"], [])
        assert not any(Path("/run/mpifl-hosts/node-tmp").iterdir())  # node-local: nothing seen from outside
        lost_at = time.monotonic()
        hosts(loss, "node2")
        if loss == "kill":  # the launcher itself ends the job at once; no rank has time to say anything
            job.wait(10)
            assert not [line for _, line in output.lines if line.startswith("mpifl: ")], output.text()
            # Hydra fails an assertion; Open MPI's prterun ends 255 or 0 (as if the job had completed)
            assert job.returncode in ((0, 255) if open_mpi() else (255,)), output.text()
            if open_mpi():
                assert "PRTE has lost communication with a remote daemon" in output.text()
                assert "Remote daemon: " in output.text() and "on node node2" in output.text()
        else:  # no word from node2: rank 0 says so after --peer-timeout, then ends the job (MPI_Abort)
            said_at, said = wait_for(lambda: output.first("mpifl: "), PEER_TIMEOUT + 4, "rank 0's line")
            # rank 2's last heartbeat came before the cut, by up to an interval (0.6 s) and rank 0's pass to take it
            assert PEER_TIMEOUT - 1 <= said_at - lost_at < PEER_TIMEOUT + 3
            pid = re.search(r"rank 2 \(pid (\d+) on node2", (run / "log.txt").read_text()).group(1)
            rank0 = re.search(r"rank 0 \(pid (\d+) on node1", (run / "log.txt").read_text()).group(1)
            assert said == (f"mpifl: error: lost rank 2 (pid {pid} on node2): nothing heard from it for over "
                            f"{PEER_TIMEOUT} s (--peer-timeout {PEER_TIMEOUT}): its node failed or is cut off the "
                            f"network; the checkpoint after round 1 is intact: continue with --resume {run} on the "
                            "nodes that remain")
            assert (run / "log.txt").read_text().splitlines()[-1] == said
            wait_for(lambda: not ranks_on("node1"), 5, f"node1's ranks to end: {ranks_on('node1')}")
            # rank 2 gives rank 0 a quarter more, then tries MPI_Abort, which cannot reach the launcher: it ends
            # by itself after ABORT_SECONDS (10)
            wait_for(lambda: not ranks_on("node2"), PEER_TIMEOUT * 1.25 + 13 - (time.monotonic() - lost_at),
                     f"node2's ranks to end: {ranks_on('node2')}")
            if open_mpi():
                hosts("mend", "node2")
            job.wait(60 if open_mpi() else max(1, said_at + 5 - time.monotonic()))
            # prterun: rank 0's 69, or 1 or 0 when it noticed the lost daemon first (docs/clusters.md)
            assert job.returncode in ((69, 1, 0) if open_mpi() else (69,))
            # rank 2's own line, that it lost the server, reaches node1 only once the link is back (Open MPI's)
            lines = [line for _, line in output.lines if line.startswith("mpifl: ")]
            theirs = (f"mpifl: error: rank 2 (pid {pid} on node2) lost the server, rank 0 (pid {rank0} on node1): "
                      f"nothing heard from it for over {PEER_TIMEOUT * 1.25:g} s (--peer-timeout {PEER_TIMEOUT}): "
                      "its node or this one failed or is cut off the network; this rank ends")
            assert lines[0] == said and lines[1:] in ([], [theirs]), output.text()
    finally:
        if job.poll() is None:
            job.kill()
    assert json.loads((run / "checkpoint" / "meta.json").read_text())["round"] == 1
    for host in ("node1", "node2"):
        if loss == "cut" or host == "node1":
            wait_for(lambda: not processes(host), 10, f"{host}'s processes to end: {processes(host)}")
    assert spilled("node1") == ["node1-rank1"]  # rank 1 did not end its run: its folder stays, unheld
    resumed = across({"node1": 2}, "--resume", str(run), timeout=180)
    assert resumed.returncode == 0, resumed.stderr
    assert "its clients were on 2 client ranks, now placed on 1" in resumed.stdout
    assert placement_free(run) == uninterrupted
    assert spilled("node1") == []  # the dead rank's folder swept, the resumed rank's own removed at its end


def test_a_node_lost_as_the_job_ends_does_not_keep_it_running(up, data_root, tmp_path):
    """node2 cut off once every result is written (summary.md), rank 0 held at the end of its part for a moment
    (an injected pause, as a busy file system would; the cut then comes before the ranks' goodbyes).  Before, every
    rank waited in the MPI library's finalization for the lost node, the heartbeats over, and the job ran on (200 s
    and more).  Now rank 0 hears nothing from rank 2 while they say goodbye: after --peer-timeout it says so, once,
    and ends the job with its own exit code, 0, the results all written (MPICH's Hydra ends with rank 0's abort at
    once; Open MPI's prterun ends its ranks as promptly, and itself once it gives up on its daemon on node2, here
    once the link is mended); rank 2, cut off, ends by itself."""
    run = tmp_path / "run"
    args = ["--data-root", str(data_root), *TINY, "--rounds", "2", "--peer-timeout", str(PEER_TIMEOUT), "--out",
            str(run)]
    command, env = on_node1({"node1": 2, "node2": 1}, "-m", "mpifl.run", *args,
                            env={"MPIFL_FAULT": "pause:rank=0,round=4"})  # round R + 2: rank 0's part ends
    job = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=REPO, env=env)
    output = Output(job)
    try:
        wait_for(lambda: (run / "summary.md").exists(), 180, "the run's summary.md")
        hosts("cut", "node2")
        cut_at = time.monotonic()
        said_at, said = wait_for(lambda: output.first("mpifl: "), PEER_TIMEOUT + 6, "rank 0's line")
        assert PEER_TIMEOUT - 1 <= said_at - cut_at < PEER_TIMEOUT + 3  # rank 2's last heartbeat: before the cut
        pid = re.search(r"rank 2 \(pid (\d+) on node2", (run / "log.txt").read_text()).group(1)
        assert said == (f"mpifl: warning: lost rank 2 (pid {pid} on node2) as the job ended: nothing heard from it for "
                        f"over {PEER_TIMEOUT} s (--peer-timeout {PEER_TIMEOUT}): its node failed or is cut off the "
                        f"network; every result is written ({run}); the job ends without it")
        assert (run / "log.txt").read_text().splitlines()[-1] == said
        wait_for(lambda: not ranks_on("node1"), 5, f"node1's ranks to end: {ranks_on('node1')}")
        if not open_mpi():
            job.wait(max(1, said_at + 3 - time.monotonic()))
        # rank 2 waits a quarter longer for rank 0's goodbye, then ends by itself (its abort reaches no launcher)
        wait_for(lambda: not ranks_on("node2"), PEER_TIMEOUT * 1.25 + 13 - (time.monotonic() - cut_at),
                 f"node2's ranks to end: {ranks_on('node2')}")
        if open_mpi():
            hosts("mend", "node2")
            job.wait(60)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0, output.text()
    # rank 2's own line reaches node1 only once the link is back (Open MPI's)
    rank0 = re.search(r"rank 0 \(pid (\d+) on node1", (run / "log.txt").read_text()).group(1)
    theirs = (f"mpifl: warning: rank 2 (pid {pid} on node2) lost the server, rank 0 (pid {rank0} on node1), as the "
              f"job ended: nothing heard from it for over {PEER_TIMEOUT * 1.25:g} s (--peer-timeout {PEER_TIMEOUT}): "
              "its node or this one failed or is cut off the network; this rank ends")
    assert [line for _, line in output.lines if line.startswith("mpifl: ")] in ([said], [said, theirs])
    assert read_metrics(run)[-1]["round"] == 2
    for host in ("node1", "node2"):
        wait_for(lambda: not processes(host), 10, f"{host}'s processes to end: {processes(host)}")


# ---------------------------------------------------------------- Slurm over two nodes

SLURM_CONF = "/var/tmp/mpifl-slurm-hosts/slurm.conf"  # launch/local-slurm.sh start-hosts writes it


def slurm(*args: str) -> str:
    """A Slurm client command, run on node1 (this machine's network does not reach the hosts')."""
    return hosts("run", "node1", "env", f"SLURM_CONF={SLURM_CONF}", *args)


@pytest.fixture(scope="module")
def slurm_on_hosts(nodes):
    """A Slurm whose nodes are the three hosts (launch/local-slurm.sh start-hosts), stopped afterwards."""
    if open_mpi():
        pytest.skip("srun starts MPICH's ranks here (PMI-2); the Open MPI rerun covers its own launcher")
    if not shutil.which("slurmd"):
        message = "Slurm is not installed (launch/local-slurm.sh start installs Debian's)"
        if os.environ.get("MPIFL_REQUIRE_SLURM") == "1":
            pytest.fail(message)
        pytest.skip(message)
    all_up()  # set up before the test's own fixtures: a test before may have killed or cut a host
    start = subprocess.run([str(REPO / "launch" / "local-slurm.sh"), "start-hosts"], capture_output=True, text=True,
                           timeout=300)
    assert start.returncode == 0, start.stderr
    yield
    subprocess.run([str(REPO / "launch" / "local-slurm.sh"), "stop-hosts"], capture_output=True, timeout=120)


def job_field(job: str, field: str) -> str:
    return re.search(rf"\b{field}=(\S*)", slurm("scontrol", "show", "job", job)).group(1)


def test_slurm_runs_a_script_over_two_nodes_and_a_job_whose_node_fails_resumes_on_others(slurm_on_hosts, up, data_root,
                                                                                         tmp_path):
    """``sbatch -N 2 slurm/styledigits.sh``: its six ranks on two nodes, three each.  Its second node killed after
    a checkpoint: Slurm declares the node down (SlurmdTimeout), requeues the job (the script's --requeue), which
    runs on the two nodes left and resumes the run from its checkpoint, ending with the uninterrupted numbers.
    (This Slurm declares a node down after 6 s and kills a job's processes 5 s after asking them to end.)"""
    extra = ("--model", "smallcnn", "--rounds", "5", "--local-epochs", "1", "--samples-per-client", "320",
             "--threads", "1")
    reference = run_here("--data-root", str(data_root), "--algo", "fedavg", "--batch-size", "32", "--lr", "0.01",
                         "--ckpt-every", "1", *extra, "--out", str(tmp_path / "uninterrupted"))  # the script's options
    assert reference.returncode == 0, reference.stderr
    job = slurm("env", "-C", str(tmp_path), f"MPIFL_VENV={Path(sys.executable).parent.parent}",
                f"MPIFL_DATA_ROOT={data_root}", f"MPIFL_RUNS={tmp_path / 'runs'}", "MPIFL_CKPT_EVERY=1",
                f"MPIFL_ARGS={' '.join(extra)}", "sbatch", "--parsable", "-N", "2", "--ntasks-per-node=3",
                str(REPO / "slurm" / "styledigits.sh")).strip()
    run = tmp_path / "runs" / f"mpifl-styledigits-{job}"
    try:
        wait_for(lambda: (run / "checkpoint" / "meta.json").is_file(), 120, "the job's first checkpoint")
        first, second = re.fullmatch(r"node\[?(\d)[,-](\d)\]?", job_field(job, "NodeList")).groups()
        assert job_field(job, "BatchHost") == f"node{first}"
        hosts("kill", f"node{second}")
        wait_for(lambda: job_field(job, "JobState") == "COMPLETED", 240, f"job {job} to be requeued and complete")
    finally:
        slurm("scancel", job)
    assert job_field(job, "Restarts") == "1" and f"node{second}" not in job_field(job, "NodeList")
    output = (tmp_path / f"slurm-{job}.out").read_text()
    assert re.search(r"mpifl-slurm: job \d+ restart 1 on node", output) and "resuming after round" in output
    assert placement_free(run) == placement_free(tmp_path / "uninterrupted")
