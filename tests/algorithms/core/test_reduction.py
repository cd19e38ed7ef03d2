import threading

import numpy as np
import pytest

from mpifl.algorithms import Folding, Reduction, weighted_mean
from mpifl.algorithms.core import fold_workers
from mpifl.algorithms.core.fold_workers import SUM_BLOCK, FoldWorkers
from mpifl.algorithms.core.reduction import Behind, mean_weights, weighted_sum

SPLIT_BLOCK = 4 * SUM_BLOCK


def test_weighted_mean_in_float64_and_order_fixed():
    values = [np.full(3, 1.0, np.float32), np.full(3, 4.0, np.float32)]
    out = weighted_mean(values, np.array([3.0, 1.0]))
    assert out.dtype == np.float64 and np.allclose(out, 1.75)
    with pytest.raises(TypeError):
        weighted_mean([np.zeros(2, np.int64)], np.ones(1))
    with pytest.raises(ValueError):
        weighted_mean(values, np.ones(3))


@pytest.mark.parametrize("shape", [(), (7,), (3, 5), (2 * SUM_BLOCK + 11,), (4, SUM_BLOCK // 2 + 3)])
def test_blocked_weighted_sum_equals_the_whole_array_sum_bit_for_bit(shape):
    rng = np.random.default_rng(0)
    values = [rng.standard_normal(shape).astype(np.float32) for _ in range(4)]
    coefficients = [0.25, 0.0, 1.5, -3.0]
    reference = np.zeros(shape, np.float64)
    for c, x in zip(coefficients, values):
        if c:
            reference += np.float64(c) * x.astype(np.float64)
    out = weighted_sum(values, coefficients)
    assert out.dtype == np.float64 and out.shape == shape
    np.testing.assert_array_equal(out, reference)


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


def _shared(workers, arrays):
    """Copies of ``arrays`` in memory that the workers' helpers share (as the server's receive buffer)."""
    copies = []
    for array in arrays:
        copies.append(workers.empty(array.nbytes).view(array.dtype).reshape(array.shape))
        copies[-1][...] = array
    return copies


@pytest.mark.parametrize("workers", [1, 2, 3, 7])
def test_folding_on_workers_gives_the_sequential_bits_for_any_count(workers):
    """Odd sizes (no multiple of the block), zero coefficients and several windows, the uploads in shared memory:
    every count of workers (this thread and helper processes) gives the plain sequential chain's bits, which the
    reversed order of the same uploads does not; so do sums that reuse a block of memory the last fold left."""
    rng = np.random.default_rng(2)
    shapes = {"a": (3 * SPLIT_BLOCK + 17,), "b": (5, 7), "c": (), "d": (SUM_BLOCK - 1,), "e": (2, SPLIT_BLOCK + 3)}
    k = 6
    coefficients = {name: rng.uniform(-2, 2, k) for name in shapes}
    coefficients["a"][[1, 4]] = 0.0
    reductions = {name: Reduction(name, coefficients[name]) for name in shapes}
    with FoldWorkers(workers) as pool:
        uploads = {name: _shared(pool, _order_sensitive(rng, shape, k)) for name, shape in shapes.items()}
        for _ in range(3):  # the third reuses the first's block, which holds its sums
            folding = Folding(reductions, pool)
            for window in ([0], [1, 2, 3], [4, 5]):
                folding.add([{name: uploads[name][i] for name in shapes} for i in window])
        alone = weighted_sum(uploads["a"], coefficients["a"], workers=pool)
    for name in shapes:
        reference = _sequential(uploads[name], coefficients[name])
        assert folding.sums[name].shape == shapes[name]
        np.testing.assert_array_equal(folding.sums[name], reference)
    np.testing.assert_array_equal(alone, _sequential(uploads["a"], coefficients["a"]))
    assert not np.array_equal(folding.sums["a"], _sequential(uploads["a"][::-1], coefficients["a"][::-1]))


def test_a_fold_whose_ranges_overlap_or_run_out_of_order_is_caught(monkeypatch):
    """The sequential reference tells a wrong split apart: ranges that overlap add an element twice, and
    clients added in another order round otherwise."""
    rng = np.random.default_rng(3)
    coefficients = rng.uniform(0.1, 2, 5)
    split = fold_workers.ranges

    def overlapping(sizes, parts, block=SUM_BLOCK):
        runs = split(sizes, parts, block)
        return runs[:1] + [[(i, max(0, start - block), stop) for i, start, stop in run] for run in runs[1:]]

    with FoldWorkers(3) as pool:
        values = _shared(pool, _order_sensitive(rng, (4 * SPLIT_BLOCK + 9,), 5))
        reference = _sequential(values, coefficients)
        monkeypatch.setattr(fold_workers, "ranges", overlapping)
        zeros = pool.sums({"s": values[0].shape})["s"]
        zeros[:] = 0.0  # added to, not zeroed by the fold, where a zeroed block would be folded again alike
        assert not np.array_equal(weighted_sum(values, coefficients, out=zeros, workers=pool), reference)
        monkeypatch.setattr(fold_workers, "ranges", split)
        shuffled = [values[i] for i in (0, 2, 1, 3, 4)]
        assert not np.array_equal(weighted_sum(shuffled, coefficients[[0, 2, 1, 3, 4]], workers=pool), reference)
        np.testing.assert_array_equal(weighted_sum(values, coefficients, workers=pool), reference)


@pytest.mark.parametrize("workers, behind", [(1, True), (2, True), (2, False)])
def test_folding_behind_gives_the_sequential_bits_and_waits_for_what_is_asked(workers, behind):
    """Windows handed over one after another, faster or slower than the fold, are folded in client-id order on
    a thread of their own (behind) or at once in the caller's; ``wait(k)`` returns once the first k are in."""
    rng = np.random.default_rng(4)
    coefficients = rng.uniform(-1, 1, 9)
    folded_on = set()

    class Recorded(Folding):
        def add(self, window):
            folded_on.add(threading.get_ident())
            super().add(window)

    with FoldWorkers(workers, behind) as pool:
        values = _shared(pool, _order_sensitive(rng, (2 * SPLIT_BLOCK + 5,), 9))
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
    with FoldWorkers(2) as pool:
        behind = Behind(Folding({"s": Reduction("x", [1.0, 1.0])}, pool))
        behind.hand([{"x": np.zeros(3, np.int64)}])
        with pytest.raises(TypeError, match="floating-point"):
            behind.wait(1)
