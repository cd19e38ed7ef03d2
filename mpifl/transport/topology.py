"""Where a rank sits on its node: used to bind GPUs and to size each rank's threads."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class NodeLayout:
    """This rank's node: its ranks, the client ranks among them, and this rank's cores."""

    hostname: str
    rank: int  # this rank (world numbering)
    node_ranks: tuple[int, ...]  # world ranks on this node, ascending
    client_ranks: tuple[int, ...]  # the node's ranks that host clients (all but 0)
    cores: int  # cores this rank may run on
    sharing: int  # client ranks of this node whose cores overlap this rank's (itself included)

    @property
    def client_index(self) -> int:
        """Position of this rank among its node's client ranks (-1 for the server)."""
        return self.client_ranks.index(self.rank) if self.rank in self.client_ranks else -1


def affinity() -> frozenset[int]:
    """Cores this process may run on (respects Slurm/cgroup/mpirun binding)."""
    try:
        return frozenset(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return frozenset(range(os.cpu_count() or 1))
