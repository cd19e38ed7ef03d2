#!/usr/bin/env bash
# The GPU-node measurements of docs/benchmarks.md, in one go, on one node with a GPU:
#   1. the used-by command (gPerXAN, ResNet-18, 224 px) under the node's MPI against the same job in one process,
#      fp32 and bf16 + channels-last; the gPerXAN Table 2 preset (ResNet-50) likewise;
#   2. client ranks sharing the GPU: python -m mpifl.bench --device cuda --client-ranks 1,2,4,6;
#   3. --deterministic: two runs and two rank counts, bit for bit, and its cost;
#   4. optionally the same used-by command on an older checkout (BEFORE=DIR), for before/after.
# GPU utilization and memory are sampled with nvidia-smi during every step.
#
#   MPIRUN="/usr/bin/mpirun" launch/gpu-bench.sh PACS_SRC WORK   # PACS_SRC: <domain>/<class>/<image>
#
# Every run's directory, its log and the samples stay under WORK; WORK/summary.txt has the tables.  Settings
# (environment): PYTHON (python3), MPIRUN (mpirun), SIZE (224), DEVICE (cuda), STEPS (all: data r18 r50 bench
# det before), BEFORE (a checkout of mpifl to time the used-by command with).
set -uo pipefail
SRC=$(realpath "$1"); WORK=$(realpath -m "$2")
PY=$(command -v "${PYTHON:-python3}"); MPIRUN=${MPIRUN:-mpirun}; SIZE=${SIZE:-224}; DEVICE=${DEVICE:-cuda}
STEPS=" ${STEPS:-data r18 r50 bench det before} "
REPO=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$WORK/runs" "$WORK/logs"
DATA=$WORK/data
export PYTHONUNBUFFERED=1 PYTHONPATH=$REPO
cd "$REPO"

say() { echo "== $*" | tee -a "$WORK/summary.txt"; }
wants() { [[ $STEPS == *" $1 "* ]]; }

# step NAME SECONDS COMMAND...: run it with GPU sampling; its output in logs/NAME.log
step() {
    local name=$1 limit=$2 smi="" apps="" start=$SECONDS rc
    shift 2
    say "$name: $*"
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv,noheader,nounits -lms 250 \
            >"$WORK/logs/$name.gpu.csv" 2>/dev/null & smi=$!
        nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits -lms 1000 \
            >"$WORK/logs/$name.apps.csv" 2>/dev/null & apps=$!
    fi
    timeout "$limit" "$@" >"$WORK/logs/$name.log" 2>&1
    rc=$?
    [[ -n $smi ]] && kill "$smi" "$apps" 2>/dev/null && wait "$smi" "$apps" 2>/dev/null
    echo "   exit $rc after $((SECONDS - start)) s" | tee -a "$WORK/summary.txt"
    [[ $rc == 0 ]] || tail -3 "$WORK/logs/$name.log" | tee -a "$WORK/summary.txt"
}

run() {  # run NAME RANKS|0 SECONDS OPTIONS...: mpifl.run under MPIRUN -n RANKS, or in one process (0)
    local name=$1 ranks=$2 limit=$3
    shift 3
    local launcher=()
    [[ $ranks != 0 ]] && read -ra launcher <<<"$MPIRUN -n $ranks"
    step "$name" "$limit" "${launcher[@]}" "$PY" -m mpifl.run --data-root "$DATA" --device "$DEVICE" \
        --out "$WORK/runs/$name" "$@"
}

say "$(date -u +%FT%TZ) $(nvidia-smi -L 2>/dev/null | head -1); $($PY -c 'import torch, mpi4py; from mpi4py import MPI; print("torch", torch.__version__, "mpi4py", mpi4py.__version__, MPI.Get_library_version().splitlines()[0])')"
say "$(nproc) cores; MPIRUN=$MPIRUN"
command -v ompi_info >/dev/null && ompi_info --all 2>/dev/null | grep -E "single_copy_mechanism|MCA smsc" | head -3 \
    | tee -a "$WORK/summary.txt"

wants data && step data 300 "$PY" -m mpifl.data prepare pacs --src "$SRC" --data-root "$DATA" --size "$SIZE"

