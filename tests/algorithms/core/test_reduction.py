import numpy as np
import pytest

from mpifl.algorithms import weighted_mean
from mpifl.algorithms.core.reduction import SUM_BLOCK, fold_ranges, weighted_sum


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


@pytest.mark.parametrize("block", [1, 7, SUM_BLOCK, 4 * SUM_BLOCK])
def test_the_kernel_gives_the_same_bits_in_blocks_of_any_size(block):
    """Each element's chain is the same whatever the block: every size gives the one-block sums exactly."""
    rng = np.random.default_rng(6)
    values = [(rng.standard_normal(SUM_BLOCK + 9) * 10.0 ** rng.integers(-8, 9, SUM_BLOCK + 9)).astype(np.float32)
              for _ in range(5)]
    terms = list(zip(rng.uniform(-2, 2, 5), values))
    acc, whole = np.empty(SUM_BLOCK + 9), np.empty(SUM_BLOCK + 9)
    fold_ranges([(acc, terms)], [(0, 0, acc.size)], zero=True, block=block)
    fold_ranges([(whole, terms)], [(0, 0, whole.size)], zero=True, block=whole.size)
    np.testing.assert_array_equal(acc, whole)


def test_a_range_with_zero_overwrites_what_its_blocks_held_and_leaves_the_rest():
    size = 5
    acc = np.full(3 * size, 7.0)
    x = np.arange(3 * size, dtype=np.float32)
    fold_ranges([(acc, [(2.0, x)])], [(0, size, 3 * size)], zero=True, block=size)
    np.testing.assert_array_equal(acc[:size], 7.0)
    np.testing.assert_array_equal(acc[size:], 2.0 * x[size:])
    fold_ranges([(acc, [(1.0, x)])], [(0, 0, size)], block=size)
    np.testing.assert_array_equal(acc[:size], 7.0 + x[:size])
