# shellcheck shell=bash
# slurm/common.sh: the shared body of the slurm/<benchmark>.sh batch scripts (sourced by them, never submitted).
#
# A benchmark script sets its defaults, each one overridable from the environment
# (sbatch passes the submitting shell's environment to the job):
#   MPIFL_DATA        dataset (--data)
#   MPIFL_ALGO        --algo                    MPIFL_MODEL       --model
#   MPIFL_ROUNDS      --rounds                  MPIFL_CKPT_EVERY  --ckpt-every N (0: checkpoint only when signalled)
#   MPIFL_DOMAINS     the dataset's domains in order, one client each (MPIFL_ARRAY=holdout indexes them)
#   MPIFL_DEFAULTS    more options of the benchmark, as "--key value" pairs
#
# Site and user settings (environment):
#   MPIFL_HOME        the mpifl checkout (default: found by the benchmark script)
#   MPIFL_MODULES     modules to `module load` first, e.g. "cuda/12.1 openmpi/4.1" (default: none)
#   MPIFL_VENV        virtualenv to activate (default: $MPIFL_HOME/.venv when it exists)
#   MPIFL_DATA_ROOT   directory of the prepared datasets (default: $MPIFL_HOME/datasets)
#   MPIFL_RUNS        where run directories go (default: $MPIFL_HOME/runs)
#   MPIFL_RUN_DIR     the run directory itself (default: $MPIFL_RUNS/<job name>-<job id>, or
#                     -<array job id>_<task id>: the same after a requeue, so a requeued job resumes it)
#   MPIFL_ARGS        more mpifl options, last on the command line so they win, e.g. "--lr 0.05 --seed 3"
#   MPIFL_LAUNCHER    srun (default inside Slurm) or mpirun (default outside)
#   MPIFL_SRUN_ARGS   more srun options, e.g. "--mpi=pmix" where the site's MPI wants it
#   MPIFL_MPIRUN      the mpirun command (default: mpirun on PATH); MPIFL_MPIRUN_ARGS more of its options
#   MPIFL_ARRAY       what a job-array task id selects: seed (default: --seed ID), holdout (--holdout
#                     <ID-th domain>), config (--config <line ID+1 of MPIFL_CONFIG_LIST>), none
#   MPIFL_CONFIG_LIST file of config files, one path a line (relative to the file); implies MPIFL_ARRAY=config
#   MPIFL_CONFIG      one config file for a job that is not an array
#   MPIFL_RESUME_ARGS options added when resuming (only those mpifl lets a resumed run change, e.g. --rounds 400)
#   MPIFL_MAX_REQUEUES  requeue at most this many times (default 20)
#   MPIFL_PROGRAM     what each rank runs (default: "python -m mpifl.run"), e.g. "apptainer exec mpifl.sif python -m mpifl.run"
#   MPIFL_DRY_RUN=1   print the run directory and the command, and run nothing
#
# Preemption and time limits: the benchmark scripts ask for `--signal=B:USR1@SECONDS` and
# `--requeue`. On SIGUSR1 this shell forwards SIGUSR1 to the job step (srun and mpirun pass it on
# to every rank); mpifl finishes the round under way, checkpoints into RUN_DIR/checkpoint/ and
# exits with 75; this shell then runs `scontrol requeue $SLURM_JOB_ID`. The requeued job finds
# RUN_DIR/checkpoint/meta.json and runs `mpifl.run --resume RUN_DIR`. On SIGTERM (scancel, a
# preemption without notice) the ranks are also asked to checkpoint, but the job is not requeued.
# A node lost: Slurm requeues a job whose node fails (--requeue); when mpifl finds a node gone first
# (--peer-timeout, exit 69), or the launcher ends 0 on a run that did not finish (no summary.md: Open
# MPI's prterun after losing a node), this shell requeues the job itself, to resume on nodes that answer.

set -euo pipefail

