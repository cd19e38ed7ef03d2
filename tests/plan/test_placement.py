from mpifl.plan.placement import place_clients


def test_every_client_placed_once_and_lists_ascending():
    sizes = [50, 10, 40, 30, 20, 60, 5]
    placement = place_clients(sizes, 3)
    flat = sorted(c for h in placement for c in h)
    assert flat == list(range(len(sizes)))
    assert all(h == sorted(h) for h in placement)


def test_balanced_by_samples():
    sizes = [100, 90, 80, 70, 60, 50, 40, 30]
    placement = place_clients(sizes, 2)
    loads = [sum(sizes[c] for c in h) for h in placement]
    assert max(loads) - min(loads) <= 10  # LPT gives 260 / 260 here
    assert sum(loads) == sum(sizes)


def test_equal_sizes_spread_round_robin_and_deterministic():
    assert place_clients([5] * 5, 2) == [[0, 2, 4], [1, 3]]
    assert place_clients([5] * 5, 2) == place_clients([5] * 5, 2)


def test_more_hosts_than_clients_leaves_hosts_empty():
    placement = place_clients([3, 4], 4)
    assert sorted(len(h) for h in placement) == [0, 0, 1, 1]
    assert placement == [[1], [0], [], []]  # the larger client first
