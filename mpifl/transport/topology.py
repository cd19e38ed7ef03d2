"""Where a rank sits on its node: used to bind GPUs and to size each rank's threads."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence


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


#: at most this many cores fold automatically: each but rank 0's own is a helper process (about 30 MB), and a fold
#: streams memory, which a few cores fill (not measured beyond 2 cores: docs/benchmarks.md)
AUTO_FOLD_CORES = 8


def fold_threads(layout: NodeLayout, requested: int, cores: Sequence[frozenset[int]],
                 threads: Sequence[int]) -> tuple[int, bool]:
    """Rank 0's cores for folding the uploads (itself and helper processes,
    :mod:`mpifl.algorithms.core.fold_workers`), and whether they fold behind its receives (``--fold-threads``;
    0 = automatic).  Given, they fold behind, on the cores rank 0 may run on at most (a helper beyond them would
    only wait for a core, in memory of its own).  Automatic: the spare cores, those rank 0 may run on less the ones
    its node's client ranks train on, at least 1 and at most :data:`AUTO_FOLD_CORES`; behind only where one is
    spare (else a fold behind the receives takes the core of a rank that trains or sends, and rank 0 folds between
    them).
    ``cores`` and ``threads``: each rank's cores (:func:`affinity`) and the threads it trains on (its torch
    threads; one for a rank that trains on a GPU), indexed by world rank; a client rank takes its threads, or the
    cores it shares with rank 0 where fewer (one bound to cores of its own takes none)."""
    mine = cores[layout.rank]
    if requested > 0:
        return min(requested, len(mine)), True
    spare = len(mine) - sum(min(threads[rank], len(cores[rank] & mine)) for rank in layout.client_ranks)
    return max(1, min(spare, AUTO_FOLD_CORES)), spare > 0
