import gc
import os
import signal

import numpy as np
import pytest

from mpifl.algorithms.core import fold_helper, fold_workers
from mpifl.algorithms.core.fold_workers import SEGMENTS, SUM_BLOCK, FoldWorkers, ranges
from mpifl.errors import MpiflError
from mpifl.process.signals import STOP_SIGNALS

pytestmark = pytest.mark.skipif(not fold_workers.SHARED, reason="no memfd_create: folds run without helpers")

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


def _uploads(pool, size, k, seed=0):
    rng = np.random.default_rng(seed)
    uploads = [pool.empty(4 * size).view(np.float32) for _ in range(k)]
    for upload in uploads:
        upload[:] = rng.standard_normal(size)
    return uploads, rng.uniform(-1, 1, k)


def _fold(pool, uploads, coefficients):
    acc = pool.sums({"s": uploads[0].shape})["s"]
    pool.fold([(acc, list(zip(coefficients, uploads)))], zero=True)
    return acc


def _reference(uploads, coefficients):
    acc = np.zeros(uploads[0].shape)
    for c, x in zip(coefficients, uploads):
        acc += np.float64(c) * x.astype(np.float64)
    return acc


def test_the_helpers_fold_every_run_but_the_first(monkeypatch):
    """With this thread's own fold taken out, exactly the first run stays unfolded: the helper processes did the
    others, in shared memory."""
    with FoldWorkers(3) as pool:
        uploads, coefficients = _uploads(pool, 6 * SUM_BLOCK + 5, 4)
        monkeypatch.setattr(fold_workers, "fold_run", lambda sums, run, zero: None)
        acc = pool.sums({"s": uploads[0].shape})["s"]
        acc[:] = np.nan
        pool.fold([(acc, list(zip(coefficients, uploads)))], zero=True)
    first = ranges([acc.size], 3)[0][0][2]
    assert first == 2 * SUM_BLOCK and np.isnan(acc[:first]).all()
    np.testing.assert_array_equal(acc[first:], _reference(uploads, coefficients)[first:])


def test_arrays_outside_shared_memory_are_folded_here_to_the_same_bits(monkeypatch):
    with FoldWorkers(3) as pool:
        uploads, coefficients = _uploads(pool, 3 * SUM_BLOCK, 3)
        private = [upload.copy() for upload in uploads]
        asked = []
        monkeypatch.setattr(fold_workers._Helper, "request", lambda *args: asked.append(args))
        np.testing.assert_array_equal(_fold(pool, private, coefficients), _reference(uploads, coefficients))
        assert not asked
        acc = np.empty(uploads[0].shape)  # the sums outside shared memory
        pool.fold([(acc, list(zip(coefficients, uploads)))], zero=True)
        assert not asked
        np.testing.assert_array_equal(acc, _reference(uploads, coefficients))


def test_a_fold_over_more_segments_than_a_request_can_carry_is_folded_here_to_the_same_bits(monkeypatch):
    request, asked = fold_workers._Helper.request, []
    monkeypatch.setattr(fold_workers._Helper, "request", lambda *args: asked.append(args) or request(*args))
    with FoldWorkers(2) as pool:
        uploads, coefficients = _uploads(pool, 3 * SUM_BLOCK, 3)  # with the sums' block: 4 segments
        for carried, requests in [(3, 0), (4, 1)]:
            monkeypatch.setattr(fold_helper, "MAX_FDS", carried)
            np.testing.assert_array_equal(_fold(pool, uploads, coefficients), _reference(uploads, coefficients))
            assert len(asked) == requests


def _mapped_segments(pid):
    with open(f"/proc/{pid}/maps") as maps:
        return sum("mpifl-fold" in line for line in maps)


