import pytest

from mpifl.transport.topology import NodeLayout, fold_threads


def _server(node_ranks, cores=16):
    return NodeLayout(hostname="node", rank=0, node_ranks=node_ranks, client_ranks=node_ranks[1:], cores=cores,
                      sharing=1)


ALL = frozenset(range(16))


@pytest.mark.parametrize("node_ranks, threads, expected", [
    ((0, 1, 2, 3, 4), [1, 3, 3, 3, 3], (4, True)),  # 4 unbound client ranks of 3 threads on 16 cores leave 4
    ((0, 1, 2), [1, 8, 8], (1, False)),  # none spare: 1 thread, folding between the receives
    ((0, 1, 2), [1, 9, 9], (1, False)),
    ((0,), [1, 4, 4], (8, True)),  # every client rank on other nodes: 16 spare, at most 8 fold
    ((0, 2), [1, 4, 4], (8, True)),  # rank 1 on another node, rank 2 on rank 0's: 12 spare
    ((0, 2), [1, 4, 9], (7, True)),  # 7 spare
])
def test_automatic_fold_threads_are_the_cores_the_nodes_client_ranks_leave(node_ranks, threads, expected):
    assert fold_threads(_server(node_ranks), 0, [ALL] * len(threads), threads) == expected


def test_client_ranks_bound_to_cores_of_their_own_leave_rank_0_all_of_its():
    """srun --cpus-per-task=4: rank 0 has cores 0-3, each client rank four others (its threads: its cores)."""
    cores = [frozenset(range(4 * r, 4 * r + 4)) for r in range(4)]
    layout = _server((0, 1, 2, 3), cores=4)
    assert fold_threads(layout, 0, cores, [1, 4, 4, 4]) == (4, True)
    overlapping = [cores[0], frozenset({2, 3, 4, 5}), cores[2], cores[3]]  # rank 1 shares cores 2 and 3
    assert fold_threads(layout, 0, overlapping, [1, 4, 4, 4]) == (2, True)


def test_fold_threads_given_are_taken_as_given_and_fold_behind_the_receives():
    assert fold_threads(_server((0, 1, 2)), 3, [ALL] * 3, [1, 8, 8]) == (3, True)


def test_fold_threads_given_beyond_rank_0s_cores_fold_on_its_cores():
    """--fold-threads 32 where rank 0 may run on 2 cores: 2, not 31 helpers waiting for a core (2.7 GB)."""
    two = frozenset({0, 1})
    assert fold_threads(_server((0, 1, 2), cores=2), 32, [two] * 3, [1, 2, 2]) == (2, True)
    assert fold_threads(_server((0, 1, 2), cores=2), 2, [two] * 3, [1, 2, 2]) == (2, True)
