"""Aggregation as a reduction: weighted sums of the clients' uploads, folded as they arrive.

Rank 0 never holds a round's uploads all at once.  A method states its aggregation as

1. :meth:`Algorithm.reductions`: the weighted sums sum_k c_k x_k it needs, each of one uploaded tensor
   (by default every uploaded model entry's weighted mean, c_k = w_k / sum_j w_j), computed from the
   round's plan before the clients train;
2. :meth:`Algorithm.prepare`: what it needs from every client's small tensors (the entries it names in
   :meth:`Algorithm.gathered_keys`, gathered whole) and the clients' records;
3. :meth:`Algorithm.aggregate`: the new global state from those sums (``Uploads.sums``).

While the clients train, the server receives the other uploaded tensors client by client, in client-id
order, and :class:`Folding` adds them into float64 sums, in the background (:class:`Behind`) while the next
upload arrives.  A method whose sums need what training returned (:attr:`Algorithm.reductions_need_results`:
FedNova's steps, FedDG-GA's gaps) runs 2 before 1, after the gather, and is folded then.  Every sum is
accumulated in client-id order, element by element exactly as a single pass over all uploads would
(:func:`weighted_sum`), so the result is bit for bit the same whoever hosts which client, however many arrive
at once and however many threads (:class:`FoldThreads`) share the elements: rank-count invariance holds, and
rank 0's memory is a few uploads plus the sums, whatever the number of clients in the round.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import numpy as np

SUM_BLOCK = 1 << 14  # elements per block: the float64 partial sum and one term stay in the L1/L2 cache
#: Elements per block of a fold that several threads share: each numpy call then holds the GIL released long
#: enough that a thread woken for it seldom finds another holding it (12 x 45 MB on the 2-core development VM:
#: 2 threads take 0.97x one thread's time with blocks of SUM_BLOCK, 0.73x with these, docs/benchmarks.md); a
#: thread's part of the sum, its term and the upload's block take 1.3 MB of its L2 cache.
SHARED_BLOCK = 4 * SUM_BLOCK


@dataclass(frozen=True)
class Reduction:
    """sum_k c_k x_k of the uploaded tensor ``upload`` over the round's clients (client-id order)."""

    upload: str
    coefficients: Sequence[float]  # (K,): one per client of the round, in client-id order


def mean_weights(weights: np.ndarray) -> np.ndarray:
    """The coefficients of a weighted mean, w_k / sum_j w_j (float64)."""
    weights = np.asarray(weights, dtype=np.float64)
    return weights / weights.sum()


class FoldThreads:
    """``count`` threads that share every fold by element ranges: the thread that folds takes the first range,
    ``count - 1`` persistent pool threads the others.  With ``behind``, :class:`Behind` folds on one more thread
    of its own while its caller receives (rank 0 has a core that no client rank trains on); without, in the
    caller's thread as uploads are handed over.  Made once (by the server) and reused every round; numpy
    releases the GIL in its ufuncs, so the ranges run at once."""

    def __init__(self, count: int = 1, behind: bool = True):
        if count < 1:
            raise ValueError(f"{count} fold threads")
        self.count, self.behind = count, behind
        self._pool = ThreadPoolExecutor(count - 1, thread_name_prefix="mpifl-fold") if count > 1 else None
        self._background: ThreadPoolExecutor | None = None

    def run(self, tasks: Sequence[Callable[[], None]]) -> None:
        """Run ``tasks`` (at most ``count``) at once, the first in this thread; return when all are done."""
        others = [self._pool.submit(task) for task in tasks[1:]]
        try:
            tasks[0]()
        finally:
            wait(others)  # every range is done before a sum is read or its uploads' buffer reused
        for future in others:
            future.result()

    def background(self, job: Callable[[], None]) -> None:
        """Start ``job`` on the background thread (jobs run one after another, in the order started)."""
        if self._background is None:
            self._background = ThreadPoolExecutor(1, thread_name_prefix="mpifl-fold-behind")
        self._background.submit(job)

    def __enter__(self) -> FoldThreads:
        return self

    def __exit__(self, *exc) -> None:
        """End the threads (after what they run)."""
        for pool in (self._pool, self._background):
            if pool is not None:
                pool.shutdown()


SERIAL = FoldThreads(1)