def test_a_segment_rank_0_drops_is_unmapped_by_the_helpers_with_the_next_fold():
    with FoldWorkers(2) as pool:
        (helper,) = pool.pids
        uploads, coefficients = _uploads(pool, 2 * SUM_BLOCK, 2)
        kept = _fold(pool, uploads, coefficients)
        assert _mapped_segments(helper) == 3  # two uploads and the sums
        del uploads
        gc.collect()
        others, coefficients = _uploads(pool, 2 * SUM_BLOCK, 2, seed=1)
        _fold(pool, others, coefficients)
        assert _mapped_segments(helper) == 4  # the two new uploads and two blocks of sums (kept holds the first)
        assert len(SEGMENTS.live()) == 4
    assert kept.shape == (2 * SUM_BLOCK,)


def test_a_block_of_sums_is_reused_only_once_nothing_holds_it():
    address = lambda sums: sums["s"].__array_interface__["data"][0]  # noqa: E731
    with FoldWorkers(2) as pool:
        first = pool.sums({"s": (10,), "t": (3, 4)})
        second = pool.sums({"s": (10,)})
        third = pool.sums({"s": (10,)})  # both kept blocks are held
        assert len({address(first), address(second), address(third)}) == 3
        freed = address(second)
        del second
        fourth = pool.sums({"s": (10,)})
        assert address(fourth) == freed
        fifth = pool.sums({"s": (10,)})  # the kept blocks (the third's and the fourth's) are held
        assert address(fifth) not in (address(first), address(third), address(fourth))


def test_a_helper_that_died_ends_the_fold_with_a_message_naming_it():
    with FoldWorkers(2) as pool:
        uploads, coefficients = _uploads(pool, 4 * SUM_BLOCK, 2)
        (pid,) = pool.pids
        os.kill(pid, signal.SIGKILL)
        pool._helpers[0].process.wait()
        with pytest.raises(MpiflError, match=rf"fold helper process \(pid {pid}\) stopped answering: it was killed "
                                             r"by signal 9; .* \(--fold-threads 1\)"):
            _fold(pool, uploads, coefficients)


def test_a_helper_that_fails_reports_why(monkeypatch):
    describe = SEGMENTS.describe
    monkeypatch.setattr(SEGMENTS, "describe", lambda arrays: [d[:2] + ["<f3"] + d[3:] for d in describe(arrays)])
    with FoldWorkers(2) as pool:
        uploads, coefficients = _uploads(pool, 4 * SUM_BLOCK, 2)
        with pytest.raises(MpiflError, match="TypeError: data type '<f3' not understood"):
            _fold(pool, uploads, coefficients)


def test_helpers_ignore_stop_signals_and_end_with_their_workers():
    with FoldWorkers(3) as pool:
        helpers = list(pool._helpers)
        uploads, coefficients = _uploads(pool, 4 * SUM_BLOCK, 3)
        _fold(pool, uploads, coefficients)  # the helpers are up
        for pid in pool.pids:
            for stop in STOP_SIGNALS:
                os.kill(pid, stop)
        np.testing.assert_array_equal(_fold(pool, uploads, coefficients), _reference(uploads, coefficients))
    assert [helper.process.returncode for helper in helpers] == [0, 0]


def test_a_stopped_helper_is_named_after_the_timeout_and_killed():
    """``kill -STOP`` on a helper under --round-timeout: rank 0's fold gives up after the timeout, naming the helper
    and the fix, instead of waiting until a client rank times out blaming the uploads."""
    with FoldWorkers(2, timeout=1.0) as pool:
        uploads, coefficients = _uploads(pool, 4 * SUM_BLOCK, 2)
        _fold(pool, uploads, coefficients)  # the helper is up
        helper = pool._helpers[0].process
        os.kill(helper.pid, signal.SIGSTOP)
        with pytest.raises(MpiflError) as failed:
            _fold(pool, uploads, coefficients)
        assert str(failed.value) == (f"rank 0's fold helper process (pid {helper.pid}) did not answer for 1 s "
                                     "(--round-timeout): it was stopped or hung; fold without helpers "
                                     "(--fold-threads 1)")
        assert helper.returncode == -signal.SIGKILL  # not left stopped behind rank 0
