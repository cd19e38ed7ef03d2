import numpy as np
import pytest

from mpifl.algorithms import Folding, Reduction, weighted_mean
from mpifl.algorithms.core.reduction import SUM_BLOCK, mean_weights, weighted_sum


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
