#!/usr/bin/env bash
# Single-node launcher: picks the number of MPI ranks from the run's clients and the node's GPUs/cores.
#
#   launch/local.sh --algo fedavg --data pacs --rounds 100      # any `python -m mpifl.run` options
#
# Ranks = 1 server + min(clients, slots), where slots = GPUs on the node if any,
# else CPU cores; MPIFL_RANKS overrides the total (a whole number >= 1; 1 runs the server and
# one client host in one process), MPIRUN names the launcher.
set -euo pipefail
if [[ -n ${MPIFL_RANKS:-} ]] && ! { [[ ${MPIFL_RANKS} =~ ^[0-9]{1,6}$ ]] && ((10#${MPIFL_RANKS} >= 1)); }; then
    echo "launch/local.sh: error: MPIFL_RANKS=${MPIFL_RANKS} is no number of ranks; set a whole number >= 1," \
        "or unset it for 1 + min(clients, GPUs or cores)" >&2
    exit 2
fi
manifest=$(python -m mpifl.run "$@" --show-manifest) || exit $?  # mpifl prints its own error
clients=$(sed -n 's/^clients: \([0-9]*\).*/\1/p' <<<"${manifest}")
gpus=$(python -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")
slots=$(( gpus > 0 ? gpus : $(nproc) ))
ranks=$(( ${MPIFL_RANKS:+10#}${MPIFL_RANKS:-1 + (clients < slots ? clients : slots)} ))
echo "launch/local.sh: ${clients} clients, ${gpus} GPUs, $(nproc) cores -> mpirun -n ${ranks}" >&2
exec "${MPIRUN:-mpirun}" -n "${ranks}" python -m mpifl.run "$@"
