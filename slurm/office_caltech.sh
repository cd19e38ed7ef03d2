#!/bin/bash
# Office-Caltech-10 (Gong et al. 2012), FedBN's AlexNet.
# One client per domain (amazon caltech dslr webcam): 4 client ranks + 1 server rank.
#
#   sbatch slurm/office_caltech.sh                                   # from the mpifl checkout; slurm-<job id>.out
#   sbatch -p PARTITION -A ACCOUNT slurm/office_caltech.sh           # the site's partition and account
#   MPIFL_ALGO=fedbn MPIFL_ARGS="--lr 0.05" sbatch slurm/office_caltech.sh
#   sbatch --array=0-2 slurm/office_caltech.sh                       # seeds 0, 1, 2 (one job each)
#   MPIFL_ARRAY=holdout sbatch --array=0-3 slurm/office_caltech.sh   # leave-one-domain-out, one fold per task
#
# A site changes, on the sbatch command line (options there override these lines) or here:
# the partition and account (-p, -A; none is set here), the GPU request (--gpus-per-node;
# --gres=gpu:N where the site counts GPUs as GRES), --cpus-per-task, --mem-per-cpu and --time
# to its nodes and limits. Everything else comes from environment variables (slurm/common.sh
# and docs/clusters.md, "Slurm"): MPIFL_MODULES, MPIFL_VENV, MPIFL_DATA_ROOT, MPIFL_RUNS,
# MPIFL_ARGS, MPIFL_LAUNCHER (srun or mpirun), MPIFL_ARRAY (seed, holdout, config).
# Prepare the data once: python -m mpifl.data prepare office_caltech --src DIR (shards under $MPIFL_DATA_ROOT/office_caltech).
#SBATCH --job-name=mpifl-office_caltech
#SBATCH --nodes=1
#SBATCH --ntasks=5                 # 4 clients + 1 server
#SBATCH --gpus-per-node=4          # client rank k uses node-local GPU (k-1) mod 4; the server needs none
#SBATCH --cpus-per-task=8
#SBATCH --mem-per-cpu=4G
#SBATCH --time=24:00:00
#SBATCH --signal=B:USR1@600        # 10 min before the time limit: checkpoint, requeue, resume
#SBATCH --requeue                  # also requeued after a node failure or a preemption
#SBATCH --open-mode=append         # a requeued job appends to its output file

: "${MPIFL_DATA:=office_caltech}" "${MPIFL_ALGO:=fedavg}" "${MPIFL_MODEL:=alexnet}" "${MPIFL_ROUNDS:=300}"
: "${MPIFL_CKPT_EVERY:=10}"
: "${MPIFL_DOMAINS:=amazon caltech dslr webcam}"
: "${MPIFL_DEFAULTS:=--local-epochs 1 --batch-size 32 --lr 0.01}"

# find the checkout: $MPIFL_HOME, this script's directory, the submitted script's, the submit directory
for MPIFL_HOME in "${MPIFL_HOME:-}" "${0%/*}/.." \
    "$(scontrol show job "${SLURM_JOB_ID:-0}" 2>/dev/null | sed -n 's|^ *Command=\(.*\)/slurm/[^/]*$|\1|p' | head -n 1)" \
    "${SLURM_SUBMIT_DIR:-.}"; do
    [[ -f $MPIFL_HOME/slurm/common.sh ]] && break
done
source "$MPIFL_HOME/slurm/common.sh" || { echo "no slurm/common.sh: submit from the checkout or set MPIFL_HOME" >&2; exit 2; }
