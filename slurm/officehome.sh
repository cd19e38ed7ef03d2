#!/bin/bash
# Office-Home (Venkateswara et al. 2017), ResNet-18.
# One client per domain (art clipart product real_world): 4 client ranks + 1 server rank.
#
#   sbatch slurm/officehome.sh                                   # from the mpifl checkout; slurm-<job id>.out
#   sbatch -p PARTITION -A ACCOUNT slurm/officehome.sh           # the site's partition and account
#   MPIFL_ALGO=fedbn MPIFL_ARGS="--lr 0.05" sbatch slurm/officehome.sh
#   sbatch --array=0-2 slurm/officehome.sh                       # seeds 0, 1, 2 (one job each)
#   MPIFL_ARRAY=holdout sbatch --array=0-3 slurm/officehome.sh   # leave-one-domain-out, one fold per task
#
# A site changes, on the sbatch command line (options there override these lines) or here:
# the partition and account (-p, -A; none is set here), the GPU request (--gpus-per-node;
# --gres=gpu:N where the site counts GPUs as GRES), --cpus-per-task, --mem-per-cpu and --time
# to its nodes and limits. Everything else comes from environment variables (slurm/common.sh
# and docs/clusters.md, "Slurm"): MPIFL_MODULES, MPIFL_VENV, MPIFL_DATA_ROOT, MPIFL_RUNS,
# MPIFL_ARGS, MPIFL_LAUNCHER (srun or mpirun), MPIFL_ARRAY (seed, holdout, config).
# Prepare the data once: python -m mpifl.data prepare officehome --src DIR (shards under $MPIFL_DATA_ROOT/officehome).
#SBATCH --job-name=mpifl-officehome
#SBATCH --nodes=1
#SBATCH --ntasks=5                 # 4 clients + 1 server
#SBATCH --gpus-per-node=4          # client rank k uses node-local GPU (k-1) mod 4; the server needs none
#SBATCH --cpus-per-task=8
#SBATCH --mem-per-cpu=4G
#SBATCH --time=24:00:00
#SBATCH --signal=B:USR1@600        # 10 min before the time limit: checkpoint, requeue, resume
#SBATCH --requeue                  # also requeued after a node failure or a preemption
#SBATCH --open-mode=append         # a requeued job appends to its output file

: "${MPIFL_DATA:=officehome}" "${MPIFL_ALGO:=fedavg}" "${MPIFL_MODEL:=resnet18}" "${MPIFL_ROUNDS:=100}"
: "${MPIFL_CKPT_EVERY:=10}"
: "${MPIFL_DOMAINS:=art clipart product real_world}"
: "${MPIFL_DEFAULTS:=--local-epochs 1 --batch-size 32 --lr 0.01}"

# find the checkout: $MPIFL_HOME, this script's directory, the submitted script's, the submit directory
for MPIFL_HOME in "${MPIFL_HOME:-}" "${0%/*}/.." \
    "$(scontrol show job "${SLURM_JOB_ID:-0}" 2>/dev/null | sed -n 's|^ *Command=\(.*\)/slurm/[^/]*$|\1|p' | head -n 1)" \
    "${SLURM_SUBMIT_DIR:-.}"; do
    [[ -f $MPIFL_HOME/slurm/common.sh ]] && break
done
source "$MPIFL_HOME/slurm/common.sh" || { echo "no slurm/common.sh: submit from the checkout or set MPIFL_HOME" >&2; exit 2; }
