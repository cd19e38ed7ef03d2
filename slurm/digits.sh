#!/bin/bash
# Digits-Five (MNIST, SVHN, USPS, SynthDigits, MNIST-M), FedBN's DigitModel.
# One client per domain (mnist svhn usps synth mnistm): 5 client ranks + 1 server rank.
#
#   sbatch slurm/digits.sh                                   # from the mpifl checkout; slurm-<job id>.out
#   sbatch -p PARTITION -A ACCOUNT slurm/digits.sh           # the site's partition and account
#   MPIFL_ALGO=fedbn MPIFL_ARGS="--lr 0.05" sbatch slurm/digits.sh
#   sbatch --array=0-2 slurm/digits.sh                       # seeds 0, 1, 2 (one job each)
#   MPIFL_ARRAY=holdout sbatch --array=0-4 slurm/digits.sh   # leave-one-domain-out, one fold per task
#
# A site changes, on the sbatch command line (options there override these lines) or here:
# the partition and account (-p, -A; none is set here), the GPU request (--gpus-per-node;
# --gres=gpu:N where the site counts GPUs as GRES), --cpus-per-task, --mem-per-cpu and --time
# to its nodes and limits. Everything else comes from environment variables (slurm/common.sh
# and docs/clusters.md, "Slurm"): MPIFL_MODULES, MPIFL_VENV, MPIFL_DATA_ROOT, MPIFL_RUNS,
# MPIFL_ARGS, MPIFL_LAUNCHER (srun or mpirun), MPIFL_ARRAY (seed, holdout, config).
# Prepare the data once: python -m mpifl.data prepare digits --src DIR (shards under $MPIFL_DATA_ROOT/digits).
#SBATCH --job-name=mpifl-digits
#SBATCH --nodes=1
#SBATCH --ntasks=6                 # 5 clients + 1 server
#SBATCH --gpus-per-node=1          # 28x28 digits: five client ranks share one GPU
#SBATCH --cpus-per-task=4
#SBATCH --mem-per-cpu=4G
#SBATCH --time=08:00:00
#SBATCH --signal=B:USR1@300        # 5 min before the time limit: checkpoint, requeue, resume
#SBATCH --requeue                  # also requeued after a node failure or a preemption
#SBATCH --open-mode=append         # a requeued job appends to its output file

: "${MPIFL_DATA:=digits}" "${MPIFL_ALGO:=fedavg}" "${MPIFL_MODEL:=digitmodel}" "${MPIFL_ROUNDS:=100}"
: "${MPIFL_CKPT_EVERY:=10}"
: "${MPIFL_DOMAINS:=mnist svhn usps synth mnistm}"
: "${MPIFL_DEFAULTS:=--local-epochs 1 --batch-size 32 --lr 0.01}"

# find the checkout: $MPIFL_HOME, this script's directory, the submitted script's, the submit directory
for MPIFL_HOME in "${MPIFL_HOME:-}" "${0%/*}/.." \
    "$(scontrol show job "${SLURM_JOB_ID:-0}" 2>/dev/null | sed -n 's|^ *Command=\(.*\)/slurm/[^/]*$|\1|p' | head -n 1)" \
    "${SLURM_SUBMIT_DIR:-.}"; do
    [[ -f $MPIFL_HOME/slurm/common.sh ]] && break
done
source "$MPIFL_HOME/slurm/common.sh" || { echo "no slurm/common.sh: submit from the checkout or set MPIFL_HOME" >&2; exit 2; }
