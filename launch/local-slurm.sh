#!/usr/bin/env bash
# A single-node Slurm on loopback, for tests and CI (run as root):
#
#   launch/local-slurm.sh start     # install (Debian: slurmctld slurmd slurm-client munge) if missing, configure, start
#   launch/local-slurm.sh status    # daemons and node state; exit 0 when up, 3 when not
#   launch/local-slurm.sh stop      # stop the daemons this script started
#   launch/local-slurm.sh start-hosts  # a Slurm over the emulated hosts of launch/hosts.py (one node each)
#   launch/local-slurm.sh stop-hosts
#
# Idempotent: `start` on a running cluster and `stop` on a stopped one do nothing.
# The node is this machine (`hostname -s`) at 127.0.0.1, declared with more CPUs
# (MPIFL_SLURM_CPUS, default 16) than it has so that several MPI tasks and job-array
# tasks fit at once, and with MPIFL_SLURM_GPUS (default 8) count-only "gpu" GRES so
# that the slurm/*.sh headers (--gpus-per-node) are accepted unchanged; no device is
# behind them and mpifl falls back to the CPU. No cgroup plugins (proctrack/linuxproc,
# task/none), so it runs in containers; no accounting database.
#
# Files: the config goes to /etc/slurm/slurm.conf and /etc/slurm/gres.conf (where the
# client commands look; an existing slurm.conf not written by this script is never
# overwritten), state, spool, pid and log files to MPIFL_SLURM_STATE (default
# /var/tmp/mpifl-slurm): slurmctld.log and slurmd.log there explain a node that does
# not come up.
set -euo pipefail

STATE=${MPIFL_SLURM_STATE:-/var/tmp/mpifl-slurm}
CPUS=${MPIFL_SLURM_CPUS:-16}
GPUS=${MPIFL_SLURM_GPUS:-8}
CONF_DIR=/etc/slurm
CONF=${CONF_DIR}/slurm.conf
MARK="# written by mpifl launch/local-slurm.sh"
NODE=$(hostname -s)

say() { echo "local-slurm: $*" >&2; }
die() { say "error: $*"; exit 1; }