USED=(--algo gperxan --data pacs --rounds 3)
if wants r18; then
    run r18-mpi 7 150 "${USED[@]}"
    run r18-one 0 150 "${USED[@]}"
    run r18-bf16-mpi 7 150 "${USED[@]}" --precision bf16 --channels-last
    run r18-bf16-one 0 150 "${USED[@]}" --precision bf16 --channels-last
fi
R50=(--preset gperxan-t2-pacs --algo gperxan --holdout photo --rounds 2 --precision bf16 --channels-last)
if wants r50; then
    run r50-mpi 4 200 "${R50[@]}"
    run r50-one 0 200 "${R50[@]}"
fi
if wants bench; then  # 12 clients: 1, 2, 4 and 6 client ranks each take an equal share
    step bench 420 "$PY" -m mpifl.bench --device "$DEVICE" --data pacs --data-root "$DATA" --model resnet18 \
        --clients-per-domain 3 --client-ranks 1,2,4,6 --rounds 3 --repeats 1 --mpirun "$MPIRUN" \
        --json-out "$WORK/bench.json"
fi
DET=(--algo fedavg --data pacs --model resnet18 --rounds 2 --clients-per-domain 1 --threads 1 --seed 1)
if wants det; then
    run det-2 2 150 "${DET[@]}" --deterministic
    run det-2-again 2 150 "${DET[@]}" --deterministic
    run det-5 5 150 "${DET[@]}" --deterministic
    run nodet-2 2 150 "${DET[@]}"
    run nodet-2-again 2 150 "${DET[@]}"
fi
if wants before && [[ -n ${BEFORE:-} ]]; then  # python -m puts the working folder first on the path
    (cd "$BEFORE" && PYTHONPATH=$BEFORE run before-r18-mpi 7 120 --algo gperxan --data pacs --rounds 2)
fi

# the tables: seconds per round and the split of each round (rank 0's), GPU utilization during each run
"$PY" - "$WORK" <<'EOF' | tee -a "$WORK/summary.txt"
import csv, json, sys
from pathlib import Path
from mpifl.rundir.names import METRICS
work = Path(sys.argv[1])

def numbers(run):  # what a run computes: not its timings, memory, or the framing bytes that vary with the ranks
    records = [json.loads(l) for l in (run / METRICS).read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in ("seconds", "rank_seconds", "memory", "bytes")}
            | {"bytes": {k: v for k, v in r["bytes"].items() if not k.startswith("wire")}} for r in records]

for run in sorted((work / "runs").glob("*")):
    metrics = run / METRICS
    if not metrics.exists():
        print(f"{run.name}: no metrics")
        continue
    records = [json.loads(l) for l in metrics.read_text().splitlines()]
    gpu = work / "logs" / f"{run.name}.gpu.csv"
    util = [float(r[1]) for r in csv.reader(gpu.open()) if len(r) > 2 and r[1].strip().isdigit()] if gpu.exists() else []
    print(f"{run.name}: " + "; ".join(
        f"r{r['round']} {r['seconds']['round']:.2f} s (" + ", ".join(f"{k} {v:.2f}" for k, v in r["seconds"].items()
                                                              if k != "round") + ")" for r in records))
    print(f"   peak GPU memory per client rank (allocator, GiB): "
          + " / ".join(f"{b / 2**30:.2f}" for b in records[-1]["memory"].get("peak_gpu", [0])[1:])
          + (f"; GPU utilization over the run: mean {sum(util) / len(util):.0f} %, samples {len(util)}" if util else ""))
    for kind in ("global", "personal"):
        acc = [r["eval"][kind]["test"]["mean"]["acc"] for r in records if kind in r.get("eval", {})]
        if acc:
            print(f"   {kind} model, mean test accuracy by evaluation: {[round(a, 4) for a in acc]}")
pairs = [("det-2", "det-2-again"), ("det-2", "det-5"), ("nodet-2", "nodet-2-again"), ("det-2", "nodet-2")]
for a, b in pairs:
    if (work / "runs" / a / METRICS).exists() and (work / "runs" / b / METRICS).exists():
        same = numbers(work / "runs" / a) == numbers(work / "runs" / b)
        print(f"{a} vs {b}: {'bit-identical metrics' if same else 'metrics differ'}")
EOF