def ranges(sizes: Sequence[int], parts: int, block: int = SUM_BLOCK) -> list[list[tuple[int, int, int]]]:
    """The elements of arrays of ``sizes``, laid end to end in blocks of ``block`` elements (an array's last
    block shorter), cut into at most ``parts`` runs of consecutive blocks, as near equal in blocks as can be:
    each run as its (array, start, stop) element ranges, every start at a block boundary of its array."""
    blocks = [-(-n // block) for n in sizes]
    total = sum(blocks)
    parts = max(1, min(parts, total))
    cuts = [total * i // parts for i in range(parts + 1)]
    runs = []
    for low, high in zip(cuts, cuts[1:]):
        run, first = [], 0
        for index, count in enumerate(blocks):
            start, stop = max(low, first), min(high, first + count)
            if start < stop:
                run.append((index, (start - first) * block, min(sizes[index], (stop - first) * block)))
            first += count
        runs.append(run)
    return runs


def _fold(sums: Sequence[tuple[np.ndarray, list[tuple[float, np.ndarray]]]], threads: FoldThreads) -> None:
    """Add sum_k c_k x_k to each flat float64 ``acc`` of ``sums`` [(acc, [(c_k, flat x_k), ...])], over element
    ranges on ``threads``.  Block by block, every term of a block in order before the next block: each element's
    sum is one chain of additions in the terms' order, whichever thread runs its range.  A term is x_k made
    float64, then times c_k (what float64(x_k) * c_k gives, a little faster than one cast multiply)."""
    size = SUM_BLOCK if threads.count == 1 else SHARED_BLOCK

    def fold(run: list[tuple[int, int, int]]) -> Callable[[], None]:
        def task() -> None:
            scratch = np.empty(min(size, max((stop - start for _, start, stop in run), default=0)), dtype=np.float64)
            for index, start, stop in run:
                acc, terms = sums[index]
                for low in range(start, stop, size):
                    high = min(low + size, stop)
                    block, term = acc[low:high], scratch[:high - low]
                    for c, x in terms:
                        np.copyto(term, x[low:high])
                        term *= c
                        block += term
        return task

    threads.run([fold(run) for run in ranges([acc.size for acc, _ in sums], threads.count, size)])


def _terms(values: Sequence[np.ndarray], coefficients: np.ndarray) -> list[tuple[float, np.ndarray]]:
    if not all(np.issubdtype(v.dtype, np.floating) for v in values):
        raise TypeError("only floating-point tensors can be summed")
    return [(c, np.ravel(x)) for c, x in zip(coefficients, values) if c]


class Folding:
    """Float64 running sums of ``reductions`` (by name), fed the round's uploads in client-id order, folded
    on ``threads``."""

    def __init__(self, reductions: Mapping[str, Reduction], threads: FoldThreads = SERIAL):
        self.reductions = dict(reductions)
        self.threads = threads
        self.sums: dict[str, np.ndarray] = {}
        self.folded = 0  # clients added so far

    def add(self, window: Sequence[Mapping[str, np.ndarray]]) -> None:
        """Add the next ``len(window)`` clients, each a mapping from upload name to its tensor."""
        first, work = self.folded, []
        for name, reduction in self.reductions.items():
            values = [uploads[reduction.upload] for uploads in window]
            coefficients = np.asarray(reduction.coefficients, dtype=np.float64)[first:first + len(window)]
            if name not in self.sums:
                self.sums[name] = np.zeros(values[0].shape, dtype=np.float64)
            work.append((self.sums[name].reshape(-1), _terms(values, coefficients)))
        _fold(work, self.threads)
        self.folded += len(window)


class Behind:
    """Folds the windows of uploads handed to it in client-id order, on the background thread of
    ``folding.threads`` while the caller receives the next ones (in the caller's thread where the threads are
    not ``behind``).  Each pass folds every upload handed over since the last pass as one window (each block of
    the sums is read once per window), so the sums are the chain of additions in client-id order."""

    def __init__(self, folding: Folding):
        self.folding = folding
        self._handed: list[Mapping[str, np.ndarray]] = []  # not folded yet
        self._running = False  # a pass is on the background thread
        self._failed: BaseException | None = None
        self._changed = threading.Condition()

    def hand(self, window: Sequence[Mapping[str, np.ndarray]]) -> None:
        """The next clients' uploads; they must stay as they are until :meth:`wait` says they are folded."""
        if not self.folding.threads.behind:
            self.folding.add(window)
            return
        with self._changed:
            self._handed += window
            if not self._running:
                self._running = True
                self.folding.threads.background(self._drain)

    def wait(self, clients: int) -> None:
        """Return once the first ``clients`` uploads handed over are folded; raise what the fold raised."""
        with self._changed:
            self._changed.wait_for(lambda: self._failed or self.folding.folded >= clients)
            if self._failed:
                raise self._failed

    def _drain(self) -> None:
        while True:
            with self._changed:
                window, self._handed = self._handed, []
                if not window or self._failed:
                    self._running = False
                    self._changed.notify_all()
                    return
            try:
                self.folding.add(window)
            except BaseException as exc:  # for wait() to raise in the caller's thread
                self._failed = exc
            with self._changed:
                self._changed.notify_all()


def weighted_mean(values: Sequence[np.ndarray], weights: np.ndarray) -> np.ndarray:
    """sum_k w_k x_k / sum_k w_k in float64, accumulated in client-id order (:func:`weighted_sum`)."""
    if len(weights) != len(values):
        raise ValueError(f"{len(weights)} weights for {len(values)} uploads")
    return weighted_sum(values, mean_weights(weights))


def weighted_sum(values: Sequence[np.ndarray], coefficients: Sequence[float],
                 out: np.ndarray | None = None, threads: FoldThreads = SERIAL) -> np.ndarray:
    """``out`` + sum_k c_k x_k in float64 (``out`` None: a new zero sum), accumulated in client-id order;
    terms with c_k = 0 are skipped.

    A fixed order makes the result independent of which rank trained which client (rank-count
    invariance), and of how the clients are split into calls: each element's sum is the same chain of
    additions.  The sum runs block by block over the elements, every client's term of a block before the
    next block, so the partial sum never leaves the cache: each upload is read once and the result
    written once (3x faster than whole-array passes for a 50 MB model, with the same bits).  ``threads``
    share the blocks in runs of consecutive ones; an element's chain is the same whichever runs it.
    """
    terms = _terms(values, np.asarray(coefficients, dtype=np.float64))
    acc = np.zeros(values[0].shape, dtype=np.float64) if out is None else out
    _fold([(acc.reshape(-1), terms)], threads)
    return acc
