import threading

import numpy as np
import pytest

from mpifl.algorithms import Reduction, weighted_mean
from mpifl.algorithms.core.reduction import SUM_BLOCK, mean_weights, weighted_sum
from mpifl.server import folding as folding_module
from mpifl.server.folding import Behind, Folding, FoldThreads, fold_threads, ranges
from mpifl.transport.topology import NodeLayout

SPLIT_BLOCK = 4 * SUM_BLOCK


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
    """--fold-threads 32 where rank 0 may run on 2 cores: 2, not 30 more threads waiting for a core."""
    two = frozenset({0, 1})
    assert fold_threads(_server((0, 1, 2), cores=2), 32, [two] * 3, [1, 2, 2]) == (2, True)
    assert fold_threads(_server((0, 1, 2), cores=2), 2, [two] * 3, [1, 2, 2]) == (2, True)


SPLITS = [([3 * SUM_BLOCK + 17], 2), ([35, 1, SUM_BLOCK - 1, 2 * SUM_BLOCK + 3], 3),
          ([0, 5 * SUM_BLOCK, 1], 7), ([10], 4), ([0], 3)]


@pytest.mark.parametrize("block", [SUM_BLOCK, 4 * SUM_BLOCK])
@pytest.mark.parametrize("sizes, parts", SPLITS)
def test_ranges_cover_every_element_once_in_block_aligned_runs(sizes, parts, block):
    runs = ranges(sizes, parts, block)
    blocks = sum(-(-n // block) for n in sizes)
    assert len(runs) == max(1, min(parts, blocks))
    covered = [np.zeros(n, np.int64) for n in sizes]
    for run in runs:
        for index, start, stop in run:
            assert start % block == 0 and start < stop <= sizes[index]
            covered[index][start:stop] += 1
    assert all((c == 1).all() for c in covered)
    counts = [sum(-(-(stop - start) // block) for _, start, stop in run) for run in runs]
    assert max(counts) - min(counts) <= 1  # as near equal in blocks as can be


@pytest.mark.parametrize("window", [1, 2, 3, 5])
def test_folding_in_windows_gives_the_single_pass_bits(window):
    """Rank 0 folds the uploads a window at a time; every window size gives the one-pass sums exactly."""
    rng = np.random.default_rng(1)
    uploads = [{"a": rng.standard_normal((2 * SUM_BLOCK + 5,)).astype(np.float32),
                "b": rng.standard_normal((3, 4)).astype(np.float32)} for _ in range(5)]
    weights = rng.uniform(1, 100, 5)
    reductions = {"mean_a": Reduction("a", mean_weights(weights)), "sum_a": Reduction("a", [0.5, 0, 2, 0, -1]),
                  "mean_b": Reduction("b", mean_weights(weights))}
    folding = Folding(reductions)
    for start in range(0, 5, window):
        folding.add(uploads[start:start + window])
    assert folding.folded == 5
    np.testing.assert_array_equal(folding.sums["mean_a"], weighted_mean([u["a"] for u in uploads], weights))
    np.testing.assert_array_equal(folding.sums["sum_a"], weighted_sum([u["a"] for u in uploads], [0.5, 0, 2, 0, -1]))
    np.testing.assert_array_equal(folding.sums["mean_b"], weighted_mean([u["b"] for u in uploads], weights))
    assert not np.array_equal(folding.sums["mean_a"], weighted_mean([u["a"] for u in uploads[::-1]], weights[::-1]))


def _order_sensitive(rng, shape, k):
    """Uploads whose float64 sums change with the order of the additions: magnitudes from 1e-8 to 1e8."""
    return [(rng.standard_normal(shape) * 10.0 ** rng.integers(-8, 9, shape)).astype(np.float32) for _ in range(k)]


def _sequential(values, coefficients):
    """The plain chain of additions, client by client over whole arrays."""
    acc = np.zeros(values[0].shape, np.float64)
    for c, x in zip(coefficients, values):
        if c:
            acc += np.float64(c) * x.astype(np.float64)
    return acc


@pytest.mark.parametrize("threads", [1, 2, 3, 7])
def test_folding_on_threads_gives_the_sequential_bits_for_any_count(threads):
    """Odd sizes (no multiple of the block), zero coefficients and several windows: every count of threads gives
    the plain sequential chain's bits, which the reversed order of the same uploads does not."""
    rng = np.random.default_rng(2)
    shapes = {"a": (3 * SPLIT_BLOCK + 17,), "b": (5, 7), "c": (), "d": (SUM_BLOCK - 1,), "e": (2, SPLIT_BLOCK + 3)}
    k = 6
    coefficients = {name: rng.uniform(-2, 2, k) for name in shapes}
    coefficients["a"][[1, 4]] = 0.0
    reductions = {name: Reduction(name, coefficients[name]) for name in shapes}
    uploads = {name: _order_sensitive(rng, shape, k) for name, shape in shapes.items()}
    with FoldThreads(threads) as pool:
        folding = Folding(reductions, pool)
        for window in ([0], [1, 2, 3], [4, 5]):
            folding.add([{name: uploads[name][i] for name in shapes} for i in window])
    for name in shapes:
        reference = _sequential(uploads[name], coefficients[name])
        assert folding.sums[name].shape == shapes[name]
        np.testing.assert_array_equal(folding.sums[name], reference)
    assert not np.array_equal(folding.sums["a"], _sequential(uploads["a"][::-1], coefficients["a"][::-1]))


def test_a_fold_whose_ranges_overlap_or_run_out_of_order_is_caught(monkeypatch):
    """The sequential reference tells a wrong split apart: ranges that overlap add an element twice, and
    clients added in another order round otherwise."""
    rng = np.random.default_rng(3)
    coefficients = rng.uniform(0.1, 2, 5)
    split = folding_module.ranges

    def overlapping(sizes, parts, block=SUM_BLOCK):
        runs = split(sizes, parts, block)
        return runs[:1] + [[(i, max(0, start - block), stop) for i, start, stop in run] for run in runs[1:]]

    values = _order_sensitive(rng, (4 * SPLIT_BLOCK + 9,), 5)
    reference = _sequential(values, coefficients)

    def fold(values, coefficients, threads):
        acc = np.zeros(values[0].shape)  # added to, not zeroed by the fold, where a zeroed block would be folded
        threads.fold([(acc, list(zip(coefficients, values)))])  # again alike
        return acc

    with FoldThreads(3) as pool:
        monkeypatch.setattr(folding_module, "ranges", overlapping)
        assert not np.array_equal(fold(values, coefficients, pool), reference)
        monkeypatch.setattr(folding_module, "ranges", split)
        shuffled = [values[i] for i in (0, 2, 1, 3, 4)]
        assert not np.array_equal(fold(shuffled, coefficients[[0, 2, 1, 3, 4]], pool), reference)
        np.testing.assert_array_equal(fold(values, coefficients, pool), reference)


@pytest.mark.parametrize("threads, behind", [(1, True), (2, True), (2, False)])
def test_folding_behind_gives_the_sequential_bits_and_waits_for_what_is_asked(threads, behind):
    """Windows handed over one after another, faster or slower than the fold, are folded in client-id order on
    a thread of their own (behind) or at once in the caller's; ``wait(k)`` returns once the first k are in."""
    rng = np.random.default_rng(4)
    coefficients = rng.uniform(-1, 1, 9)
    folded_on = set()

    class Recorded(Folding):
        def add(self, window):
            folded_on.add(threading.get_ident())
            super().add(window)

    values = _order_sensitive(rng, (2 * SPLIT_BLOCK + 5,), 9)
    with FoldThreads(threads, behind) as pool:
        folding = Recorded({"s": Reduction("x", coefficients)}, pool)
        handed = Behind(folding)
        for start, stop in ((0, 1), (1, 4), (4, 6), (6, 7), (7, 9)):
            handed.hand([{"x": x} for x in values[start:stop]])
            assert behind or folding.folded == stop
            if stop == 4:
                handed.wait(4)
                assert folding.folded >= 4
        handed.wait(len(values))
    assert folding.folded == len(values) and (threading.get_ident() in folded_on) != behind
    np.testing.assert_array_equal(folding.sums["s"], _sequential(values, coefficients))


def test_a_failed_fold_behind_is_raised_where_it_is_waited_for():
    with FoldThreads(2) as pool:
        behind = Behind(Folding({"s": Reduction("x", [1.0, 1.0])}, pool))
        behind.hand([{"x": np.zeros(3, np.int64)}])
        with pytest.raises(TypeError, match="floating-point"):
            behind.wait(1)