_mpifl_log() { echo "mpifl-slurm: $*" >&2; }
_mpifl_die() { _mpifl_log "error: $*"; exit 2; }

# ------------------------------------------------------------------ stop signals, from the start
_mpifl_step=""  # pid of srun/mpirun, once started
_mpifl_stop=""  # the first stop signal this shell received: USR1 (requeue) or TERM (stop)
_mpifl_woken=0
_mpifl_on_signal() {
    _mpifl_woken=1
    [[ -n $_mpifl_stop ]] && return
    _mpifl_stop=$1
    _mpifl_log "SIG$1 at $(date +%T): asking the ranks to checkpoint and stop"
    # USR1 whatever came here: srun and mpirun both pass it to every rank (mpirun ends the job on TERM)
    [[ -z $_mpifl_step ]] || kill -USR1 "$_mpifl_step" 2>/dev/null || true
}
trap '_mpifl_on_signal USR1' USR1
trap '_mpifl_on_signal TERM' TERM

MPIFL_HOME=$(cd "${MPIFL_HOME:-$(dirname "${BASH_SOURCE[0]}")/..}" && pwd)
: "${MPIFL_DATA:?the benchmark script sets MPIFL_DATA}"
: "${MPIFL_ALGO:=fedavg}" "${MPIFL_MODEL:=auto}" "${MPIFL_ROUNDS:=10}" "${MPIFL_CKPT_EVERY:=0}"
read -ra _mpifl_domains <<<"${MPIFL_DOMAINS:-}"
# the run directory's files this shell looks for, named in mpifl/rundir/names.py (tests/rundir/test_names.py checks
# that they agree); typed here, as this shell may run where mpifl's Python is not (MPIFL_PROGRAM: a container's)
_mpifl_checkpoint_meta=checkpoint/meta.json
_mpifl_summary=summary.md

# ------------------------------------------------------------------ environment
if [[ -n ${MPIFL_MODULES:-} ]]; then
    set +eu  # module scripts are rarely clean under -eu
    if ! type module >/dev/null 2>&1; then
        for _f in /etc/profile.d/lmod.sh /etc/profile.d/modules.sh /usr/share/lmod/lmod/init/bash; do
            [[ -f $_f ]] && { source "$_f"; break; }
        done
    fi
    type module >/dev/null 2>&1 || _mpifl_die "MPIFL_MODULES is set but this shell has no 'module' command"
    # shellcheck disable=SC2086  # a list of modules
    module load $MPIFL_MODULES || _mpifl_die "module load ${MPIFL_MODULES} failed"
    set -eu
fi
_mpifl_venv=${MPIFL_VENV:-}
[[ -z $_mpifl_venv && -f $MPIFL_HOME/.venv/bin/activate ]] && _mpifl_venv=$MPIFL_HOME/.venv
if [[ -n $_mpifl_venv ]]; then
    [[ -f $_mpifl_venv/bin/activate ]] || _mpifl_die "MPIFL_VENV=${_mpifl_venv} holds no bin/activate"
    set +u
    source "$_mpifl_venv/bin/activate"
    set -u
fi
export PYTHONPATH=${MPIFL_HOME}${PYTHONPATH:+:$PYTHONPATH}  # this checkout's mpifl, installed or not
export MPIFL_DATA_ROOT=${MPIFL_DATA_ROOT:-$MPIFL_HOME/datasets}  # mpifl reads it (--data-root's default)
MPIFL_RUNS=${MPIFL_RUNS:-$MPIFL_HOME/runs}

