"""``python -m mpifl.bench``: the simulator's own cost next to the training it runs, and its memory with
many clients.

``--case cross-silo`` (the default) runs the same local SGD steps four ways and reports seconds per round:

(a) **bare**: one Python process, a plain PyTorch loop over the clients of a
    round (same data, model, batches, optimizer) plus the weighted average
    of their weights by mpifl's own cache-blocked sum (a naive
    ``sum(w * state.double())`` takes 1.6 s a round for 10 DigitModels,
    six times as long, and would flatter the simulator): the floor for
    this machine;
(b) **mpifl with 1 client rank**: ``mpirun -n 2 python -m mpifl.run``;
(c) **mpifl with 2 client ranks**: ``mpirun -n 3 ...``;
(d) **mpifl in one process**: ``python -m mpifl.run`` with no launcher, the
    server and one client host as threads over the in-process transport
    (the same work as (b) without MPI).

Round times of the simulator come from its own ``metrics.jsonl``
(``seconds.round``, rank 0's wall clock from broadcast to aggregated), the
first round of every run dropped as warm-up; evaluation runs only after the
last round and is excluded, as is process start-up.  ``--repeats`` runs
every way again in turn, so slow phases of a shared machine hit all
of them alike; the figures are medians over every measured round, and the
ratio is also given for the fastest round of each (on a noisy virtual
machine, whose rounds vary by 10 %, the least disturbed estimate).

The speedup 1 -> 2 ranks can only reach what the placement allows: the
largest rank load with one rank over the largest with two (5 equal clients
split 3:2 cap it at 1.67x).  The default ``--clients-per-domain 2`` gives
the 5-domain default data 10 equal clients, an even split, so the measured
speedup shows the simulator's cost rather than the placement's; the
bound and the parallel efficiency (speedup / bound) are reported alongside.

The ratio of each way to the **placement's bound** is what the simulator adds
to the training it cannot avoid: the bound with k client ranks is the bare
loop run as the placement runs the clients, k processes at once, each over
one rank's clients, a round lasting as long as the slowest (on a machine
whose cores slow each other down this is more than the one-process loop
divided by the speedup bound).  Each placed loop averages only its own clients, while rank 0 folds every
client's upload: the ratio is also given to the **placed loops' training plus one fold of all clients on one
core** (the bare loop's own fold, timed in it), the work no placement of the clients can spread.
``--eval-every 1`` evaluates every round,
in the bare loop the same global model on every client's val and test
splits.

``--case many-clients`` runs ``--algos`` with ``--clients-per-domain`` clients per domain (1,000 on the
5-domain default data with 200), each ``--fractions`` of them per round, under ``mpirun`` with
``--client-ranks`` client ranks, and reports seconds per round and every rank's peak resident memory (the
runs' own ``memory.peak_rss``), and rank 0's peak at each fraction against the smallest (the clients of a
round do not pass through rank 0's memory at once: aggregation is a reduction).

``--case dp-sgd`` times one client's DP-SGD local training, mpifl's against a bare Opacus loop
(:func:`dp_sgd_round_seconds`).

``--case secagg`` runs ``--algo`` under ``mpirun`` with each of ``--client-ranks`` counts, with and without
``--secure-aggregation`` (``--secagg-bits``), in turn ``--repeats`` times, and reports seconds per round of each,
their ratio, their split (the clients' masking is in their compute, rank 0's modular fold and dequantization in
aggregation) and the bytes up: what secure aggregation's fixed point and pairwise masks cost a round.

``--case fold`` times rank 0's fold alone: ``--fold-clients`` float32 uploads of ``--fold-mb`` MB (12 x 45 MB,
ResNet-18's, by default) added into their float64 weighted mean on each of ``--fold-threads`` counts of threads
(:class:`~mpifl.server.folding.FoldThreads`: the caller's thread and pool threads), all at once and one client at
a time (as the server folds each behind the next one's arrival), and checks that every count gives the
same bits.  A repeat during which other
processes took CPU (``/proc/stat``) is redone, so on a shared machine the medians are of undisturbed repeats.
``--fold-threads N`` passes the count to the runs of ``--case cross-silo``.

Every option is checked before anything runs (a bad value, or an option the case does not read, is refused in
one line, as are the runs' options by mpifl.run's own rules); the table is printed, then the results go into a new
JSON file, never over another: ``--json-out FILE`` (refused if it exists), or a new ``<case>-<time>.json`` in a
folder, by default ``runs/bench`` (with ``_1``, ``_2``, ... while the name is taken).  A write that fails prints the
results' JSON on one line instead.  This is a benchmark, not a test: it asserts nothing.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import multiprocessing
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import click
import numpy as np
import torch
import torch.nn.functional as F
from click.core import ParameterSource

from .algorithms import ALGORITHMS
from .algorithms.core.reduction import Reduction, mean_weights, weighted_sum
from .client.client_data import load_client_data
from .client.training import client_round, evaluate, load_state
from .data import default_data_root, ensure_dataset
from .errors import MpiflError, OneLine
from .job.cli import configuration, usage_line
from .models import build_model
from .plan.config import RunConfig
from .plan.placement import place_clients
from .plan.seeding import seed_model_init
from .process.world import own_mpirun
from .rundir.names import LOG, METRICS
from .server.folding import Folding, FoldThreads
from .server.tracking.live import check_installed, tracking_cost
from .session.session import Session, make_session


def bare_round_seconds(session: Session, rounds: int, epochs: int, batch_size: int, lr: float, threads: int,
                       device: torch.device, eval_every: int = 0,
                       only: list[int] | None = None) -> list[tuple[float, float]]:
    """Seconds per round of a plain single-process FedAvg loop over the session's clients (``only``: those
    ids), and of its fold (the weighted average) within it; every ``eval_every`` rounds (0: never) it first
    evaluates the global model on every client's val and test."""
    torch.set_num_threads(threads)
    manifest, clients, model_name = session.manifest, session.clients, session.cfg.model
    clients = [c for c in clients if only is None or c.id in only]
    tensors = load_client_data(session.cfg.data_root, manifest, clients, device)
    seed_model_init(0)
    model = build_model(model_name, num_classes=manifest.num_classes, in_channels=manifest.channels,
                        image_size=tuple(manifest.image_size)).to(device)
    global_state = {k: v.clone() for k, v in model.state_dict().items()}
    times = []
    for r in range(rounds):
        start = time.perf_counter()
        if eval_every and r > 0 and r % eval_every == 0:
            model.load_state_dict(global_state)
            for client in clients:
                for split in ("val", "test"):
                    evaluate(model, tensors[client.id], split, session.cfg.eval_batch_size)
        states, sizes = [], []
        for client in clients:
            model.load_state_dict(global_state)
            model.train()
            optimizer = torch.optim.SGD(model.parameters(), lr=lr)
            rng = np.random.default_rng([r, client.id])
            for _ in range(epochs):
                for x, y in tensors[client.id].train_batches(rng, batch_size):
                    optimizer.zero_grad(set_to_none=True)
                    F.cross_entropy(model(x), y).backward()
                    optimizer.step()
            states.append({k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()})
            sizes.append(client.num_train)
        weights = [n / sum(sizes) for n in sizes]
        folding = time.perf_counter()
        global_state = {k: torch.from_numpy(weighted_sum([s[k].numpy() for s in states], weights)).to(v.dtype)
                        if v.is_floating_point() else v for k, v in states[0].items()}
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        end = time.perf_counter()
        times.append((end - start, end - folding))
    return times


