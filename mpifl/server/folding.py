"""Rank 0's fold: the clients' uploads added into the algorithm's float64 sums as they arrive, on threads.

The sums and the kernel are the algorithm's (:mod:`mpifl.algorithms.core.reduction`); this module runs them.  A
fold cuts its sums into runs of consecutive blocks (:func:`ranges`), one per thread: the calling thread folds the
first, pool threads the others, each with :func:`~mpifl.algorithms.core.reduction.fold_ranges`, so each element's
sum is the same chain of additions in client-id order whichever thread folds it, and for any number of threads.
numpy releases the GIL inside its elementwise loops, so the runs proceed at once.  :class:`Behind` folds the
windows of uploads on one more thread while rank 0 receives the next.

``--fold-threads`` (:func:`fold_threads`) is the number of threads of a fold; what they cost and gain is in
docs/benchmarks.md, "Rank 0's fold on several cores".
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Callable, Mapping, Sequence

import numpy as np

from ..algorithms import Reduction
from ..algorithms.core.reduction import SUM_BLOCK, fold_ranges, terms
from ..transport.topology import NodeLayout

#: Elements per block of a fold that several threads share: each numpy call then keeps the GIL released long
#: enough that a thread seldom waits for it; a thread's part of the sums, its term and the upload's block take
#: 1.3 MB of its L2 cache (docs/benchmarks.md, "Rank 0's fold on several cores")
SHARED_BLOCK = 4 * SUM_BLOCK
#: at most this many threads fold automatically: a fold streams memory, which a few cores fill (not measured
#: beyond 2 cores: docs/benchmarks.md)
AUTO_FOLD_CORES = 8


def fold_threads(layout: NodeLayout, requested: int, cores: Sequence[frozenset[int]],
                 threads: Sequence[int]) -> tuple[int, bool]:
    """Rank 0's threads for folding the uploads, and whether they fold behind its receives (``--fold-threads``;
    0 = automatic).  Given, they fold behind, on at most the cores rank 0 may run on (a thread beyond them would
    only wait for a core).  Automatic: the spare cores, those rank 0 may run on less the ones its node's client
    ranks train on, at least 1 and at most :data:`AUTO_FOLD_CORES`; behind only where one is spare (else a fold
    behind the receives takes the core of a rank that trains or sends, and rank 0 folds between them).
    ``cores`` and ``threads``: each rank's cores (:func:`~mpifl.transport.topology.affinity`) and the threads it
    trains on (its torch threads; one for a rank that trains on a GPU), indexed by world rank; a client rank takes
    its threads, or the cores it shares with rank 0 where fewer (one bound to cores of its own takes none)."""
    mine = cores[layout.rank]
    if requested > 0:
        return min(requested, len(mine)), True
    spare = len(mine) - sum(min(threads[rank], len(cores[rank] & mine)) for rank in layout.client_ranks)
    return max(1, min(spare, AUTO_FOLD_CORES)), spare > 0


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


class FoldThreads:
    """``count`` threads that share every fold by element ranges: the thread that folds and ``count - 1`` pool
    threads.  With ``behind``, :class:`Behind` folds on one more thread while its caller receives (rank 0 has a
    core that no client rank trains on); without, in the caller's thread as uploads are handed over.  Made once
    (by the server) and reused every round; ``with`` ends its threads."""

    def __init__(self, count: int = 1, behind: bool = True):
        if count < 1:
            raise ValueError(f"{count} fold threads")
        self.count, self.behind = count, behind
        self._pool = ThreadPoolExecutor(count - 1, thread_name_prefix="mpifl-fold") if count > 1 else None
        self._background: ThreadPoolExecutor | None = None

    def fold(self, sums: Sequence[tuple[np.ndarray, list[tuple[float, np.ndarray]]]], zero: bool = False) -> None:
        """Add sum_k c_k x_k to each flat float64 ``acc`` of ``sums`` [(acc, [(c_k, flat x_k), ...])] (with
        ``zero``, set each to it), a run of blocks on each thread."""
        block = SUM_BLOCK if self._pool is None else SHARED_BLOCK
        runs = ranges([acc.size for acc, _ in sums], self.count, block)
        others = [self._pool.submit(fold_ranges, sums, run, zero, block) for run in runs[1:]]
        try:
            fold_ranges(sums, runs[0], zero, block)
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


class Folding:
    """Float64 running sums of ``reductions`` (by name), fed the round's uploads in client-id order, folded on
    ``threads`` (None: on the caller's thread alone); reductions without coefficients: sums modulo 2^w in the
    uploads' own w-bit integers (secure aggregation's masked words)."""

    def __init__(self, reductions: Mapping[str, Reduction], threads: FoldThreads | None = None):
        self.reductions = dict(reductions)
        self.coefficients = {name: None if r.coefficients is None else np.asarray(r.coefficients, dtype=np.float64)
                             for name, r in self.reductions.items()}
        self.threads = threads or FoldThreads()
        self.sums: dict[str, np.ndarray] = {}
        self.folded = 0  # clients added so far

    def add(self, window: Sequence[Mapping[str, np.ndarray]]) -> None:
        """Add the next ``len(window)`` clients, each a mapping from upload name to its tensor."""
        first, work = self.folded, []
        if not first:  # one block for all sums, zeroed by the first fold as it reaches each part
            shapes = {name: np.shape(window[0][reduction.upload]) for name, reduction in self.reductions.items()}
            offsets = np.cumsum([0] + [int(np.prod(shape)) for shape in shapes.values()])
            modular = [r.upload for name, r in self.reductions.items() if self.coefficients[name] is None]
            block = np.empty(offsets[-1], dtype=window[0][modular[0]].dtype if modular else np.float64)
            self.sums = {name: block[low:high].reshape(shape)
                         for (name, shape), low, high in zip(shapes.items(), offsets, offsets[1:])}
        for name, reduction in self.reductions.items():
            coefficients = self.coefficients[name]
            coefficients = None if coefficients is None else coefficients[first:first + len(window)]
            work.append((self.sums[name].reshape(-1), terms([uploads[reduction.upload] for uploads in window],
                                                            coefficients)))
        self.threads.fold(work, zero=not first)
        self.folded += len(window)


class Behind:
    """Folds the windows of uploads handed to it in client-id order, on the background thread of
    ``folding.threads`` while the caller receives the next ones (in the caller's thread where the threads do not
    fold ``behind``).  Each pass folds every upload handed over since the last pass as one window (each block of
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