# ------------------------------------------------------------------ what this task runs
_mpifl_task=${SLURM_ARRAY_TASK_ID:-}
_mpifl_array=${MPIFL_ARRAY:-$([[ -n ${MPIFL_CONFIG_LIST:-} ]] && echo config || echo seed)}
_mpifl_select=()  # options picked by the array task id
_mpifl_config=${MPIFL_CONFIG:-}
if [[ -n $_mpifl_task ]]; then
    case $_mpifl_array in
        seed) _mpifl_select=(--seed "$_mpifl_task") ;;
        holdout)
            ((_mpifl_task < ${#_mpifl_domains[@]})) || _mpifl_die "array task ${_mpifl_task}: ${MPIFL_DATA} has" \
                "${#_mpifl_domains[@]} domains (${_mpifl_domains[*]}); submit with --array=0-$((${#_mpifl_domains[@]} - 1))"
            _mpifl_select=(--holdout "${_mpifl_domains[_mpifl_task]}") ;;
        config)
            [[ -f ${MPIFL_CONFIG_LIST:-} ]] || _mpifl_die "MPIFL_ARRAY=config needs MPIFL_CONFIG_LIST, a file of config paths"
            _mpifl_config=$(sed -n "$((_mpifl_task + 1))p" "$MPIFL_CONFIG_LIST")
            [[ -n $_mpifl_config ]] || _mpifl_die "array task ${_mpifl_task}: ${MPIFL_CONFIG_LIST} has no line" \
                "$((_mpifl_task + 1)); submit with --array=0-$(($(grep -c . "$MPIFL_CONFIG_LIST") - 1))"
            [[ $_mpifl_config == /* ]] || _mpifl_config=$(dirname "$MPIFL_CONFIG_LIST")/$_mpifl_config ;;
        none) ;;
        *) _mpifl_die "MPIFL_ARRAY=${_mpifl_array}: choose seed, holdout, config or none" ;;
    esac
fi
[[ -z $_mpifl_config || -f $_mpifl_config ]] || _mpifl_die "config file ${_mpifl_config} not found"

if [[ -n ${SLURM_ARRAY_JOB_ID:-} ]]; then
    _mpifl_name=${SLURM_JOB_NAME:-mpifl}-${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}
elif [[ -n ${SLURM_JOB_ID:-} ]]; then
    _mpifl_name=${SLURM_JOB_NAME:-mpifl}-${SLURM_JOB_ID}
else
    _mpifl_name=mpifl-${MPIFL_DATA}-$(date +%Y%m%d-%H%M%S)-$$
fi
[[ -n $_mpifl_config ]] && _mpifl_name+=-$(basename "${_mpifl_config%.*}")
RUN_DIR=${MPIFL_RUN_DIR:-${MPIFL_RUNS}/${_mpifl_name//[^A-Za-z0-9._=+-]/_}}

_mpifl_restarts=${SLURM_RESTART_COUNT:-0}
if ((_mpifl_restarts == 0)) && [[ -z ${MPIFL_RUN_DIR:-} && -n $(ls -A "$RUN_DIR" 2>/dev/null) ]]; then
    # a first start, yet its directory is taken: another job had this id (a reset Slurm); never resume that
    _mpifl_die "run directory ${RUN_DIR} exists already, from another job; move it away, or set MPIFL_RUNS" \
        "(or MPIFL_RUN_DIR=${RUN_DIR} to continue that run)"
fi
if [[ -f $RUN_DIR/$_mpifl_checkpoint_meta ]]; then
    read -ra _mpifl_resume_args <<<"${MPIFL_RESUME_ARGS:-}"
    _mpifl_args=(--resume "$RUN_DIR" "${_mpifl_resume_args[@]}")
else
    if ((_mpifl_restarts > 0)) && [[ -n $(ls -A "$RUN_DIR" 2>/dev/null) ]]; then
        # requeued (a node failure, a preemption) before any checkpoint: start over in the directory the job
        # names (mpifl refuses a directory holding a run's files), keeping what was there
        _mpifl_aside=${RUN_DIR}.attempt-$(date +%Y%m%d-%H%M%S)
    fi
    _mpifl_defaults=(--data "$MPIFL_DATA" --algo "$MPIFL_ALGO" --model "$MPIFL_MODEL" --rounds "$MPIFL_ROUNDS")
    ((MPIFL_CKPT_EVERY > 0)) && _mpifl_defaults+=(--ckpt-every "$MPIFL_CKPT_EVERY")
    eval "_mpifl_defaults+=(${MPIFL_DEFAULTS:-})"
    _mpifl_args=()
    if [[ -n $_mpifl_config ]]; then
        # the config file wins over the benchmark's defaults: drop the defaults it sets
        _mpifl_keys=" $(python - "$_mpifl_config" <<'PY'
import json, sys
from pathlib import Path
path = Path(sys.argv[1])
if path.suffix.lower() == ".json":
    data = json.loads(path.read_text())
else:
    import yaml
    data = yaml.safe_load(path.read_text())
print(" ".join(str(k).replace("-", "_") for k in (data or {})))
PY
) "
        for ((_i = 0; _i < ${#_mpifl_defaults[@]}; _i += 2)); do
            _k=${_mpifl_defaults[_i]#--}
            [[ $_mpifl_keys == *" ${_k//-/_} "* ]] || _mpifl_args+=("${_mpifl_defaults[@]:_i:2}")
        done
        _mpifl_args+=(--config "$_mpifl_config")
    else
        _mpifl_args+=("${_mpifl_defaults[@]}")
    fi
    eval "_mpifl_extra=(${MPIFL_ARGS:-})"  # shell words: quotes in MPIFL_ARGS are honoured
    for _a in "${_mpifl_extra[@]}"; do
        case $_a in
            --out | --out=* | --resume | --resume=*)
                _mpifl_die "MPIFL_ARGS has ${_a%%=*}: set MPIFL_RUN_DIR instead (requeued jobs resume it)" ;;
        esac
    done
    _mpifl_args+=("${_mpifl_select[@]}" --out "$RUN_DIR" "${_mpifl_extra[@]}")
fi

# ------------------------------------------------------------------ how it is launched
_mpifl_ntasks=${SLURM_NTASKS:-$((${#_mpifl_domains[@]} + 1))}
read -ra _mpifl_program <<<"${MPIFL_PROGRAM:-python -m mpifl.run}"
case ${MPIFL_LAUNCHER:-$([[ -n ${SLURM_JOB_ID:-} ]] && echo srun || echo mpirun)} in
    srun)
        read -ra _mpifl_launch_args <<<"${MPIFL_SRUN_ARGS:-}"
        # srun does not take --cpus-per-task from the allocation (Slurm >= 22.05): pass it on
        _mpifl_launch=(srun --ntasks="$_mpifl_ntasks" ${SLURM_CPUS_PER_TASK:+--cpus-per-task="$SLURM_CPUS_PER_TASK"}
                       "${_mpifl_launch_args[@]}") ;;
    mpirun)
        read -ra _mpifl_launch_args <<<"${MPIFL_MPIRUN_ARGS:-}"
        read -ra _mpifl_launch <<<"${MPIFL_MPIRUN:-mpirun}"
        _mpifl_launch+=(-n "$_mpifl_ntasks" "${_mpifl_launch_args[@]}") ;;
    *) _mpifl_die "MPIFL_LAUNCHER=${MPIFL_LAUNCHER}: choose srun or mpirun" ;;
esac
_mpifl_cmd=("${_mpifl_launch[@]}" "${_mpifl_program[@]}" "${_mpifl_args[@]}")

if [[ ${MPIFL_DRY_RUN:-0} == 1 ]]; then
    echo "RUN_DIR=${RUN_DIR}"
    printf '%q ' "${_mpifl_cmd[@]}"
    echo
    exit 0
fi
_mpifl_log "job ${SLURM_JOB_ID:-(no Slurm)}${_mpifl_task:+ array task ${_mpifl_task}} restart ${_mpifl_restarts}" \
    "on ${SLURM_JOB_NODELIST:-$(hostname -s)}; run directory ${RUN_DIR}"
_mpifl_log "command: $(printf '%q ' "${_mpifl_cmd[@]}")"
if [[ -n ${_mpifl_aside:-} ]]; then
    mv "$RUN_DIR" "$_mpifl_aside"
    _mpifl_log "no checkpoint in ${RUN_DIR}: starting again (the earlier attempt is in ${_mpifl_aside})"
fi
mkdir -p "$(dirname "$RUN_DIR")"

# ------------------------------------------------------------------ run, requeue
if [[ -z $_mpifl_stop ]]; then
    "${_mpifl_cmd[@]}" &
    _mpifl_step=$!
    [[ -z $_mpifl_stop ]] || kill -USR1 "$_mpifl_step" 2>/dev/null || true
    while :; do
        _mpifl_woken=0
        _mpifl_rc=0
        wait "$_mpifl_step" || _mpifl_rc=$?
        # a trapped signal interrupts `wait` (status > 128) while the step still runs: wait again
        ((_mpifl_woken && _mpifl_rc > 128)) && { _mpifl_last=$_mpifl_rc; continue; }
        break
    done
    ((_mpifl_rc == 127 && ${_mpifl_last:-0} > 0)) && _mpifl_rc=$_mpifl_last  # the step had ended and been reaped
    _mpifl_log "job step ended with exit code ${_mpifl_rc}"
    if ((_mpifl_rc == 0)) && [[ ! -f $RUN_DIR/$_mpifl_summary ]]; then  # a launcher that lost a node may say 0
        _mpifl_log "yet the run did not finish (no ${RUN_DIR}/${_mpifl_summary}; Open MPI's prterun ends 0 when it" \
            "loses a node): counted as a lost node"
        _mpifl_rc=69
    fi
else
    _mpifl_rc=75  # signalled before the step started: nothing ran, requeue as is
    _mpifl_log "signalled before the job step started"
fi
_mpifl_requeue() {  # _mpifl_requeue WHY: requeue this job, which resumes RUN_DIR when it starts again
    if ((_mpifl_restarts >= ${MPIFL_MAX_REQUEUES:-20})); then
        _mpifl_log "not requeueing: already requeued ${_mpifl_restarts} times (MPIFL_MAX_REQUEUES);" \
            "resubmit with MPIFL_RUN_DIR=${RUN_DIR} to continue"
    elif scontrol requeue "$SLURM_JOB_ID"; then
        _mpifl_log "requeued job ${SLURM_JOB_ID} ($1): it resumes ${RUN_DIR} when it starts again"
        exit 0
    else
        _mpifl_log "scontrol requeue failed; resubmit with MPIFL_RUN_DIR=${RUN_DIR} to continue"
    fi
}
if [[ $_mpifl_stop == USR1 && -n ${SLURM_JOB_ID:-} ]]; then
    # 75: stopped with a checkpoint; 138 (srun) or 10 (mpirun): a rank died of SIGUSR1 before mpifl could
    # handle it (still starting up), so the last checkpoint, if any, is still the one to resume from
    case $_mpifl_rc in
        75 | 138 | 10) _mpifl_requeue "stopped" ;;
        *) _mpifl_log "not requeueing: the run did not stop with a checkpoint" ;;
    esac
elif ((_mpifl_rc == 69)) && [[ -n ${SLURM_JOB_ID:-} ]]; then
    # a node lost (mpifl's --peer-timeout, or the launcher's word): the requeued job gets nodes that answer and
    # resumes from the last checkpoint (or starts again without one)
    _mpifl_requeue "a node was lost"
elif ((_mpifl_rc == 75)); then
    _mpifl_log "stopped with a checkpoint in ${RUN_DIR}/checkpoint; resubmit with MPIFL_RUN_DIR=${RUN_DIR} to continue"
fi
exit "$_mpifl_rc"