def placed_bare_rounds(client_ranks: int, sizes: list[int], run_args: list[str],
                       loop_args: tuple) -> list[tuple[float, float]]:
    """Seconds per round of the bare loop run as the placement runs the clients: one process per client
    rank, all at once, each over that rank's clients; a round lasts as long as its slowest process.  On a
    machine whose cores slow each other down (shared caches, memory bandwidth, hyperthreads) this, not the
    one-process loop divided by the speedup bound, is what the placement allows.  With each round's seconds,
    those of its slowest training (each process's round less its own fold).  ``sizes``: the clients'
    training samples, as placed; ``run_args``: mpifl.run's options, whose session each process builds
    (:func:`checked_session`)."""
    hosts = place_clients(sizes, client_ranks)
    with multiprocessing.get_context("spawn").Pool(client_ranks) as pool:
        per_host = pool.starmap(_bare_on_host, [(run_args, loop_args, host) for host in hosts])
    return [(max(s for s, _ in rounds), max(s - fold for s, fold in rounds)) for rounds in zip(*per_host)]


def _bare_on_host(run_args: list[str], loop_args: tuple, clients: list[int]) -> list[tuple[float, float]]:
    return bare_round_seconds(checked_session(run_args, 1), *loop_args, only=clients)


def simulator_rounds(client_ranks: int | None, data_root: str, data: str, model_name: str, rounds: int, epochs: int,
                     batch_size: int, lr: float, threads: int, clients_per_domain: int, samples_per_client: int,
                     device: str, out: Path, eval_every: int = 0, extra: tuple[str, ...] = (),
                     mpirun: str | None = None) -> list[dict]:
    """Each round's record (seconds, bytes, memory) from a real run of mpifl.run: under ``mpirun`` (a command
    line; default: the one beside this Python, :func:`~mpifl.process.world.own_mpirun`, else PATH's) with
    ``client_ranks`` client ranks, or in one process (None); ``eval_every`` 0: evaluate after the last round
    only; ``extra``: more options of mpifl.run."""
    launcher = [] if client_ranks is None else [*launcher_command(mpirun), "-n", str(client_ranks + 1)]
    cmd = [*launcher, sys.executable, "-m", "mpifl.run", "--out", str(out),
           *run_arguments(data_root, data, model_name, rounds, epochs, batch_size, lr, threads, clients_per_domain,
                          samples_per_client, device, eval_every, extra)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        said = proc.stderr.strip().splitlines()[-1:] or ["nothing on stderr"]
        how = "in one process" if client_ranks is None else f"with {client_ranks} client rank(s)"
        raise MpiflError(f"the benchmark's run of mpifl.run {how} failed (exit {proc.returncode}): {said[0]}")
    return [json.loads(line) for line in (out / METRICS).read_text().splitlines()]


def tracking_summary(rounds: list[dict], costs: list[dict | None], untracked: float) -> dict:
    """Tracked runs' median seconds per round against the untracked ones' (``untracked``), and what their
    ``log.txt`` says tracking cost per record (one a round: :func:`~mpifl.server.tracking.live.tracking_cost`),
    the median over the runs, summed as a share of an untracked round."""
    seconds = statistics.median(r["seconds"]["round"] for r in rounds)
    known = [c for c in costs if c]
    cpu = {name: statistics.median(c.get(name, 0.0) for c in known) for name in known[0]} if known else {}
    return {"seconds_per_round": seconds, "ratio_to_untracked": seconds / untracked, "cpu": cpu,
            "share_of_round": sum(cpu.values()) / untracked}


def compared_summary(rounds: list[dict], plain: list[dict]) -> dict:
    """``--compare``'s runs' rounds against the plain runs' (``plain``): median seconds per round and their ratio,
    the ratio of the fastest rounds, the median split and each client rank's idle share."""
    seconds = statistics.median(r["seconds"]["round"] for r in rounds)
    return {"seconds_per_round": seconds,
            "ratio_to_plain": seconds / statistics.median(r["seconds"]["round"] for r in plain),
            "ratio_of_fastest_rounds": (min(r["seconds"]["round"] for r in rounds)
                                        / min(r["seconds"]["round"] for r in plain)),
            "split": {f: statistics.median(r["seconds"][f] for r in rounds) for f in SPLIT},
            "client_idle_share": idle_shares(rounds),
            "rounds_measured": [r["seconds"]["round"] for r in rounds]}


def idle_shares(rounds: list[dict]) -> list[float]:
    """Each client rank's idle share of the wall time: the median over ``rounds`` of 1 - (its compute + its
    evaluation) / rank 0's round (``rank_seconds``; its time in the transport counts as idle)."""
    ranks = len(rounds[0]["rank_seconds"]["compute"])
    return [statistics.median(max(0.0, 1 - (r["rank_seconds"]["compute"][k] + r["rank_seconds"]["evaluation"][k])
                                  / r["seconds"]["round"]) for r in rounds) for k in range(ranks)]


def compare_options(text: str) -> list[str]:
    """``--compare``'s options as mpifl.run's arguments; a string a shell would not split is one line."""
    try:
        return shlex.split(text)
    except ValueError as exc:
        raise MpiflError(f"--compare {text}: {exc}; quote it as a shell would") from None


def run_arguments(data_root: str, data: str, model_name: str, rounds: int, epochs: int, batch_size: int, lr: float,
                  threads: int, clients_per_domain: int, samples_per_client: int, device: str, eval_every: int = 0,
                  extra: tuple[str, ...] = ()) -> list[str]:
    """The options of mpifl.run that :func:`simulator_rounds` passes (all but ``--out``)."""
    return ["--data-root", data_root, "--data", data, "--model", model_name, "--rounds", str(rounds),
            "--local-epochs", str(epochs), "--batch-size", str(batch_size), "--lr", str(lr),
            "--clients-per-domain", str(clients_per_domain), "--samples-per-client", str(samples_per_client),
            "--eval-every", str(eval_every or rounds + 1), "--threads", str(threads), "--device", device, *extra]


def launcher_command(mpirun: str | None) -> list[str]:
    """``--mpirun`` as a command line (default: the mpirun beside this Python, else PATH's)."""
    return shlex.split(mpirun or own_mpirun() or "mpirun")


def speedup_bound(sizes: list[int], client_ranks: int) -> float:
    """Largest rank load (training samples) with 1 client rank over that with ``client_ranks``, under mpifl's
    placement: the most that spreading the clients can gain."""
    return sum(sizes) / max(sum(sizes[c] for c in host) for host in place_clients(sizes, client_ranks))


def wire_bytes(session: Session, measured: dict, client_ranks: int, evaluated: bool = False) -> dict:
    """A round's uploaded bytes against the manifest (``--show-manifest``): on the wire go the manifest's
    tensors of every client, plus per client its ``client.meta`` and the padding to 8 bytes of its gathered
    and of its summed part, per rank its report (``rank.seconds`` and the rest of its fixed record), and,
    when the round's message carried an evaluation (``evaluated``), the scores of every batch of the global model's
    evaluation and of every personal model."""
    clients = len(session.clients)
    per_client = sum(s.nbytes for s in session.algo.policy().upload)
    messages = session.messages()
    evaluation = session.evaluation()
    scores = (messages.scores(len(evaluation.batches)).nbytes
              + messages.eval.nbytes * sum(len(mine) for mine in evaluation.personal))
    metadata = ((messages.client.nbytes + messages.summed.nbytes - per_client) * clients
                + messages.rank.nbytes * client_ranks + (scores if evaluated else 0))
    return {"manifest_up": per_client * clients, "wire_up": measured["wire_up"], "wire_down": measured["wire_down"],
            "matches_manifest": measured["wire_up"] == per_client * clients + metadata}


SPLIT = ("compute", "data", "communication", "waiting", "waiting_cpu", "aggregation", "evaluation")


def many_clients(algos: list[str], fractions: list[float], client_ranks: int, run_options: dict,
                 private_memory: float, out: Path) -> list[dict]:
    """For each method and fraction of clients per round, from a real run under mpirun: seconds per round
    (every round; the first also creates the round's private state) and every rank's peak resident memory
    (rank 0 first)."""
    rows = []
    for algo in algos:
        for fraction in fractions:
            records = simulator_rounds(client_ranks, **run_options, out=out / f"{algo}-{fraction}",
                                       extra=many_clients_options(algo, fraction, private_memory))
            rows.append({"algo": algo, "fraction": fraction, "clients_per_round": len(records[-1]["clients"]),
                         "seconds_per_round": [r["seconds"]["round"] for r in records],
                         "peak_rss_bytes": records[-1]["memory"]["peak_rss"],
                         "wire_up_bytes_per_round": records[-1]["bytes"]["wire_up"]})
    return rows


def many_clients_options(algo: str, fraction: float, private_memory: float) -> tuple[str, ...]:
    """The options of mpifl.run that a many-clients run adds to :func:`run_arguments`'s."""
    return "--algo", algo, "--fraction", str(fraction), "--private-memory", str(private_memory)


def secure_aggregation_rounds(ranks: list[int], run_options: dict, plain: tuple[str, ...], secure: tuple[str, ...],
                              repeats: int, out: Path) -> list[dict]:
    """For each count of client ranks, from real runs under mpirun, without options ``secure`` and with them, in
    turn ``repeats`` times (a slow phase of a shared machine hits both alike): the median seconds per round over
    every measured round (the first of each run is warm-up), its split, the bytes up, and the ratio secure /
    plain."""
    rows = []
    for k in ranks:
        runs = {"plain": [], "secure": []}
        for repeat in range(repeats):
            for way, extra in (("plain", plain), ("secure", secure)):
                runs[way] += simulator_rounds(k, **run_options, out=out / f"{way}-{k}-{repeat}", extra=extra)[1:]
        row = {"client_ranks": k, **{way: {
            "seconds_per_round": statistics.median(r["seconds"]["round"] for r in records),
            "rounds_measured": [r["seconds"]["round"] for r in records],
            "split_seconds": {f: statistics.median(r["seconds"][f] for r in records) for f in SPLIT},
            "wire_up_bytes": records[-1]["bytes"]["wire_up"]} for way, records in runs.items()}}
        row["ratio"] = row["secure"]["seconds_per_round"] / row["plain"]["seconds_per_round"]
        rows.append(row)
    return rows


def secure_aggregation_table(rows: list[dict], options: dict, secure: tuple[str, ...]) -> list[str]:
    """The secagg table: per count of client ranks, both ways' seconds per round, their ratio and split."""
    lines = [(f"{options['model_name']} on {options['data']}, {options['clients_per_domain']} clients per domain, "
              f"batch {options['batch_size']}, {options['rounds']} rounds, {' '.join(secure)} against the same runs "
              "without; median s/round")]
    for row in rows:
        plain, secure_way = row["plain"], row["secure"]
        lines.append(f"  {row['client_ranks']} client rank(s): plain {plain['seconds_per_round']:.3f} s, secure "
                     f"{secure_way['seconds_per_round']:.3f} s, ratio {row['ratio']:.3f}; " + ", ".join(
                         f"{f} {plain['split_seconds'][f]:.3f} -> {secure_way['split_seconds'][f]:.3f} s"
                         for f in ("compute", "communication", "waiting", "aggregation"))
                     + f"; bytes up {plain['wire_up_bytes']:,} -> {secure_way['wire_up_bytes']:,}")
    return lines


def _cpu_of_others() -> float:
    """CPU seconds that every process but this one has used since boot (0 where ``/proc/stat`` is missing)."""
    try:
        with open("/proc/stat") as stat:
            ticks = [int(v) for v in stat.readline().split()[1:]]
    except OSError:
        return 0.0
    own = os.times()
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK") - own.user - own.system


def undisturbed_seconds(run, tries: int = 10) -> tuple[float | None, int]:
    """Seconds of one call of ``run()`` during which other processes took under 5 % of a core (plus a clock
    tick), redone when disturbed, at most ``tries`` calls; returns the seconds (None: every call disturbed) and
    the calls dropped."""
    for dropped in range(tries):
        others, started = _cpu_of_others(), time.perf_counter()
        run()
        seconds = time.perf_counter() - started
        if _cpu_of_others() - others <= 0.05 * seconds + 0.02:
            return seconds, dropped
    return None, tries


def fold_seconds(clients: int, megabytes: float, thread_counts: list[int], repeats: int) -> dict:
    """Rank 0's fold of ``clients`` float32 uploads of ``megabytes`` MB into their float64 weighted mean on each
    of ``thread_counts``: all at once (one window: uploads that waited for rank 0) and one client at a time (as
    each is folded behind the next one's arrival), every count and way in turn in each repeat, so that a slow
    phase of a shared machine hits them alike.  Median seconds over undisturbed repeats, their ratio to the
    first count's, and whether every count gave the first count's bits."""
    rng = np.random.default_rng(0)
    reductions = {"w": Reduction("w", mean_weights(rng.uniform(1, 100, clients)))}
    ways = {"all_at_once": clients, "one_client_at_a_time": 1}
    rows = [{"threads": count, **{name: {"repeats": [], "dropped": 0} for name in ways}} for count in thread_counts]

    def fold(threads: FoldThreads, window: int) -> np.ndarray:
        folding = Folding(reductions, threads)
        for start in range(0, clients, window):
            folding.add(uploads[start:start + window])
        return folding.sums["w"]

    with contextlib.ExitStack() as stack:
        pools = [stack.enter_context(FoldThreads(count)) for count in thread_counts]
        uploads = [{"w": rng.standard_normal(int(megabytes * 1e6) // 4, dtype=np.float32)} for _ in range(clients)]
        for _ in range(repeats):
            for row, threads in zip(rows, pools):
                for name, window in ways.items():
                    seconds, dropped = undisturbed_seconds(lambda: fold(threads, window))
                    row[name]["dropped"] += dropped
                    row[name]["repeats"] += [] if seconds is None else [seconds]
        sums = [fold(threads, clients) for threads in pools]
    for row, bits in zip(rows, sums):
        row["same_bits"] = bool(np.array_equal(bits, sums[0]))
        for name in ways:
            row[name]["seconds"] = statistics.median(row[name]["repeats"]) if row[name]["repeats"] else None
            one, this = rows[0][name]["seconds"], row[name]["seconds"]
            row[name]["ratio_to_first"] = this / one if one and this else None
    return {"clients": clients, "megabytes": megabytes, "rows": rows}


def fold_table(result: dict) -> list[str]:
    """The fold case's table: per core count, each way's median seconds and ratio to the first count's."""
    lines = [(f"fold of {result['clients']} x {result['megabytes']:g} MB float32 uploads into float64 sums "
              f"({len(os.sched_getaffinity(0))} cores); median seconds of undisturbed repeats")]
    for row in result["rows"]:
        lines.append(f"  {row['threads']:3d} thread(s): "
                     + "   ".join(_fold_cell(row, name) for name in ("all_at_once", "one_client_at_a_time"))
                     + ("" if row["same_bits"] else "   DIFFERENT BITS"))
    return lines


def _fold_cell(row: dict, name: str) -> str:
    way, label = row[name], name.replace("_", " ")
    if way["seconds"] is None:
        return f"{label}: every repeat disturbed"
    ratio = "" if way["ratio_to_first"] is None else f"x{way['ratio_to_first']:.2f}; "  # none: the first disturbed
    return f"{label} {way['seconds']:.3f} s ({ratio}{len(way['repeats'])} kept, {way['dropped']} disturbed)"


def many_clients_table(rows: list[dict], client_ranks: int, options: dict) -> list[str]:
    """The many-clients table; adds each row's rank-0 peak over its method's smallest fraction's."""
    smallest = {}
    for row in rows:
        smallest.setdefault(row["algo"], row["peak_rss_bytes"][0])
        row["rank0_peak_over_smallest_fraction"] = row["peak_rss_bytes"][0] / smallest[row["algo"]]
    return [(f"{options['model_name']} on {options['data']}, {options['clients_per_domain']} clients per domain, "
             f"batch {options['batch_size']}, {client_ranks} client ranks, {options['rounds']} rounds")] + [
        f"  {row['algo']:<10} C = {row['fraction']:<5} K = {row['clients_per_round']:<5} s/round "
        + ", ".join(f"{s:.1f}" for s in row["seconds_per_round"]) + "   peak GB per rank "
        + " / ".join(f"{b / 1e9:.2f}" for b in row["peak_rss_bytes"])
        + f"   rank 0 x{row['rank0_peak_over_smallest_fraction']:.2f} of its smallest C" for row in rows]


# ---- the results file: checked before anything runs, written after the table is shown, never over another

#: The folder the results go to without ``--json-out``: under ``runs/``, as run directories (ignored by git)
RESULTS_FOLDER = Path("runs") / "bench"


@dataclass(frozen=True)
class ResultFile:
    """Where the results go: ``path``, or the first free ``<stem>_1``, ``_2``, ... beside it if another process
    took that name meanwhile; ``make_folder``: its folder (and those above) may be made when written."""

    path: Path
    make_folder: bool = False


def stamp() -> str:
    """The time in the results' file name, as in a run directory's."""
    return datetime.datetime.now().strftime("%Y%m%d-%H%M%S")


def result_file(json_out: str | None, case: str, started: str) -> ResultFile:
    """``--json-out`` checked by making the file and removing it again: a file that exists is refused (results are
    never overwritten), as is one whose folder is missing or that cannot be made there; a folder (default
    :data:`RESULTS_FOLDER`, made here) gets a new file ``<case>-<started>.json``, ``_1``, ``_2``, ... appended while
    that exists (as :func:`mpifl.rundir.directory.default_run_dir` names run directories)."""
    if json_out is None or os.path.isdir(json_out):
        folder = RESULTS_FOLDER if json_out is None else Path(json_out)
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise MpiflError(f"cannot make the results folder {folder} ({exc.strerror}); pass --json-out a file or "
                             "folder you can write") from None
        target = ResultFile(folder / f"{case}-{started}.json", make_folder=True)
    else:
        path = Path(json_out)
        if not json_out:
            raise MpiflError("--json-out is empty; pass a new file's path, or a folder to make a new file in")
        if os.path.lexists(path):
            raise MpiflError(f"--json-out {path} exists; results are never overwritten: pass a new file name, or a "
                             "folder to make a new file in")
        folder = path if json_out.endswith(os.sep) else path.parent
        if not folder.is_dir():
            problem = ("is a file, not a folder;" if os.path.lexists(folder) else
                       f"does not exist; make it (mkdir -p {folder}) or")
            raise MpiflError(f"--json-out {json_out}: the folder {folder} {problem} pass a path in an existing folder")
        target = ResultFile(path)
    try:
        probe = write_new(target, "")
    except OSError as exc:
        raise MpiflError(f"cannot write the results to {target.path} ({exc.strerror or exc}); pass --json-out a "
                         "path you can write") from None
    probe.unlink()
    return ResultFile(probe, target.make_folder)


def _free(path: Path) -> Path:
    """``path``, or ``<stem>_1<suffix>``, ``_2``, ... while that exists."""
    number, free = 0, path
    while os.path.lexists(free):
        number += 1
        free = path.with_name(f"{path.stem}_{number}{path.suffix}")
    return free


def publish(lines: list[str], result: dict, target: ResultFile) -> None:
    """The table on stdout, then the results into a new file: shown whatever happens to the write; a write that
    fails (the disk full, the folder gone) prints the results' JSON on one line and says what failed."""
    for line in lines:
        click.echo(line)
    text = json.dumps(result, indent=2) + "\n"
    try:
        written = write_new(target, text)
    except OSError as exc:
        click.echo(json.dumps(result))
        raise MpiflError(f"results not written to {target.path} ({exc.strerror or exc}); the table and the JSON line "
                         "above hold them: save that line, then free the disk or fix the folder") from None
    taken = "" if written == target.path else f" ({target.path} was made by another process meanwhile)"
    click.echo(f"results written to {written}{taken}")


def write_new(target: ResultFile, text: str) -> Path:
    """``text`` into a file made for it (``O_EXCL``: never another's), at ``target.path`` or the first free name
    beside it; a partial file of a failed write is removed.  Returns where it went."""
    if target.make_folder:
        target.path.parent.mkdir(parents=True, exist_ok=True)
    path = target.path
    while True:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            break
        except FileExistsError:
            path = _free(target.path)  # taken since it was checked: the next free name beside it
    try:
        with os.fdopen(fd, "w") as file:
            file.write(text)
    except OSError:
        path.unlink(missing_ok=True)
        raise
    return path


# ---- the command line: every value checked before anything runs

#: The options each case reads (beyond --case and --json-out); one given to a case that does not read it is refused
CASE_OPTIONS = {
    "cross-silo": ("data", "data_root", "model_name", "clients_per_domain", "samples_per_client", "client_ranks",
                   "device", "rounds", "repeats", "local_epochs", "batch_size", "lr", "threads", "algo",
                   "eval_every", "mpirun", "fold_threads", "track", "compare"),
    "many-clients": ("data", "data_root", "model_name", "clients_per_domain", "samples_per_client", "client_ranks",
                     "device", "rounds", "local_epochs", "batch_size", "lr", "threads", "algos", "fractions",
                     "private_memory", "mpirun"),
    "fold": ("fold_threads", "fold_clients", "fold_mb", "repeats"),
    "dp-sgd": ("data", "data_root", "model_name", "samples_per_client", "device", "rounds", "local_epochs",
               "batch_size", "lr", "threads", "algo"),
    "secagg": ("data", "data_root", "model_name", "clients_per_domain", "samples_per_client", "client_ranks", "device",
               "rounds", "repeats", "local_epochs", "batch_size", "lr", "threads", "algo", "mpirun", "secagg_bits"),
}


def comma_list(option: str, text: str, item: Callable[[str], object], accepted: str, most: int | None = None) -> list:
    """The items of a comma list option, each through ``item`` (a ValueError says why one is refused), repeats
    dropped, at most ``most``; a bad item, or too many, is refused in one line naming it and what ``option``
    accepts (``accepted``: "give ...")."""
    values = []
    for word in text.split(","):
        try:
            value = item(word.strip())
        except ValueError as exc:
            raise MpiflError(f"{option} {text}: {word.strip()!r} {exc}; {accepted}") from None
        if value not in values:
            values.append(value)
    if most is not None and len(values) > most:
        raise MpiflError(f"{option} {text}: {len(values)} values; {accepted}")
    return values


def whole_number(low: int, high: int | None = None) -> Callable[[str], int]:
    """An item parser: a whole number from ``low`` to ``high`` (None: no bound)."""
    def parse(word: str) -> int:
        try:
            value = int(word)
        except ValueError:
            raise ValueError("is not a whole number") from None
        if value < low or (high is not None and value > high):
            raise ValueError("is out of range")
        return value
    return parse


def share_of_clients(word: str) -> float:
    """An item parser: a finite number in (0, 1]."""
    try:
        value = float(word)
    except ValueError:
        raise ValueError("is not a number") from None
    if not 0 < value <= 1:  # nan and inf too
        raise ValueError("is not in (0, 1]")
    return value


def method_name(word: str) -> str:
    """An item parser: a method's name."""
    if word not in ALGORITHMS:
        raise ValueError("is not a method")
    return word


def check_case_options(ctx: click.Context, case: str) -> None:
    """Refuse options given on the command line that ``case`` does not read (they would change nothing)."""
    unread = [param.opts[0] for param in ctx.command.params
              if param.name not in (*CASE_OPTIONS[case], "case", "json_out")
              and ctx.get_parameter_source(param.name) is ParameterSource.COMMANDLINE]
    if unread:
        reads = ", ".join(param.opts[0] for param in ctx.command.params if param.name in CASE_OPTIONS[case])
        raise MpiflError(f"--case {case} does not read {', '.join(unread)}; drop {'it' if len(unread) == 1 else 'them'}"
                         f" (it reads {reads} and --json-out)")


def check_mpirun(mpirun: str | None) -> None:
    """The launcher's command line parses and its program exists."""
    try:
        command = launcher_command(mpirun)
    except ValueError as exc:
        raise MpiflError(f"--mpirun {mpirun}: {exc}; quote it as a shell would") from None
    if not command:
        raise MpiflError("--mpirun is empty; pass the launcher, e.g. --mpirun /usr/bin/mpirun")
    if shutil.which(command[0]) is None:
        raise MpiflError(f"--mpirun {mpirun}: {command[0]} is not a program found here; pass the launcher's path"
                         if mpirun else "no mpirun beside this Python or on PATH; install an MPI (pip install mpich) "
                                        "or pass --mpirun")


def check_device(device: str) -> None:
    """``--device cuda`` only where a GPU is visible (the bare loop would fail on it after the checks)."""
    if device == "cuda" and not torch.cuda.is_available():
        raise MpiflError("--device cuda was given but no CUDA GPU is visible here; use --device cpu (or auto), or run "
                         "on a GPU node")


def run_config(args: Sequence[str]) -> RunConfig:
    """The configuration mpifl.run makes of ``args``, refused in one line as mpifl.run refuses it, without
    starting it."""
    try:
        return configuration(args)[0]
    except click.ClickException as exc:
        raise MpiflError(f"mpifl.run refuses {' '.join(args)}: {exc.format_message()}") from None


def checked_session(args: Sequence[str], client_ranks: int) -> Session:
    """The session of mpifl.run's ``args`` (every check mpifl.run makes before it starts: options, data, model,
    method), whose clients must give each of ``client_ranks`` one."""
    cfg = run_config(args)
    session = make_session(cfg, ensure_dataset(cfg.data_root, cfg.data), num_hosts=client_ranks)
    if client_ranks > len(session.clients):
        raise MpiflError(f"--client-ranks {client_ranks}: more client ranks than the {len(session.clients)} clients "
                         f"of {cfg.data} with --clients-per-domain {cfg.clients_per_domain}; give fewer ranks or more "
                         "clients")
    return session


def available_memory() -> int | None:
    """Bytes of memory available for new allocations (``MemAvailable``), None where unknown."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def fold_plan(fold_threads: str | None, clients: int, megabytes: float) -> list[int]:
    """The fold case's thread counts (0: one per core this process may run on), each at most those cores, checked
    with its other options and the memory it needs: the uploads, and each count's float64 sums."""
    cores = len(os.sched_getaffinity(0))
    text = fold_threads or ",".join(str(n) for n in sorted({1, min(2, cores), cores}))
    counts = comma_list("--fold-threads", text, whole_number(0, cores), f"give a comma list of thread counts from 1 to "
                        f"{cores} (the cores this process may run on), 0 for all of them")
    counts = list(dict.fromkeys(n or cores for n in counts))
    if clients < 1:
        raise MpiflError(f"--fold-clients must be >= 1, got {clients}")
    if not (math.isfinite(megabytes * 1e6) and megabytes * 1e6 >= 4):
        raise MpiflError(f"--fold-mb must be a finite number of at least 4e-06 (one float32), got {megabytes}")
    upload = int(megabytes * 1e6) // 4 * 4
    needed, available = (clients + 2 * len(counts)) * upload, available_memory()
    if available is not None and needed > available:
        raise MpiflError(f"--case fold needs at least {needed / 1e9:.1f} GB of memory ({clients} uploads of "
                         f"{megabytes:g} MB, and the sums of each of {len(counts)} thread counts), "
                         f"{available / 1e9:.1f} GB are available; lower --fold-mb or --fold-clients")
    return counts


def dp_sgd_case(ctx: click.Context, data_root: str, data: str, model_name: str, samples_per_client: int, device: str,
                rounds: int, epochs: int, batch_size: int, lr: float, threads: int, algo: str, json_out: str | None,
                started: str) -> None:
    """``--case dp-sgd`` (:func:`dp_sgd_round_seconds`): one client, clip 1 and noise 1 (the cost depends on
    neither)."""
    if ctx.get_parameter_source("algo") is not ParameterSource.COMMANDLINE:
        algo = "fedavg-gn"
    on_gpu = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    run_args = run_arguments(data_root, data, model_name, rounds, epochs, batch_size, lr, threads or 1, 1,
                             samples_per_client, "cuda" if on_gpu else "cpu",
                             extra=("--algo", algo, "--dpsgd-clip", "1", "--dpsgd-noise", "1"))
    session = checked_session(run_args, 1)
    target = result_file(json_out, "dp-sgd", started)
    threads = threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    measured = dp_sgd_round_seconds(session, rounds, torch.device("cuda", 0) if on_gpu else torch.device("cpu"))
    result = {"machine": {"platform": platform.platform(), "cores": len(os.sched_getaffinity(0)),
                          "gpu": torch.cuda.get_device_name(0) if on_gpu else None, "torch": torch.__version__},
              "data": data, "model": session.cfg.model, "algo": algo, "batch_size": batch_size,
              "local_epochs": epochs, "device": "cuda:0" if on_gpu else "cpu", "threads": threads, **measured}
    result["ratio_mpifl_to_bare"] = statistics.median(measured["mpifl"]) / statistics.median(measured["bare"])
    publish(dp_sgd_table(result), result, target)


def dp_sgd_round_seconds(session: Session, rounds: int, device: torch.device) -> dict:
    """``--case dp-sgd``: a DP-SGD client's local training in mpifl (:mod:`mpifl.privacy.dp_sgd`) against a bare
    Opacus loop on the same model, data and batch size; seconds of each measured round (the first dropped), and the
    client's size.

    mpifl: :func:`~mpifl.client.training.client_round` of one client, as a client rank runs it each round (the
    method's hooks, Poisson batches indexed on the device, Opacus' hooks attached and removed, the accountant loaded
    from and stored into the client's private state, its epsilon).  Bare: ``PrivacyEngine.make_private`` once (RDP
    accountant, Poisson sampling by its ``DPDataLoader`` over a ``TensorDataset`` of the client's normalized training
    images), then per round the local epochs of ``zero_grad``, cross-entropy, ``backward``, ``step``, and the
    accountant's epsilon once, as mpifl reports it every round.  Both take ceil(n / B) steps an epoch at the run's
    noise and clip, on one device and ``threads`` torch threads, timed round by round in turn, so that slow phases
    of a shared machine hit both alike."""
    from opacus import PrivacyEngine  # the privacy extra, where this case runs
    from torch.utils.data import DataLoader, TensorDataset

    cfg, algo = session.cfg, session.algo
    spec = next(c for c in session.clients if c.trains)
    data = load_client_data(cfg.data_root, session.manifest, [spec], device, input_norm=cfg.input_norm)[spec.id]
    model = session.build_model().to(device)
    slots = model.state_dict()
    client = algo.init_client(spec, session.initial)
    client.private = {k: v.to(device) for k, v in client.private.items()}
    download = {k: session.initial[k].to(device) for k in algo.shared_keys}

    bare = session.build_model().to(device)
    bare.load_state_dict(session.initial)
    images = torch.cat([x for x, _ in data.eval_batches("train", 1024)])
    labels = torch.cat([y for _, y in data.eval_batches("train", 1024)])
    loader = DataLoader(TensorDataset(images, labels), batch_size=cfg.batch_size)
    engine = PrivacyEngine(accountant="rdp")
    bare, optimizer, loader = engine.make_private(
        module=bare, optimizer=torch.optim.SGD(bare.parameters(), lr=cfg.lr), data_loader=loader,
        noise_multiplier=cfg.dpsgd_noise, max_grad_norm=cfg.dpsgd_clip)
    bare.train()

    times = {"mpifl": [], "bare": []}
    for r in range(1, rounds + 1):
        algo.enter_round(r)
        load_state(slots, algo, download, client.private)
        start = time.perf_counter()
        client_round(model, slots, algo, client, data, download, r, cfg)
        times["mpifl"].append(_since(start, device))
        start = time.perf_counter()
        for _ in range(algo.local_epochs()):
            for x, y in loader:
                optimizer.zero_grad(set_to_none=True)
                F.cross_entropy(bare(x), y).backward()
                optimizer.step()
        engine.get_epsilon(1 / spec.num_train)  # as mpifl reports the client's epsilon every round
        times["bare"].append(_since(start, device))
    return {"train_samples": spec.num_train, **{k: v[1:] for k, v in times.items()}}


def _since(start: float, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def dp_sgd_table(result: dict) -> list[str]:
    bare, mpifl = statistics.median(result["bare"]), statistics.median(result["mpifl"])
    return [f"{result['model']} on {result['data']}, --algo {result['algo']}: one client's DP-SGD local training, "
            f"{result['train_samples']} records, batch {result['batch_size']}, {result['local_epochs']} epoch(s); "
            f"{result['device']}, {result['threads']} thread(s); median of {len(result['bare'])} rounds each",
            f"  bare Opacus loop (make_private)  {bare:8.4f} s/round",
            f"  mpifl client_round               {mpifl:8.4f} s/round   ratio to bare {mpifl / bare:5.3f} (fastest "
            f"rounds: {min(result['mpifl']) / min(result['bare']):5.3f})"]


class BenchCommand(click.Command):
    """Click's usage errors and every :class:`MpiflError` as :class:`OneLine`."""

    def make_context(self, info_name, args, parent=None, **extra):
        try:
            return super().make_context(info_name, args, parent, **extra)
        except click.ClickException as exc:
            raise OneLine(f"{usage_line(exc)}; see `python -m mpifl.bench --help`", exc.exit_code) from None

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except MpiflError as exc:
            raise OneLine(str(exc), exc.exit_code) from None


@click.command(cls=BenchCommand, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--case", type=click.Choice(["cross-silo", "many-clients", "fold", "dp-sgd", "secagg"]),
              default="cross-silo", show_default=True,
              help="cross-silo: the simulator's time against a bare loop; many-clients: time and memory with many "
                   "clients; fold: rank 0's fold alone; dp-sgd: a DP-SGD client's local training against a bare "
                   "Opacus loop; secagg: a round with --secure-aggregation against the same without (see the "
                   "module's docstring)")
@click.option("--data", default="styledigits", show_default=True, help="dataset")
@click.option("--data-root", default=None, help="data root (default: MPIFL_DATA_ROOT or ./datasets)")
@click.option("--model", "model_name", default="digitmodel", show_default=True, help="model")
@click.option("--clients-per-domain", default=2, show_default=True,
              help="clients per domain (2: the 5 default domains split evenly over 2 ranks)")
@click.option("--samples-per-client", default=0, show_default=True,
              help="training samples kept per client (0 = all); shortens heavy workloads")
@click.option("--client-ranks", default=None,
              help="cross-silo: comma list of client-rank counts to run mpifl with, each at most the clients (default "
                   "1,2; 1 is always run: the reference); 1,2,4 on a GPU measures ranks sharing it; many-clients: "
                   "one count (default 2)")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True,
              help="where both the bare loop (cuda:0) and the client ranks train")
@click.option("--rounds", default=4, show_default=True, help="rounds per run, at least 2 (the first is warm-up)")
@click.option("--repeats", default=2, show_default=True, help="cross-silo and fold: runs of each way, in turn")
@click.option("--local-epochs", default=1, show_default=True)
@click.option("--batch-size", default=32, show_default=True)
@click.option("--lr", default=0.01, show_default=True)
@click.option("--threads", default=0, show_default=True,
              help="torch threads per process: 0 = mpifl's automatic choice (the bare loop then uses every core); "
                   "1 measures how the simulator scales with ranks at a fixed per-rank cost")
@click.option("--algo", default="fedavg", show_default=True,
              help="cross-silo: the method mpifl runs (the bare loop is FedAvg's); dp-sgd: the same, fedavg-gn unless "
                   "given (DP-SGD refuses batch statistics)")
@click.option("--eval-every", default=0, show_default=True,
              help="cross-silo: evaluate every N rounds, in mpifl and the bare loop alike (0: after the last only)")
@click.option("--algos", default="fedwon,scaffold,singleset", show_default=True,
              help="many-clients: comma list of methods")
@click.option("--fractions", default="0.01,0.1", show_default=True,
              help="many-clients: comma list of fractions of clients per round, each in (0, 1]")
@click.option("--private-memory", default=8.0, show_default=True, help="many-clients: mpifl.run's --private-memory")
@click.option("--mpirun", default=None,
              help="the launcher, with its options (default: the mpirun beside this Python, else the one on PATH); "
                   "e.g. '/usr/bin/mpirun --bind-to none' for a site's Open MPI")
@click.option("--fold-threads", default=None,
              help="fold: comma list of thread counts to fold on, each at most the cores this process may run on "
                   "(default 1,2,0; 0 = all of them); cross-silo: mpifl.run's "
                   "--fold-threads, rank 0's, one count (default 0: automatic)")
@click.option("--fold-clients", default=12, show_default=True, help="fold: the uploads folded")
@click.option("--fold-mb", default=45.0, show_default=True, help="fold: MB per upload (ResNet-18: 45)")
@click.option("--track", default=None,
              help="cross-silo: also run each way over MPI with mpifl.run's --track TRACKERS, in turn with the "
                   "untracked runs, and report its seconds per round beside them and the trackers' CPU per round "
                   "(from each run's log.txt) as a share of a round")
@click.option("--compare", default=None,
              help="cross-silo: more options of mpifl.run, one quoted string (e.g. '--dp-clip 1 --dp-noise 1'): each "
                   "way over MPI also runs with them, in turn with the plain runs, and their seconds per round, ratio "
                   "to the plain runs' and split are reported beside them")
@click.option("--secagg-bits", default=32, show_default=True, help="secagg: mpifl.run's --secagg-bits")
@click.option("--json-out", default=None,
              help="a new file for the results (one that exists is refused), or a folder to make a new "
                   "<case>-<time>.json in (default: runs/bench under the working folder)")
@click.pass_context
def main(ctx, case, data, data_root, model_name, clients_per_domain, samples_per_client, client_ranks, device, rounds,
         repeats, local_epochs, batch_size, lr, threads, algo, eval_every, algos, fractions, private_memory, mpirun,
         fold_threads, fold_clients, fold_mb, track, compare, secagg_bits, json_out):
    """Seconds per round and images/s: bare PyTorch loop vs mpifl with 1, 2, ... client ranks; or time and
    memory with many clients (--case many-clients), or rank 0's fold alone (--case fold).  Every option is
    checked before anything runs; the table is printed, then the results go into a new JSON file."""
    check_case_options(ctx, case)
    if rounds < 2:
        raise MpiflError(f"--rounds must be >= 2 (the first round of every run is warm-up), got {rounds}")
    if repeats < 1:
        raise MpiflError(f"--repeats must be >= 1, got {repeats}")
    started = stamp()
    if case == "fold":
        counts = fold_plan(fold_threads, fold_clients, fold_mb)
        target = result_file(json_out, case, started)
        result = fold_seconds(fold_clients, fold_mb, counts, repeats)
        publish(fold_table(result), {"machine": {"platform": platform.platform(),
                                                 "cores": len(os.sched_getaffinity(0))}, **result}, target)
        return
    if eval_every < 0:
        raise MpiflError(f"--eval-every must be >= 0 (0: after the last round only), got {eval_every}")
    check_device(device)
    data_root = str(data_root or default_data_root())
    if case == "dp-sgd":
        dp_sgd_case(ctx, data_root, data, model_name, samples_per_client, device, rounds, local_epochs, batch_size,
                    lr, threads, algo, json_out, started)
        return
    check_mpirun(mpirun)
    if case == "many-clients":
        ranks = comma_list("--client-ranks", client_ranks or "2", whole_number(1),
                           "--case many-clients runs with one count of client ranks: give one, >= 1", most=1)
        methods = comma_list("--algos", algos, method_name, f"give a comma list of methods: {', '.join(ALGORITHMS)}")
        shares = sorted(comma_list("--fractions", fractions, share_of_clients,
                                   "give a comma list of fractions of the clients, each in (0, 1]"))
        options = dict(data_root=data_root, data=data, model_name=model_name, rounds=rounds, epochs=local_epochs,
                       batch_size=batch_size, lr=lr, threads=threads or 1, clients_per_domain=clients_per_domain,
                       samples_per_client=samples_per_client, device="cpu" if device == "auto" else device)
        for name in methods:
            for share in shares:
                checked_session(run_arguments(**options, extra=many_clients_options(name, share, private_memory)),
                                ranks[0])
        target = result_file(json_out, case, started)
        with tempfile.TemporaryDirectory() as tmp:
            rows = many_clients(methods, shares, ranks[0], {**options, "mpirun": mpirun}, private_memory, Path(tmp))
        publish(many_clients_table(rows, ranks[0], options), {
            "machine": {"platform": platform.platform(), "cores": len(os.sched_getaffinity(0)),
                        "torch": torch.__version__},
            "workload": {**options, "mpirun": mpirun, "client_ranks": ranks[0]}, "runs": rows}, target)
        return
    if case == "secagg":
        ranks = comma_list("--client-ranks", client_ranks or "1,2", whole_number(1),
                           "give a comma list of client-rank counts, each >= 1")
        options = dict(data_root=data_root, data=data, model_name=model_name, rounds=rounds, epochs=local_epochs,
                       batch_size=batch_size, lr=lr, threads=threads, clients_per_domain=clients_per_domain,
                       samples_per_client=samples_per_client, device=device)
        plain, secure = ("--algo", algo), ("--algo", algo, "--secure-aggregation", "--secagg-bits", str(secagg_bits))
        checked_session(run_arguments(**options, extra=secure), max(ranks))
        target = result_file(json_out, case, started)
        with tempfile.TemporaryDirectory() as tmp:
            rows = secure_aggregation_rounds(ranks, {**options, "mpirun": mpirun}, plain, secure, repeats, Path(tmp))
        publish(secure_aggregation_table(rows, options, secure[2:]), {
            "machine": {"platform": platform.platform(), "cores": len(os.sched_getaffinity(0)),
                        "torch": torch.__version__},
            "workload": {**options, "algo": algo, "secagg_bits": secagg_bits, "repeats": repeats, "mpirun": mpirun},
            "runs": rows}, target)
        return
    ranks = sorted({1, *comma_list("--client-ranks", client_ranks or "1,2", whole_number(1),
                                   "give a comma list of client-rank counts, each >= 1")})
    folds = comma_list("--fold-threads", fold_threads or "0", whole_number(0),
                       "--case cross-silo passes mpifl.run one count: give one, >= 0 (0: automatic)", most=1)
    extra = ("--algo", algo, "--fold-threads", str(folds[0]))
    tracked_extra = (*extra, "--track", track) if track else None
    run_args = run_arguments(data_root, data, model_name, rounds, local_epochs, batch_size, lr, threads,
                             clients_per_domain, samples_per_client, device, eval_every, tracked_extra or extra)
    session = checked_session(run_args, ranks[-1])
    compared_extra = (*extra, *compare_options(compare)) if compare else None
    if compare:
        checked_session(run_arguments(data_root, data, model_name, rounds, local_epochs, batch_size, lr, threads,
                                      clients_per_domain, samples_per_client, device, eval_every, compared_extra),
                        ranks[-1])
    if track:
        check_installed(session.cfg)
    target = result_file(json_out, case, started)
    model_name = session.cfg.model  # "auto" resolved
    cores = len(os.sched_getaffinity(0))
    on_gpu = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    bare_device = torch.device("cuda", 0) if on_gpu else torch.device("cpu")
    workload = (data, model_name, rounds, local_epochs, batch_size, lr)
    sizes = [c.num_train for c in session.clients]
    bare, sims, in_process, placed = [], {k: [] for k in ranks}, [], {k: [] for k in ranks[1:]}
    tracked, costs = {k: [] for k in ranks}, {k: [] for k in ranks}  # --track: rounds, tracking_cost of each run
    compared = {k: [] for k in ranks}  # --compare: rounds
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(repeats):
            bare += bare_round_seconds(session, rounds, local_epochs, batch_size, lr, threads or cores,
                                       bare_device, eval_every)[1:]
            for k in ranks[1:]:
                placed[k] += placed_bare_rounds(k, sizes, run_args, (rounds, local_epochs, batch_size, lr,
                                                              threads or max(1, cores // k), bare_device,
                                                              eval_every))[1:]
            for k in ranks:
                sims[k] += simulator_rounds(k, data_root, *workload, threads, clients_per_domain, samples_per_client,
                                            device, Path(tmp) / f"ranks{k}-{repeat}", eval_every, extra, mpirun)[1:]
                if track:
                    out = Path(tmp) / f"ranks{k}-{repeat}-tracked"
                    tracked[k] += simulator_rounds(k, data_root, *workload, threads, clients_per_domain,
                                                   samples_per_client, device, out, eval_every, tracked_extra,
                                                   mpirun)[1:]
                    costs[k].append(tracking_cost((out / LOG).read_text()))
                if compare:
                    compared[k] += simulator_rounds(k, data_root, *workload, threads, clients_per_domain,
                                                    samples_per_client, device, Path(tmp) / f"ranks{k}-{repeat}-with",
                                                    eval_every, compared_extra, mpirun)[1:]
            in_process += simulator_rounds(None, data_root, *workload, threads, clients_per_domain,
                                           samples_per_client, device, Path(tmp) / f"in-process-{repeat}", eval_every,
                                           extra)[1:]
    images = sum(sizes) * local_epochs
    bare_s = statistics.median(s for s, _ in bare)
    one_fold = statistics.median(fold for _, fold in bare)  # every client's fold on one core
    sim_s = {k: statistics.median(r["seconds"]["round"] for r in v) for k, v in sims.items()}
    fastest = {k: min(r["seconds"]["round"] for r in v) for k, v in sims.items()}
    fastest_bare = min(s for s, _ in bare)
    one_process = statistics.median(r["seconds"]["round"] for r in in_process)
    split = {k: {f: statistics.median(r["seconds"][f] for r in v) for f in SPLIT} for k, v in sims.items()}
    scaling = {k: {"speedup": sim_s[1] / sim_s[k], "bound": speedup_bound(sizes, k),
                   "efficiency": sim_s[1] / sim_s[k] / speedup_bound(sizes, k)} for k in ranks[1:]}
    bound_s = {1: bare_s, **{k: statistics.median(s for s, _ in v) for k, v in placed.items()}}  # placed loops
    with_fold = {1: bare_s, **{k: statistics.median(t for _, t in v) + one_fold for k, v in placed.items()}}
    to_bound = {k: sim_s[k] / bound_s[k] for k in ranks}
    last_evaluated = bool(eval_every) and (rounds - 1) % eval_every == 0  # the last message carries round R-1's
    result = {
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "cores": cores, "gpu": torch.cuda.get_device_name(0) if on_gpu else None,
                    "torch": torch.__version__},
        "workload": {"data": data, "model": model_name, "clients": len(sizes), "train_samples": sum(sizes),
                     "rounds": rounds, "repeats": repeats, "local_epochs": local_epochs, "batch_size": batch_size,
                     "threads_per_process": threads or "auto", "fold_threads": int(fold_threads or 0) or "auto",
                     "device": str(bare_device), "algo": algo,
                     "eval_every": eval_every},
        "seconds_per_round": {"bare": bare_s, **{f"mpifl_{k}_ranks": v for k, v in sim_s.items()},
                              "mpifl_in_process": one_process},
        "images_per_second": {"bare": images / bare_s, **{f"mpifl_{k}_ranks": images / v for k, v in sim_s.items()},
                              "mpifl_in_process": images / one_process},
        "rounds_measured": {"bare": [s for s, _ in bare], **{f"mpifl_{k}_ranks": [r["seconds"]["round"] for r in v]
                                             for k, v in sims.items()},
                            "mpifl_in_process": [r["seconds"]["round"] for r in in_process]},
        "ratio_mpifl_1_rank_to_bare": sim_s[1] / bare_s,
        "ratio_mpifl_in_process_to_bare": one_process / bare_s,
        "ratio_of_fastest_rounds": fastest[1] / fastest_bare,
        "placed_bare_seconds_per_round": {f"{k}_ranks": v for k, v in bound_s.items()},
        "ratio_to_placement_bound": {f"{k}_ranks": v for k, v in to_bound.items()},
        "fold_seconds_one_core": one_fold,
        "placed_training_plus_one_fold_seconds": {f"{k}_ranks": v for k, v in with_fold.items()},
        "ratio_to_placed_training_plus_one_fold": {f"{k}_ranks": sim_s[k] / v for k, v in with_fold.items()},
        "scaling_from_1_rank": {f"{k}_ranks": v for k, v in scaling.items()},
        "split_seconds": {f"{k}_ranks": v for k, v in split.items()},
        "client_idle_share": {f"{k}_ranks": idle_shares(v) for k, v in sims.items()},
        "images_per_second_per_rank": {f"{k}_ranks": images / sim_s[k] / k for k in ranks},
        "peak_gpu_bytes_per_client_rank": {f"{k}_ranks": v[-1]["memory"]["peak_gpu"][1:] for k, v in sims.items()},
        "bytes_per_round": {**{f"{k}_ranks": wire_bytes(session, v[-1]["bytes"], k, last_evaluated)
                               for k, v in sims.items()},
                            "in_process": wire_bytes(session, in_process[-1]["bytes"], 1, last_evaluated)},
    }
    if compare:
        result["compared"] = {"options": compare, **{f"{k}_ranks": compared_summary(compared[k], sims[k])
                                                     for k in ranks}}
    if track:
        result["tracking"] = {"track": track, **{f"{k}_ranks": tracking_summary(tracked[k], costs[k], sim_s[k])
                                                 for k in ranks}}
    lines = [(f"{model_name} on {data}: {len(sizes)} clients, {sum(sizes)} training samples, {local_epochs} local "
              f"epoch(s), batch {batch_size}; {bare_device}, {cores} cores, threads per process: "
              f"{threads or 'auto'}; median of {len(bare)} rounds each")]
    lines.append(f"  bare PyTorch loop      {bare_s:8.3f} s/round  {images / bare_s:8.0f} images/s   "
                 f"(its fold of all clients on one core: {one_fold:.3f} s)")
    for k in ranks:
        line = (f"  mpifl, {k} client rank{'s' if k > 1 else ' '} {sim_s[k]:8.3f} s/round  "
                f"{images / sim_s[k]:8.0f} images/s")
        if k == 1:
            line += f"   ratio to bare {sim_s[1] / bare_s:5.3f} (fastest rounds: {fastest[1] / fastest_bare:5.3f})"
        else:
            line += (f"   speedup 1->{k} {scaling[k]['speedup']:5.2f}x (placement allows {scaling[k]['bound']:.2f}x: "
                     f"efficiency {scaling[k]['efficiency']:.1%}); {to_bound[k]:5.3f}x the placed bare loops "
                     f"({bound_s[k]:.3f} s), {sim_s[k] / with_fold[k]:5.3f}x their training plus one fold of all "
                     f"clients on one core ({with_fold[k]:.3f} s)")
        lines.append(line)
    lines.append(f"  mpifl, in one process  {one_process:8.3f} s/round  {images / one_process:8.0f} images/s   "
                 f"ratio to bare {one_process / bare_s:5.3f}")
    for k, v in split.items():
        idle = result["client_idle_share"][f"{k}_ranks"]
        lines.append(f"  split with {k} rank(s): " + ", ".join(f"{n} {s:.3f}s" for n, s in v.items())
                     + "; client ranks idle " + ", ".join(f"{s:.0%}" for s in idle))
    for k in ranks if track else ():
        summary = result["tracking"][f"{k}_ranks"]
        lines.append(f"  --track {track}, {k} client rank(s): {summary['seconds_per_round']:.3f} s/round, "
                     f"{summary['ratio_to_untracked']:5.3f}x untracked; CPU per round of the round loop and the "
                     "trackers' threads " + ", ".join(f"{n} {1000 * s:.1f} ms" for n, s in summary["cpu"].items())
                     + f": {summary['share_of_round']:.2%} of an untracked round")
    for k in ranks if compare else ():
        summary = result["compared"][f"{k}_ranks"]
        lines.append(f"  with {compare}, {k} client rank(s): {summary['seconds_per_round']:.3f} s/round, "
                     f"{summary['ratio_to_plain']:5.3f}x the plain runs (fastest rounds "
                     f"{summary['ratio_of_fastest_rounds']:5.3f}x); split "
                     + ", ".join(f"{n} {v:.3f}s" for n, v in summary["split"].items())
                     + "; client ranks idle " + ", ".join(f"{s:.0%}" for s in summary["client_idle_share"]))
    if on_gpu:
        for k in ranks:
            peaks = result["peak_gpu_bytes_per_client_rank"][f"{k}_ranks"]
            lines.append(f"  {k} client rank(s) on the GPU: {images / sim_s[k] / k:8.0f} images/s per rank, peak GPU "
                         f"memory per rank (allocator) " + " / ".join(f"{b / 2**30:.2f}" for b in peaks) + " GiB")
    for k, v in result["bytes_per_round"].items():
        lines.append(f"  bytes up with {k.replace('_', ' ')}: {v['wire_up']:,} on the wire = manifest "
                     f"{v['manifest_up']:,} + {v['wire_up'] - v['manifest_up']:,} of metadata and padding "
                     f"({'as expected' if v['matches_manifest'] else 'MISMATCH'})")
    publish(lines, result, target)


if __name__ == "__main__":
    main()
