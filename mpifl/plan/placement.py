"""Fixed placement of logical clients on client ranks (docs/design.md, "How a round is computed").

Clients are placed once, balanced by training-sample count, and never move.
The rule is the classic longest-processing-time greedy: take clients from
largest to smallest (ties by id) and give each to the host with the fewest
samples so far (ties by lowest host).  It depends only on the sizes and the
number of hosts, so every rank computes the same placement without talking.
"""

from __future__ import annotations

from typing import Sequence


def place_clients(sizes: Sequence[int], num_hosts: int) -> list[list[int]]:
    """Client ids per host (host h is MPI rank h+1), each list ascending."""
    if num_hosts < 1:
        raise ValueError("need at least one client host")
    load = [0] * num_hosts
    hosted: list[list[int]] = [[] for _ in range(num_hosts)]
    for client in sorted(range(len(sizes)), key=lambda c: (-sizes[c], c)):
        host = min(range(num_hosts), key=lambda h: (load[h], h))
        hosted[host].append(client)
        load[host] += sizes[client]
    return [sorted(h) for h in hosted]