alive() {  # alive PIDFILE: the process named in PIDFILE runs
    [[ -s $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null
}

munge_ok() { munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }

install_packages() {
    local missing=()
    command -v slurmctld >/dev/null || missing+=(slurmctld)
    command -v slurmd >/dev/null || missing+=(slurmd)
    command -v sbatch >/dev/null || missing+=(slurm-client)
    command -v munged >/dev/null || missing+=(munge)
    ((${#missing[@]} == 0)) && return
    command -v apt-get >/dev/null || die "missing ${missing[*]} and no apt-get: install Slurm and munge yourself"
    say "installing ${missing[*]} (apt-get)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

start_munge() {
    munge_ok && return
    install -d -m 0700 -o munge -g munge /etc/munge /var/lib/munge /var/log/munge
    install -d -m 0755 -o munge -g munge /run/munge
    if [[ ! -s /etc/munge/munge.key ]]; then
        say "creating /etc/munge/munge.key"
        if command -v mungekey >/dev/null; then
            mungekey --create --keyfile=/etc/munge/munge.key
        else
            dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
        fi
    fi
    chown munge:munge /etc/munge/munge.key
    chmod 0600 /etc/munge/munge.key
    # munged daemonizes itself; as the munge user when it exists, like its service unit
    if id munge >/dev/null 2>&1; then
        runuser -u munge -- munged --pid-file="/run/munge/munged.pid"
    else
        munged --force --pid-file="/run/munge/munged.pid"
    fi
    cp /run/munge/munged.pid "${STATE}/munged.pid"  # ours to stop
    for _ in $(seq 50); do munge_ok && return; sleep 0.2; done
    die "munged does not answer (see /var/log/munge/munged.log)"
}

shared_settings() {  # shared_settings DIR SUFFIX: both Slurms' settings; DIR holds the state, SUFFIX a node's files
    local dir=$1 suffix=$2
    cat <<EOF
MailProg=/bin/true
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# a requeued job may start again after cred_expire seconds (default 120)
AuthInfo=cred_expire=5
StateSaveLocation=${dir}/ctld
SlurmdSpoolDir=${dir}/d${suffix}
SlurmctldPidFile=${dir}/slurmctld.pid
SlurmdPidFile=${dir}/slurmd${suffix}.pid
SlurmctldLogFile=${dir}/slurmctld.log
SlurmdLogFile=${dir}/slurmd${suffix}.log
SlurmctldDebug=info
SlurmdDebug=info
# no cgroups: these work in containers
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=pmi2
SchedulerType=sched/backfill
# a job that becomes eligible by time (a requeued one) waits for the next scheduling pass: every second here
# (defaults: 60 s for the main scheduler, 30 s for backfill)
SchedulerParameters=sched_interval=1,bf_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
# the declared node is larger than the machine: do not drain it for that
SlurmdParameters=config_overrides
ReturnToService=2
# finished jobs stay visible to scontrol for an hour (tests read their state)
MinJobAge=3600
JobRequeue=1
GresTypes=gpu
EOF
}

write_config() {
    if [[ -e $CONF ]] && ! grep -qF "$MARK" "$CONF"; then
        die "$CONF exists and was not written by this script; refusing to overwrite a real Slurm configuration"
    fi
    mkdir -p "$CONF_DIR" "${STATE}/ctld" "${STATE}/d"
    local memory
    memory=$(awk '/^MemTotal/ {print int($2 / 1024)}' /proc/meminfo)
    {
        echo "${MARK}; do not edit"
        echo "ClusterName=mpifl-local"
        echo "SlurmctldHost=${NODE}(127.0.0.1)"
        shared_settings "$STATE" ""
        echo "KillWait=30"
        echo "NodeName=${NODE} NodeAddr=127.0.0.1 CPUs=${CPUS} RealMemory=$((memory > 262144 ? memory : 262144))" \
            "Gres=gpu:${GPUS} State=UNKNOWN"
        echo "PartitionName=debug Nodes=${NODE} Default=YES MaxTime=INFINITE State=UP"
    } >"$CONF"
    # a gpu GRES needs device files: empty stand-ins, numbered like /dev/nvidiaN (CUDA_VISIBLE_DEVICES follows N)
    local i
    for ((i = 0; i < GPUS; i++)); do touch "${STATE}/fakegpu${i}"; done
    cat >"${CONF_DIR}/gres.conf" <<EOF
${MARK}; do not edit
NodeName=${NODE} Name=gpu File=${STATE}/fakegpu[0-$((GPUS - 1))]
EOF
}

wait_for_node() {
    for _ in $(seq 60); do
        local state
        state=$(sinfo -h -n "$NODE" -o %T 2>/dev/null || true)
        case $state in
            idle* | mixed* | allocated* | completing*) return 0 ;;
            down* | drain* | fail*) scontrol update nodename="$NODE" state=resume 2>/dev/null || true ;;
        esac
        sleep 0.5
    done
    say "node ${NODE} did not come up; last lines of the logs:"
    tail -n 20 "${STATE}/slurmctld.log" "${STATE}/slurmd.log" >&2 || true
    return 1
}

start() {
    [[ $(id -u) == 0 ]] || die "run as root (the daemons and /etc/slurm need it)"
    mkdir -p "$STATE"
    if alive "${STATE}/slurmctld.pid" && alive "${STATE}/slurmd.pid"; then
        say "already running"
        wait_for_node
        return
    fi
    install_packages
    start_munge
    write_config
    if ! alive "${STATE}/slurmctld.pid"; then
        # -c: start with no jobs from an earlier session; -i: ignore unreadable state files
        slurmctld -c -i
    fi
    for _ in $(seq 50); do scontrol ping >/dev/null 2>&1 && break; sleep 0.2; done
    alive "${STATE}/slurmd.pid" || slurmd -N "$NODE"
    wait_for_node
    say "up: node ${NODE}, ${CPUS} CPUs, ${GPUS} count-only GPUs, partition debug; logs in ${STATE}"
}

stop_pidfile() {  # stop_pidfile FILE NAME
    local pid
    alive "$1" || { rm -f "$1"; return 0; }
    pid=$(cat "$1")
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    if kill -0 "$pid" 2>/dev/null; then
        say "$2 ($pid) ignores SIGTERM; killing it"
        kill -9 "$pid" 2>/dev/null || true
    fi
    rm -f "$1"
}

stop() {
    stop_pidfile "${STATE}/slurmd.pid" slurmd
    stop_pidfile "${STATE}/slurmctld.pid" slurmctld
    stop_pidfile "${STATE}/munged.pid" munged  # only a munged this script started
    say "stopped"
}

status() {
    local up=0
    for daemon in slurmctld slurmd munged; do
        if alive "${STATE}/${daemon}.pid"; then
            echo "${daemon}: running (pid $(cat "${STATE}/${daemon}.pid"))"
        elif [[ $daemon == munged ]] && munge_ok; then
            echo "munged: running (not started by this script)"
        else
            echo "${daemon}: stopped"
            up=3
        fi
    done
    if ((up == 0)); then
        sinfo -N -o "%N %T %c %G %P" 2>&1 || up=3
        case $(sinfo -h -n "$NODE" -o %T 2>/dev/null) in
            idle* | mixed* | allocated* | completing*) ;;
            *) up=3 ;;
        esac
    fi
    return "$up"
}

# ------------------------------------------------------------------ a Slurm over the emulated hosts
# Every host of launch/hosts.py (node1..nodeN, up) is a node: slurmctld runs on node1, a slurmd on every host,
# each knowing itself by its hostname; munge is this machine's (its socket is on the shared file system).  The
# configuration is HOSTS_STATE/slurm.conf, which the client commands find through SLURM_CONF: run them on a host,
#   launch/hosts.py run node1 env SLURM_CONF=/var/tmp/mpifl-slurm-hosts/slurm.conf sbatch -N 2 slurm/X.sh
# (this machine's own network does not reach the hosts').  A node is declared down after 6 s without an answer
# (SlurmdTimeout), a batch job on a failed node is requeued (JobRequeue=1, the scripts' --requeue), and the
# processes of a job ended are killed 5 s after their SIGTERM (KillWait): small figures, for tests.
HOSTS_STATE=${MPIFL_SLURM_HOSTS_STATE:-/var/tmp/mpifl-slurm-hosts}
HOSTS=$(dirname "$(readlink -f "$0")")/hosts.py

on_host() {  # on_host HOST CMD...: CMD on the emulated HOST, with the hosts' Slurm configuration
    local host=$1
    shift
    "$HOSTS" run "$host" env SLURM_CONF="${HOSTS_STATE}/slurm.conf" "$@"
}

address_of() { "$HOSTS" status | awk -v h="$1" '$1 == h {print $2}'; }

write_hosts_config() {  # write_hosts_config NODE...
    local nodes memory node i
    nodes=$(IFS=,; echo "$*")
    memory=$(awk '/^MemTotal/ {print int($2 / 1024)}' /proc/meminfo)
    mkdir -p "${HOSTS_STATE}/ctld"
    {
        echo "${MARK}: a Slurm over the emulated hosts"
        echo "ClusterName=mpifl-hosts"
        echo "SlurmctldHost=$1($(address_of "$1"))"
        shared_settings "$HOSTS_STATE" "-%n"
        echo "KillWait=5"
        echo "SlurmdTimeout=6"
    } >"${HOSTS_STATE}/slurm.conf"
    for node in "$@"; do
        mkdir -p "${HOSTS_STATE}/d-${node}"
        echo "NodeName=${node} NodeAddr=$(address_of "$node") CPUs=${CPUS}" \
            "RealMemory=$((memory > 262144 ? memory : 262144)) Gres=gpu:${GPUS} State=UNKNOWN" \
            >>"${HOSTS_STATE}/slurm.conf"
    done
    echo "PartitionName=hosts Nodes=${nodes} Default=YES MaxTime=INFINITE State=UP" >>"${HOSTS_STATE}/slurm.conf"
    for ((i = 0; i < GPUS; i++)); do touch "${HOSTS_STATE}/fakegpu${i}"; done
    echo "NodeName=${nodes} Name=gpu File=${HOSTS_STATE}/fakegpu[0-$((GPUS - 1))]" >"${HOSTS_STATE}/gres.conf"
}

start_hosts() {
    [[ $(id -u) == 0 ]] || die "run as root (the daemons need it)"
    local nodes node
    read -ra nodes <<<"$("$HOSTS" names | tr '\n' ' ')"
    ((${#nodes[@]})) || die "no emulated hosts: start them first (launch/hosts.py start N)"
    "$HOSTS" status >/dev/null || die "a host is down or cut off: launch/hosts.py start ${#nodes[@]}"
    mkdir -p "$STATE" "$HOSTS_STATE"
    install_packages
    start_munge
    write_hosts_config "${nodes[@]}"
    on_host "${nodes[0]}" slurmctld -c -i
    for _ in $(seq 50); do on_host "${nodes[0]}" scontrol ping 2>/dev/null | grep -q UP && break; sleep 0.2; done
    for node in "${nodes[@]}"; do on_host "$node" slurmd; done
    for _ in $(seq 60); do
        on_host "${nodes[0]}" sinfo -h -o %T | grep -qvE '^(idle|mixed|allocated)' || break
        sleep 0.5
    done
    on_host "${nodes[0]}" sinfo -N -o "%N %T %c %G %P" >&2
    say "up on ${nodes[*]}; on a host: SLURM_CONF=${HOSTS_STATE}/slurm.conf (logs there)"
}

stop_hosts() {  # the daemons also end with their hosts (launch/hosts.py stop)
    local node first
    first=$("$HOSTS" names | head -n 1)
    for node in $("$HOSTS" names); do  # a pid file holds a number of its host's own PID namespace
        on_host "$node" sh -c "f=${HOSTS_STATE}/slurmd-${node}.pid; [ -s \$f ] && kill \$(cat \$f); true" || true
    done
    [[ -z $first ]] || on_host "$first" sh -c "f=${HOSTS_STATE}/slurmctld.pid; [ -s \$f ] && kill \$(cat \$f); true" \
        || true
    say "stopped the hosts' Slurm"
}

case ${1:-} in
    start) start ;;
    stop) stop ;;
    status) status ;;
    start-hosts) start_hosts ;;
    stop-hosts) stop_hosts ;;
    *) echo "usage: $0 start|stop|status|start-hosts|stop-hosts" >&2; exit 2 ;;
esac

