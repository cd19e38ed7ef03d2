"""The server's start-up lines: each rank's clients, exact and short at any scale."""

import pytest

from mpifl.server.serve import describe_clients


@pytest.mark.parametrize("ids,line", [
    ([], "no clients (idle)"),
    ([4], "client 4"),
    ([0, 3], "2 clients: 0, 3"),
    ([0, 1, 2, 3, 7], "5 clients: 0..3, 7"),
    (list(range(0, 1000, 2)), "500 clients: 0..998 step 2"),
    ([0, 1, 3, 5, 6], "5 clients: 0, 1..5 step 2, 6"),
])
def test_a_ranks_clients_are_written_as_runs(ids, line):
    assert describe_clients(ids) == line


def test_the_runs_give_back_every_id():
    ids = sorted({(7 * k) % 1013 for k in range(300)} | set(range(40, 60)))
    back = []
    for part in describe_clients(ids).split(": ", 1)[1].split(", "):
        first, _, rest = part.partition("..")
        last, _, step = rest.partition(" step ")
        back += list(range(int(first), int(last or first) + 1, int(step or 1)))
    assert back == ids
