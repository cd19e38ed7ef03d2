"""This rank's node as the MPI library sees it: the world ranks that share its memory, and the cores they share."""

from __future__ import annotations

import socket

from mpi4py import MPI

from ..process.node_files import MPICH_NODE, forget_launcher_files, forget_segments
from .topology import NodeLayout, affinity


def node_layout(comm: MPI.Comm) -> NodeLayout:
    """The ranks of ``comm`` that share this rank's node (an MPI shared-memory split).  Having spoken to them (every
    one has started MPI), the rank unlinks MPICH's shared-memory file of the node and Hydra's topology file:
    nothing of them is left however the job ends (:mod:`mpifl.process.node_files`)."""
    mine = affinity()
    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.rank)
    everyone = dict(local.allgather((comm.rank, mine)))  # setup only: small pickled tuples
    local.Free()
    forget_segments(MPICH_NODE)
    forget_launcher_files()
    ranks = tuple(sorted(everyone))
    clients = tuple(r for r in ranks if r != 0)
    sharing = sum(1 for r in clients if everyone[r] & mine) if comm.rank != 0 else 1
    return NodeLayout(hostname=socket.gethostname(), rank=comm.rank, node_ranks=ranks, client_ranks=clients,
                      cores=len(mine), sharing=max(1, sharing))
